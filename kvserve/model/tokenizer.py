"""Tokenizer: a thin wrapper over a `tokenizers` fast tokenizer, for HF checkpoint dirs and GGUF files.

Why a wrapper at all: the engine needs one BOS rule (a string prompt gets BOS once, never twice when a
chat template already wrote it), one chat-template rule (the checkpoint's, a built-in one for families
whose files lack it, or `--chat-template`), and a fast second start for GGUF files, whose vocabulary
transformers converts to a fast tokenizer in ~20 s; the result is cached under ~/.cache/kvserve.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.model.chat_template import (
    SYSTEM_TURN_PROBE,
    JSONToolStyle,
    ToolPromptStyle,
    builtin_chat_template,
    folded_system_messages,
    has_inner_system,
    has_system_turn,
    renders_inner_system,
    resolve_chat_template,
    tool_fallback_messages,
    tool_support,
)
from kvserve.model.source import ModelFormat, ModelSource

if TYPE_CHECKING:
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_CACHE_FORMAT = 2  # bump when what is stored in a tokenizer cache entry changes
_META_FILE = "kvserve_tokenizer.json"
_MAX_PROBED_TEMPLATES = 16  # templates whose system-turn probe is remembered (a request may bring its own)
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class Tokenizer:
    """Encode/decode and chat formatting for one model, over a `tokenizers.Tokenizer` (the Rust fast tokenizer).

    transformers builds the tokenizer (from an HF checkpoint dir, or from a GGUF vocabulary once, then cached),
    but is not needed to run one: loading a cached GGUF tokenizer and everything the engine does per request
    (encode, decode, token strings) go to `tokenizers` directly. That keeps transformers' import (~1 s) and its
    tokenizer classes (~1.5 s for Gemma's 262k vocabulary) out of a later start. Decoding mirrors transformers'
    fast-tokenizer decode; chat templates are rendered by transformers' own renderer, imported on first use.
    """

    def __init__(
        self,
        backend: RawTokenizer,
        special_tokens: Mapping[str, str],
        chat_template: str | None = None,
        name: str = "",
        extra_special_ids: Iterable[int] = (),
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self.backend = backend
        self.name = name
        self.chat_template = chat_template
        self.special_tokens: dict[str, str] = dict(special_tokens)  # bos_token, eos_token, ...: what templates see
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = self.token_to_id(self.bos_token) if self.bos_token else None
        if self.bos_token_id is None:
            self.bos_token = None
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id: int | None = self.token_to_id(eos) if eos else None
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self.add_bos: bool = self._detect_add_bos()
        # Ids that skip_special_tokens removes: the named specials plus added tokens flagged special
        # (e.g. Gemma's <start_of_turn>/<end_of_turn>).
        specials = {i for i in map(self.token_to_id, self.special_tokens.values()) if i is not None}
        specials.update(extra_special_ids)
        specials.update(i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
        self.special_ids: frozenset[int] = frozenset(specials)
        self._system_turns: dict[str, bool] = {}  # template -> whether it has a system turn (probed on first need)

    @classmethod
    def from_hf(cls, hf: PreTrainedTokenizerBase, chat_template: str | None = None, name: str = "") -> Tokenizer:
        """Wraps a transformers fast tokenizer (its Rust backend and its special tokens)."""
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(
                f"{name or 'the model'}: transformers gave a slow tokenizer ({type(hf).__name__}); "
                "kvserve needs a fast one (a tokenizer.json, or files transformers can convert)"
            )
        # transformers ignores clean_up_tokenization_spaces for BPE models (it would strip real spaces).
        clean_up = bool(getattr(hf, "clean_up_tokenization_spaces", False)) and type(backend.model).__name__ != "BPE"
        return cls(backend, hf.special_tokens_map, chat_template, name, hf.all_special_ids, clean_up)

    def _detect_add_bos(self) -> bool:
        """Whether the tokenizer's own post-processor puts BOS in front (Gemma, Llama: yes; Qwen: no)."""
        if self.bos_token_id is None:
            return False
        ids = self.backend.encode("a", add_special_tokens=True).ids
        plain = self.backend.encode("a", add_special_tokens=False).ids
        return ids[:1] == [self.bos_token_id] and plain[:1] != [self.bos_token_id]

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self.special_ids)

    def token_to_id(self, token: str) -> int | None:
        """Id of one vocabulary entry (e.g. "<end_of_turn>"), None if it is not in the vocabulary."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of one id (e.g. "▁the", "<0xE4>"), None outside the vocabulary."""
        return self.backend.id_to_token(token_id)

    def vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; with add_special_tokens, BOS once if the model wants it, even if `text` wrote it."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return [*self.bos_prefix(ids), *ids] if add_special_tokens else ids

    def bos_prefix(self, ids: Sequence[int]) -> list[int]:
        """What encode with special tokens puts before a text's plain ids: BOS where the model wants it and the text
        did not write it."""
        bos = self.bos_token_id  # never None when add_bos holds
        return [bos] if self.add_bos and bos is not None and list(ids[:1]) != [bos] else []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def snapshot(self) -> TokenizerSnapshot:
        """This tokenizer as immutable values, to build independent copies from (TokenizerSnapshot.build)."""
        return TokenizerSnapshot(
            self.backend.to_str(),
            tuple(self.special_tokens.items()),
            self.chat_template,
            self.name,
            tuple(self.all_special_ids),
            self.clean_up_tokenization_spaces,
        )

    def copy(self) -> Tokenizer:
        """An independent tokenizer that encodes, decodes and templates exactly as this one (about a second for a
        262k vocabulary; see TokenizerSnapshot for building it on the thread that will own it)."""
        return self.snapshot().build()

    def prepare_chat_template(self) -> None:
        """Import the chat-template renderer (transformers, ~0.8 s) now rather than in the first chat request."""
        if self.chat_template is not None:
            from transformers.utils.chat_template_utils import render_jinja_template  # noqa: F401

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_style: ToolPromptStyle | None = None,
    ) -> str:
        """Render messages (and `tools`, OpenAI's list) to prompt text; ValueError (a 400 for the server) on anything
        malformed. Tools, tool results and assistant tool calls that the template does not render are written as
        text in `tool_style` (chat_template.tool_fallback_messages; default: the JSON style)."""
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError(
                f"model {self.name or '?'} has no chat template; pass one with --chat-template (a file or a string)"
            )
        normalized = [_normalize_message(m, i) for i, m in enumerate(messages)]
        if not normalized:
            raise ValueError("messages: at least one message is required")
        template_tools: list[dict[Any, Any] | Callable[..., Any]] | None = None
        if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in normalized):
            style = tool_style if tool_style is not None else JSONToolStyle()
            normalized, rendered_tools = tool_fallback_messages(normalized, tools, tool_support(template), style)
            template_tools = list(rendered_tools) if rendered_tools is not None else None
        from jinja2 import TemplateError

        # As transformers' apply_chat_template does: None-valued keys dropped, the named special tokens visible.
        conversation = [{k: v for k, v in m.items() if v is not None} for m in normalized]
        if not has_inner_system(conversation):
            return self._render(template, conversation, template_tools, add_generation_prompt)
        # System messages past the first: as sent where the template has a system turn and renders them all, else
        # folded into user turns (kvserve.model.chat_template.folded_system_messages).
        if self._has_system_turn(template):
            try:
                out = self._render(template, conversation, template_tools, add_generation_prompt, raw_errors=True)
                if renders_inner_system(conversation, out):
                    return out
            except TemplateError:
                pass
        folded = folded_system_messages(conversation)
        return self._render(template, folded, template_tools, add_generation_prompt)

    def _has_system_turn(self, template: str) -> bool:
        """Whether `template` has a system turn of its own (chat_template.has_system_turn), probed once per
        template."""
        known = self._system_turns.get(template)
        if known is None:
            try:
                known = has_system_turn(self._render(template, list(SYSTEM_TURN_PROBE), None, False))
            except (ValueError, TypeError):
                known = False
            if len(self._system_turns) >= _MAX_PROBED_TEMPLATES:
                self._system_turns.clear()
            self._system_turns[template] = known
        return known

    def _render(
        self,
        template: str,
        conversation: list[dict[str, Any]],
        tools: list[dict[Any, Any] | Callable[..., Any]] | None,
        add_generation_prompt: bool,
        raw_errors: bool = False,
    ) -> str:
        """The template applied to one conversation; its errors as ValueError (`raw_errors`: jinja2's own)."""
        from jinja2 import TemplateError
        from transformers.utils.chat_template_utils import render_jinja_template

        template_vars: dict[str, Any] = dict(self.special_tokens)  # template variables, not the named parameters
        try:
            # transformers annotates render_jinja_template "-> str", but it returns (rendered, generation indices)
            rendered, _ = render_jinja_template(  # type: ignore[str-unpack]
                conversations=[conversation],
                chat_template=template,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **template_vars,
            )
        except TemplateError as e:
            if raw_errors:
                raise
            raise ValueError(f"chat template error: {e}") from e
        out = rendered[0]
        if not isinstance(out, str):
            raise TypeError(f"chat template rendered {type(out).__name__}, expected str")
        return out


