"""Chat templates: the built-in Gemma turn template and `--chat-template` resolution.

Why a built-in template: GGUF files of Gemma 3 carry no `tokenizer.chat_template`, yet chat requests
must be formatted exactly as Gemma was trained (turn markers, BOS first, system text folded into the
first user turn, since Gemma has no system role).
"""

from __future__ import annotations

from pathlib import Path

# Written for kvserve; renders the same text as Gemma's published turn format:
#   <bos><start_of_turn>user\n{system}\n\n{user}<end_of_turn>\n<start_of_turn>model\n{reply}<end_of_turn>\n...
GEMMA_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(prefix='') -%}"
    "{%- set turns = messages -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.prefix = messages[0]['content'] ~ '\\n\\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for m in turns -%}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Gemma chat: roles must alternate user/assistant/user/..., after an optional system message') -}}"
    "{%- endif -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{{- '<start_of_turn>' ~ role ~ '\\n' -}}"
    "{%- if loop.first -%}{{- ns.prefix -}}{%- endif -%}"
    "{{- m['content'] | trim -}}"
    "{{- '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

# Model families (GGUF `general.architecture` / HF `model_type`) whose files may lack a template.
_BUILTIN_TEMPLATES = {"gemma3": GEMMA_CHAT_TEMPLATE, "gemma3_text": GEMMA_CHAT_TEMPLATE}


def builtin_chat_template(architecture: str) -> str | None:
    """The template kvserve supplies for a family whose checkpoints may ship without one."""
    return _BUILTIN_TEMPLATES.get(architecture)


def resolve_chat_template(value: str) -> str:
    """`--chat-template` value -> template text: an existing file's contents, else a jinja2 string.

    Like vLLM: a path that exists is read; a string that looks like jinja2 is used as is; anything else
    is an error (most likely a mistyped path), rather than a template that prints the path.
    """
    path = Path(value).expanduser()
    try:
        is_file = len(value) < 4096 and path.is_file()
    except OSError:
        is_file = False
    if is_file:
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat template file {path}: cannot read it: {e}") from e
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(
        f"--chat-template {value!r}: no such file, and not a jinja2 template string (no '{{{{' or '{{%')"
    )
