"""Tokenizer: a thin wrapper over an HF fast tokenizer, for HF checkpoint dirs and GGUF files.

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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.model.chat_template import builtin_chat_template, resolve_chat_template
from kvserve.model.source import ModelFormat, ModelSource

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_CACHE_FORMAT = 1  # bump when what is stored in a tokenizer cache entry changes
_META_FILE = "kvserve_tokenizer.json"
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class Tokenizer:
    """Encode/decode and chat formatting for one model; `hf` is the underlying fast tokenizer."""

    def __init__(self, hf: PreTrainedTokenizerBase, chat_template: str | None = None, name: str = "") -> None:
        self.hf = hf
        self.name = name
        self.chat_template = chat_template
        self.bos_token_id: int | None = hf.bos_token_id
        self.eos_token_id: int | None = hf.eos_token_id
        self.bos_token: str | None = hf.bos_token if self.bos_token_id is not None else None
        self.vocab_size: int = len(hf)
        self.add_bos: bool = self._detect_add_bos()
        # Ids that skip_special_tokens removes: the named specials plus added tokens flagged special
        # (e.g. Gemma's <start_of_turn>/<end_of_turn>), which `all_special_ids` does not list.
        specials = set(hf.all_special_ids)
        specials.update(i for i, tok in hf.added_tokens_decoder.items() if tok.special)
        self.special_ids: frozenset[int] = frozenset(specials)

    def _detect_add_bos(self) -> bool:
        """Whether the tokenizer's own post-processor puts BOS in front (Gemma, Llama: yes; Qwen: no)."""
        if self.bos_token_id is None:
            return False
        ids = self.hf.encode("a", add_special_tokens=True)
        plain = self.hf.encode("a", add_special_tokens=False)
        return ids[:1] == [self.bos_token_id] and plain[:1] != [self.bos_token_id]

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self.special_ids)

    def token_to_id(self, token: str) -> int | None:
        """Id of one vocabulary entry (e.g. "<end_of_turn>"), None if it is not in the vocabulary."""
        tid = self.hf.convert_tokens_to_ids(token)
        if tid is None or (tid == self.hf.unk_token_id and token != self.hf.unk_token):
            return None
        return int(tid)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; with add_special_tokens, BOS once if the model wants it, even if `text` wrote it."""
        ids = self.hf.encode(text, add_special_tokens=False)
        if add_special_tokens and self.add_bos and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]  # type: ignore[list-item]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, chat_template: str | None = None
    ) -> str:
        """Render messages to prompt text; ValueError (a 400 for the server) on anything malformed."""
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError(
                f"model {self.name or '?'} has no chat template; pass one with --chat-template (a file or a string)"
            )
        normalized = [_normalize_message(m, i) for i, m in enumerate(messages)]
        from jinja2 import TemplateError

        try:
            out = self.hf.apply_chat_template(
                normalized, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e
        if not isinstance(out, str):
            raise TypeError(f"chat template rendered {type(out).__name__}, expected str")
        return out


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
        hf, template = _load_hf_dir(source.path)
    else:
        hf, template = _load_gguf(source.path, Path(cache_dir) if cache_dir else default_cache_dir())
    return Tokenizer(hf, override if override is not None else template, source.name)


def default_cache_dir() -> Path:
    """$KVSERVE_CACHE_DIR, else $XDG_CACHE_HOME/kvserve, else ~/.cache/kvserve."""
    if os.environ.get("KVSERVE_CACHE_DIR"):
        return Path(os.environ["KVSERVE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvserve"


def _load_hf_dir(path: Path) -> tuple[PreTrainedTokenizerBase, str | None]:
    if not any((path / f).is_file() for f in _HF_TOKENIZER_FILES):
        raise ValueError(f"{path}: no tokenizer files (expected one of {', '.join(_HF_TOKENIZER_FILES)})")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        _check_json(path / name)
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types here; name the directory either way
        raise ValueError(f"{path}: cannot load the tokenizer: {type(e).__name__}: {e}") from e
    template = hf.chat_template if isinstance(hf.chat_template, str) else None
    if template is None:
        template = builtin_chat_template(_hf_model_type(path))
    return hf, template


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
    import tokenizers
    import transformers

    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|tf {transformers.__version__}|"
    ident += f"tk {tokenizers.__version__}|fmt {_CACHE_FORMAT}"
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def gguf_tokenizer_cache_path(path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Where the converted tokenizer of this GGUF file is (or will be) cached."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return root / "tokenizers" / _gguf_cache_key(Path(path))


def _load_gguf(path: Path, cache_root: Path) -> tuple[PreTrainedTokenizerBase, str | None]:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    entry = gguf_tokenizer_cache_path(path, cache_root)
    meta_file = entry / _META_FILE
    if meta_file.is_file():
        try:
            meta = json.loads(meta_file.read_text(encoding="utf-8"))
            # The entry is a fast tokenizer we wrote: load it as one. AutoTokenizer would pick the model's own
            # class (GemmaTokenizer), which rebuilds the 262k vocabulary in Python: 4 s against 2 s.
            hf = PreTrainedTokenizerFast.from_pretrained(str(entry), local_files_only=True)
            logger.debug("tokenizer for %s loaded from cache %s", path, entry)
            return hf, meta.get("chat_template")
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

    t0 = time.perf_counter()
    try:
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:
        raise ValueError(f"{path}: cannot build a tokenizer from the GGUF vocabulary: {type(e).__name__}: {e}") from e
    logger.info("built tokenizer from %s in %.1f s; caching it in %s", path.name, time.perf_counter() - t0, entry)
    _store(entry, hf, {"source": str(path.resolve()), "architecture": arch, "chat_template": template})
    return hf, template


def _store(entry: Path, hf: PreTrainedTokenizerBase, meta: dict) -> None:
    """Write the cache entry atomically (a temp dir renamed into place); failure only costs speed."""
    tmp: Path | None = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
        hf.save_pretrained(str(tmp))
        (tmp / _META_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        os.rename(tmp, entry)
        tmp = None
    except OSError as e:
        if not (entry / _META_FILE).is_file():  # another process winning the race is fine
            logger.warning("could not cache the tokenizer in %s: %s", entry, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