@dataclass(frozen=True, slots=True)
class TokenizerSnapshot:
    """A Tokenizer as plain immutable values (the Rust tokenizer's JSON and the wrapper's settings), from which a
    thread builds a Tokenizer of its own.

    Why: each tokenizer object has one user thread. The engine thread detokenizes with the engine's; the server
    prepares prompts on its preparation thread, and decodes logprob windows on the event loop, each with a copy of
    its own. A copy of a 262k vocabulary costs about a second, mostly in parsing: the server takes the snapshot
    while the engine's tokenizer is still idle (before the engine thread starts, 0.4 s for Gemma's), and builds
    each copy on the thread that will own it, off the start-up path."""

    backend_json: str
    special_tokens: tuple[tuple[str, str], ...]
    chat_template: str | None
    name: str
    special_ids: tuple[int, ...]
    clean_up_tokenization_spaces: bool

    def build(self) -> Tokenizer:
        from tokenizers import Tokenizer as RawTokenizer

        return Tokenizer(
            RawTokenizer.from_str(self.backend_json),
            dict(self.special_tokens),
            self.chat_template,
            self.name,
            self.special_ids,
            self.clean_up_tokenization_spaces,
        )


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization (WordPiece-era spaces before punctuation and contractions)."""
    for spaced, joined in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(spaced, joined)
    return text


def _normalize_message(message: Any, index: int) -> dict:
    """OpenAI message -> {"role", "content": str, ...}: text parts joined by newlines (as vLLM does)."""
    if not isinstance(message, dict) or "role" not in message:
        raise ValueError(f"messages[{index}]: expected an object with a 'role'")
    content = message.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"messages[{index}].content[{j}]: unsupported content part {kind!r} (text only)")
        text = "\n".join(texts)
    else:
        raise ValueError(f"messages[{index}].content: expected a string or a list of text parts")
    return {**message, "content": text}


# -- loading -----------------------------------------------------------------------------------------


def load_tokenizer(
    source: ModelSource, chat_template: str | None = None, cache_dir: str | Path | None = None
) -> Tokenizer:
    """The model's tokenizer; `chat_template` (a file path or jinja2 string) overrides the model's."""
    override = resolve_chat_template(chat_template) if chat_template is not None else None
    if source.format == ModelFormat.HF:
        tok = _load_hf_dir(source.path, source.name)
    else:
        tok = _load_gguf(source.path, Path(cache_dir) if cache_dir else default_cache_dir(), source.name)
    if override is not None:
        tok.chat_template = override
    return tok


def default_cache_dir() -> Path:
    """$KVSERVE_CACHE_DIR, else $XDG_CACHE_HOME/kvserve, else ~/.cache/kvserve."""
    if os.environ.get("KVSERVE_CACHE_DIR"):
        return Path(os.environ["KVSERVE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvserve"


def _load_hf_dir(path: Path, name: str) -> Tokenizer:
    if not any((path / f).is_file() for f in _HF_TOKENIZER_FILES):
        raise ValueError(f"{path}: no tokenizer files (expected one of {', '.join(_HF_TOKENIZER_FILES)})")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        _check_json(path / file)
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types here; name the directory either way
        raise ValueError(f"{path}: cannot load the tokenizer: {type(e).__name__}: {e}") from e
    template = hf.chat_template if isinstance(hf.chat_template, str) else None
    if template is None:
        template = builtin_chat_template(_hf_model_type(path))
    return Tokenizer.from_hf(hf, template, name)


def _check_json(file: Path) -> None:
    """Fail with the file's name on malformed JSON (transformers' own message does not name it)."""
    if not file.is_file():
        return
    try:
        with open(file, encoding="utf-8") as f:
            json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: malformed tokenizer file: {e}") from e


def _hf_model_type(path: Path) -> str:
    try:
        return str(json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type", ""))
    except (OSError, ValueError):
        return ""


def _gguf_cache_key(path: Path) -> str:
    # Versions from package metadata: importing transformers here would cost the second a cache hit saves.
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|tf {version('transformers')}|"
    ident += f"tk {version('tokenizers')}|fmt {_CACHE_FORMAT}"
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def gguf_tokenizer_cache_path(path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Where the converted tokenizer of this GGUF file is (or will be) cached."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return root / "tokenizers" / _gguf_cache_key(Path(path))


def _load_gguf(path: Path, cache_root: Path, name: str) -> Tokenizer:
    entry = gguf_tokenizer_cache_path(path, cache_root)
    meta_file = entry / _META_FILE
    if meta_file.is_file():
        try:
            return _load_cached(entry, json.loads(meta_file.read_text(encoding="utf-8")), name)
        except Exception as e:  # noqa: BLE001 -- a damaged cache entry is rebuilt, never fatal
            logger.warning("ignoring damaged tokenizer cache %s (%s); rebuilding", entry, e)
            shutil.rmtree(entry, ignore_errors=True)

    from kvserve.model.gguf_reader import GGUFFile

    with GGUFFile(path) as f:
        md = f.metadata
        if "tokenizer.ggml.tokens" not in md:
            raise ValueError(f"{path}: the GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
        arch = f.architecture
        template = md.get("tokenizer.chat_template")
    if not isinstance(template, str) or not template.strip():
        template = builtin_chat_template(arch)

    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    # Naming the tokenizer class by the architecture spares AutoTokenizer its config pass over the whole
    # file, which for architectures it has no fast GGUF config reader for (gemma3) parses all 262k vocabulary
    # entries with numpy: 18 s against 3.5 s, for the same tokenizer. Unknown architectures take that path.
    hints = {"tokenizer_type": arch} if TOKENIZER_MAPPING_NAMES.get(arch) else {}
    t0 = time.perf_counter()
    logger.info("building the tokenizer from the GGUF vocabulary of %s (once; a few seconds)", path.name)
    try:
        try:
            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True, **hints)
        except Exception:  # the named class may not take this file; AutoTokenizer's own pass decides
            if not hints:
                raise
            logger.info("tokenizer class %s did not load %s; letting AutoTokenizer choose", arch, path.name)
            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:
        raise ValueError(f"{path}: cannot build a tokenizer from the GGUF vocabulary: {type(e).__name__}: {e}") from e
    tok = Tokenizer.from_hf(hf, template, name)
    logger.info("built tokenizer from %s in %.1f s; caching it in %s", path.name, time.perf_counter() - t0, entry)
    _store(entry, tok, {"source": str(path.resolve()), "architecture": arch})
    return tok


def _load_cached(entry: Path, meta: dict, name: str) -> Tokenizer:
    """A cache entry we wrote: the Rust tokenizer file and, in the meta file, what transformers knew about it."""
    from tokenizers import Tokenizer as RawTokenizer

    backend = RawTokenizer.from_file(str(entry / "tokenizer.json"))
    return Tokenizer(
        backend,
        meta["special_tokens"],
        meta.get("chat_template"),
        name,
        meta["special_ids"],
        bool(meta["clean_up_tokenization_spaces"]),
    )


def _store(entry: Path, tok: Tokenizer, meta: dict) -> None:
    """Write the cache entry atomically (a temp dir renamed into place); failure only costs speed."""
    meta = {
        **meta,
        "chat_template": tok.chat_template,
        "special_tokens": tok.special_tokens,
        "special_ids": tok.all_special_ids,
        "clean_up_tokenization_spaces": tok.clean_up_tokenization_spaces,
    }
    tmp: Path | None = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
        tok.backend.save(str(tmp / "tokenizer.json"))
        (tmp / _META_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        os.rename(tmp, entry)
        tmp = None
    except OSError as e:
        if not (entry / _META_FILE).is_file():  # another process winning the race is fine
            logger.warning("could not cache the tokenizer in %s: %s", entry, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
