"""Grammar backends: xgrammar and llguidance behind one interface, built once per tokenizer, with a compile cache.

`--structured-outputs-backend xgrammar|guidance|auto` as in vLLM: auto compiles with xgrammar and falls back to
llguidance for a request xgrammar refuses (e.g. a `whitespace_pattern`, or a schema keyword xgrammar lacks), building
llguidance's tokenizer only then. Why xgrammar first: docs/STRUCTURED_OUTPUT.md, "Backend choice".

Building a backend reads the whole vocabulary (seconds for a 262k-token one) and compiling a grammar takes up to
tens of milliseconds: both belong off the engine's hot path (build at start or on the first structured request,
compile on a worker thread before the request is admitted). Compiled grammars are immutable and shared; each
request gets its own matcher from `backend.matcher(grammar)`.
"""

from __future__ import annotations

import ctypes
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvserve.structured.compile_workers import CompileTimeout, CompileWorkers
from kvserve.structured.config import StructuredOutputsConfig
from kvserve.structured.matcher import (
    GrammarMatcher,
    GuidanceMatcher,
    XgrammarMatcher,
    allocate_token_bitmask,
    allowed_tokens,
)
from kvserve.structured.params import ConstraintKind, StructuredOutputsParams
from kvserve.structured.schema_check import XGRAMMAR_UNSUPPORTED, first_unsupported, used_keywords
from kvserve.vocab import STRUCTURED_OUTPUTS_BACKENDS

if TYPE_CHECKING:
    from tokenizers import Tokenizer as RawTokenizer

    from kvserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

BACKEND_NAMES = STRUCTURED_OUTPUTS_BACKENDS  # declared once, in kvserve/vocab.py
DEFAULT_CACHE_SIZE = 256  # compiled grammars kept
_MAX_REASON_CHARS = 600
_ADMIT_PROBES = 16  # allowed first tokens tried before a grammar is called empty
_WHAT_FAILED = {
    ConstraintKind.JSON: "invalid JSON schema",
    ConstraintKind.JSON_OBJECT: "cannot compile the JSON object grammar",
    ConstraintKind.REGEX: "invalid regex",
    ConstraintKind.CHOICE: "cannot compile the choices",
    ConstraintKind.GRAMMAR: "invalid grammar",
}


class GrammarCompileError(ValueError):
    """A constraint the backend cannot compile: a 400 naming the request field and the reason.

    `field` is the StructuredOutputsParams field ("structured_outputs.json"); a server that took the schema from
    another field (response_format.json_schema.schema, guided_json, tools[i].function.parameters) rewrites it.
    `unsupported`: the JSON-schema keywords the backend lacks, when that is why it refused (a forced tool call may
    then be compiled without them: kvserve.structured.tool_schemas.compile_forced)."""

    def __init__(self, field: str, what: str, reason: str, unsupported: tuple[str, ...] = ()) -> None:
        self.field = field
        self.what = what
        self.reason = reason
        self.unsupported = unsupported
        super().__init__(f"{field}: {what}: {reason}")

    def renamed(self, field: str) -> GrammarCompileError:
        return type(self)(field, self.what, self.reason, self.unsupported)


class GrammarCompileLimit(GrammarCompileError):
    """A constraint over a compile budget of --structured-outputs-config (its source's size, its compile's time):
    a 400 naming the limit. No other backend is tried for it."""


@dataclass(frozen=True, slots=True)
class GrammarVocab:
    """What the backends read from a tokenizer, and the width of the model's logits.

    vocab_size is the model's logits width: it may exceed the tokenizer's vocabulary (a padded lm_head), and the
    ids past the tokenizer's are never allowed. Special tokens are never allowed (a grammar cannot name them, and
    the detokenizer would drop them from the text), except the stop tokens, allowed where the grammar is complete.
    """

    raw: RawTokenizer
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    special_ids: frozenset[int]

    @property
    def tokenizer_vocab_size(self) -> int:
        return self.raw.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Tokenizer, vocab_size: int | None = None, stop_token_ids: Iterable[int] | None = None
    ) -> GrammarVocab:
        """From kvserve's Tokenizer; stop tokens default to its EOS."""
        stops = tuple(dict.fromkeys(stop_token_ids)) if stop_token_ids is not None else ()
        if not stops and tokenizer.eos_token_id is not None:
            stops = (tokenizer.eos_token_id,)
        return cls.build(tokenizer.backend, vocab_size, stops, tokenizer.special_ids)

    @classmethod
    def build(
        cls, raw: RawTokenizer, vocab_size: int | None, stop_token_ids: Sequence[int], special_ids: Iterable[int]
    ) -> GrammarVocab:
        own = raw.get_vocab_size(with_added_tokens=True)
        width = own if vocab_size is None else int(vocab_size)
        if width < own:
            raise ValueError(f"vocab_size {width} is smaller than the tokenizer's vocabulary ({own} tokens)")
        if not stop_token_ids:
            raise ValueError("structured output needs at least one stop token id (the tokenizer has no EOS)")
        bad = [t for t in stop_token_ids if not 0 <= t < width]
        if bad:
            raise ValueError(f"stop token ids {bad} are outside the vocabulary (0..{width - 1})")
        return cls(raw, width, tuple(int(t) for t in stop_token_ids), frozenset(special_ids))


@dataclass(frozen=True, slots=True, eq=False)
class CompiledGrammar:
    """An immutable compiled constraint, shared by every request with the same key.

    handle: an xgrammar CompiledGrammar, or for llguidance a fresh LLMatcher that each request deep-copies."""

    key: str
    backend: str
    kind: ConstraintKind
    handle: Any


class GrammarBackend(Protocol):
    name: str
    vocab: GrammarVocab

    def compile(self, params: StructuredOutputsParams, caller: Future[Any] | None = None) -> CompiledGrammar:
        """The compiled grammar, from the cache when an equal constraint was compiled before; `caller`: the future
        of the job this compile is part of, whose cancellation abandons it (CompileAbandoned)."""
        ...

    def lookup(self, params: StructuredOutputsParams) -> CompiledGrammar | None:
        """The compiled grammar if it is cached already, else None (never compiles: cheap on any thread)."""
        ...

    def matcher(self, grammar: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher (initial state) for one request or sequence."""
        ...

    def close(self) -> None:
        """Stop what compiles run in (worker processes); a later compile starts it again."""
        ...


class GrammarCache:
    """A thread-safe LRU of compiled grammars keyed by StructuredOutputsParams.key, bounded in entries and, where
    the backend can tell a grammar's size (xgrammar: ~0.2-1 MB for a typical schema on a 262k vocabulary), bytes.

    Two threads compiling the same new key both compile it and the first result is kept: rare, and cheaper than
    a lock held across a compile that could block every other compile."""

    def __init__(
        self,
        max_size: int = DEFAULT_CACHE_SIZE,
        max_bytes: int = StructuredOutputsConfig().max_cache_bytes,  # counted where size_of is given
        size_of: Callable[[CompiledGrammar], int] | None = None,
    ) -> None:
        if max_size < 1:
            raise ValueError(f"grammar cache size must be >= 1, got {max_size}")
        self._max_size = max_size
        self._max_bytes = max_bytes
        self._size_of = size_of
        self._bytes = 0
        self._entries: OrderedDict[str, tuple[CompiledGrammar, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: str) -> CompiledGrammar | None:
        """The cached grammar under `key` (marked recently used), or None: never compiles."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return None
            self._entries.move_to_end(key)
            return hit[0]

    def get_or_compile(self, key: str, compile_fn: Callable[[], CompiledGrammar]) -> CompiledGrammar:
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit[0]
        compiled = compile_fn()
        size = self._size_of(compiled) if self._size_of is not None else 0
        with self._lock:
            if key not in self._entries:
                self._entries[key] = (compiled, size)
                self._bytes += size
            self._entries.move_to_end(key)
            kept = self._entries[key][0]
            # Evict the oldest; the newest stays even if it alone is over the byte bound (it is in use).
            while len(self._entries) > 1 and (len(self._entries) > self._max_size or self._bytes > self._max_bytes):
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted
        return kept


def _clean_reason(error: BaseException) -> str:
    """The library's message without its C++ source location prefix, bounded in length."""
    text = re.sub(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: ", "", str(error).strip())
    text = " ".join(text.split()) or type(error).__name__  # one line: it ends up in a JSON error message
    return text if len(text) <= _MAX_REASON_CHARS else text[: _MAX_REASON_CHARS - 3] + "..."


def _compile_error(params: StructuredOutputsParams, error: BaseException | str) -> GrammarCompileError:
    reason = _clean_reason(RuntimeError(error) if isinstance(error, str) else error)
    return GrammarCompileError(params.field_name, _WHAT_FAILED[params.kind], reason)


def choice_grammar_ebnf(choice: Sequence[str]) -> str:
    """`root ::= "a" | "b"`, each choice a JSON-escaped string literal (xgrammar's EBNF reads JSON escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


def is_ebnf(grammar: str) -> bool:
    """GBNF/EBNF defines rules with `::=`; Lark with `:`."""
    return "::=" in grammar


class CachedBackend:
    """What both grammar libraries share: compiles go through one GrammarCache keyed by the constraint, and a
    matcher is made only for a grammar this backend compiled. A library supplies `_compile` and `_new_matcher`."""

    name: str
    vocab: GrammarVocab
    _cache: GrammarCache

    def compile(self, params: StructuredOutputsParams, caller: Future[Any] | None = None) -> CompiledGrammar:
        return self._cache.get_or_compile(params.key, lambda: self._admitting(params, self._compile(params, caller)))

    def _admitting(self, params: StructuredOutputsParams, compiled: CompiledGrammar) -> CompiledGrammar:
        """`compiled`, once it is known to admit some output (before the cache keeps it); GrammarCompileError if
        not. A grammar whose language is empty (a schema that refers only to itself; a character class of no
        character) has a mask whose every token its matcher then refuses: the engine could only end it at once.
        Its first token is tried among those the mask allows (a few: a consistent grammar takes the first)."""
        matcher = self._new_matcher(compiled)
        bitmask = allocate_token_bitmask(1, self.vocab.vocab_size)
        matcher.fill_bitmask(bitmask, 0)
        for token_id in allowed_tokens(bitmask[0], self.vocab.vocab_size, limit=_ADMIT_PROBES):
            if matcher.accept_token(token_id):
                return compiled
        raise GrammarCompileError(params.field_name, _WHAT_FAILED[params.kind], "no output can satisfy it")

    def lookup(self, params: StructuredOutputsParams) -> CompiledGrammar | None:
        return self._cache.get(params.key)

    def matcher(self, grammar: CompiledGrammar) -> GrammarMatcher:
        if grammar.backend != self.name:
            raise ValueError(f"a grammar compiled by {grammar.backend} cannot run on the {self.name} backend")
        return self._new_matcher(grammar)

    def close(self) -> None:
        pass

    def _compile(self, params: StructuredOutputsParams, caller: Future[Any] | None) -> CompiledGrammar:
        raise NotImplementedError

    def _new_matcher(self, grammar: CompiledGrammar) -> GrammarMatcher:
        raise NotImplementedError


# -- xgrammar --------------------------------------------------------------------------------------------------


class XgrammarBackend(CachedBackend):
    """xgrammar: grammars compiled ahead (masks for context-independent tokens precomputed), fast masks."""

    name = "xgrammar"

    def __init__(
        self, vocab: GrammarVocab, cache_size: int = DEFAULT_CACHE_SIZE, config: StructuredOutputsConfig | None = None
    ) -> None:
        import xgrammar as xgr

        self.vocab = vocab
        self.config = config or StructuredOutputsConfig()
        self.tokenizer_info = _xgrammar_tokenizer_info(vocab)
        # Compiles run in worker processes (structured/compile_workers.py), bounded in time; or, with
        # compile_in_workers false, on the compile thread with this process's own compiler (1 thread: no competing
        # with the forward pass for cores). xgrammar's own cache is off: ours keys on the request's constraint.
        in_workers = self.config.compile_in_workers
        self._workers = CompileWorkers(self.tokenizer_info.serialize_json) if in_workers else None
        self._compiler = (
            None if in_workers else xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        )
        self._cache = GrammarCache(
            cache_size, self.config.max_cache_bytes, size_of=lambda g: int(g.handle.memory_size_bytes)
        )

    def _new_matcher(self, grammar: CompiledGrammar) -> GrammarMatcher:
        return XgrammarMatcher(grammar.handle, self.vocab.stop_token_ids)

    def close(self) -> None:
        if self._workers is not None:
            self._workers.close()

    def _compile(self, params: StructuredOutputsParams, caller: Future[Any] | None) -> CompiledGrammar:
        if params.whitespace_pattern is not None:
            raise GrammarCompileError(
                "structured_outputs.whitespace_pattern",
                "not supported by xgrammar",
                "use --structured-outputs-backend guidance (or auto)",
            )
        if params.kind is ConstraintKind.JSON:
            found = first_unsupported(params.schema, XGRAMMAR_UNSUPPORTED)
            if found is not None:  # xgrammar would compile it as if absent: the output would not follow it
                raise GrammarCompileError(
                    params.field_name,
                    "not supported by xgrammar",
                    f"{found[1]} at {found[0]} would not be enforced; use --structured-outputs-backend guidance "
                    "(auto does), which enforces it or refuses the schema",
                    used_keywords(params.schema, XGRAMMAR_UNSUPPORTED),
                )
        try:
            if self._workers is None:
                handle = xgrammar_compile(self._compiler, params)
            else:
                import xgrammar as xgr

                limit = self.config.max_compile_seconds
                serialized = self._workers.compile(params, limit, caller)
                handle = xgr.CompiledGrammar.deserialize_json(serialized, self.tokenizer_info)
                if len(serialized) > _TRIM_AFTER_CHARS:
                    del serialized
                    return_freed_heap()
        except CompileTimeout:
            raise GrammarCompileLimit(
                params.field_name,
                "compile took too long",
                f"stopped after max_compile_seconds {self.config.max_compile_seconds:g} (--structured-outputs-config)",
            ) from None
        except (RuntimeError, ValueError, TypeError) as e:
            raise _compile_error(params, e) from e
        return CompiledGrammar(params.key, self.name, params.kind, handle)


# A compiled grammar arrives as JSON text (a maximal choice: tens of MB) parsed into C++ objects; glibc keeps the
# freed pages of those transients in the compile thread's arena, so the server's RSS rose far past the cache's bound.
_TRIM_AFTER_CHARS = 8 << 20


def return_freed_heap() -> None:
    """glibc's malloc_trim: freed heap pages back to the OS (a no-op where the C library has none)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def xgrammar_compile(compiler: Any, params: StructuredOutputsParams) -> Any:
    """xgrammar's compiled grammar of one constraint (in this process, or a compile worker's: compile_workers.py).
    Raises what xgrammar raises (RuntimeError, ValueError, TypeError) for a constraint it refuses."""
    any_whitespace = not params.disable_any_whitespace
    if params.kind in (ConstraintKind.JSON, ConstraintKind.JSON_OBJECT):
        schema = json.dumps(params.schema)
        return compiler.compile_json_schema(schema, any_whitespace=any_whitespace, strict_mode=True)
    if params.kind is ConstraintKind.REGEX:
        return compiler.compile_regex(params.regex or "")
    if params.kind is ConstraintKind.CHOICE:
        return compiler.compile_grammar(choice_grammar_ebnf(params.choice or []))
    grammar = params.grammar or ""
    return compiler.compile_grammar(grammar) if is_ebnf(grammar) else compiler.compile_lark(grammar)


def _xgrammar_tokenizer_info(vocab: GrammarVocab) -> Any:
    """xgrammar's TokenizerInfo straight from the `tokenizers` backend (no transformers tokenizer object needed).

    Special tokens other than the stop tokens get an empty string, which xgrammar treats as special and never
    allows; ids past the tokenizer's vocabulary likewise."""
    import xgrammar as xgr

    encoded = [""] * vocab.vocab_size
    hidden = vocab.special_ids - set(vocab.stop_token_ids)
    for token, token_id in vocab.raw.get_vocab(with_added_tokens=True).items():
        if token_id < vocab.vocab_size and token_id not in hidden:
            encoded[token_id] = token
    vocab_type, add_prefix_space = _xgrammar_vocab_metadata(vocab.raw)
    return xgr.TokenizerInfo(
        encoded,
        vocab_type,
        vocab_size=vocab.vocab_size,
        stop_token_ids=list(vocab.stop_token_ids),
        add_prefix_space=add_prefix_space,
    )


def _xgrammar_vocab_metadata(raw: RawTokenizer) -> tuple[Any, bool]:
    """How the vocabulary encodes bytes (raw, byte-fallback <0xNN>, GPT-2 byte-level) and whether a space is
    prepended, as xgrammar's from_huggingface detects them (its detector reads the tokenizer's JSON)."""
    import xgrammar as xgr

    detect = getattr(xgr.TokenizerInfo, "_detect_metadata_from_hf", None)
    if detect is not None:
        meta = detect(raw.to_str())
        return meta["vocab_type"], bool(meta["add_prefix_space"])
    kind = decoder_vocab_type(raw)  # a later xgrammar without the private detector: the decoder says most of it
    return {"byte_level": xgr.VocabType.BYTE_LEVEL, "byte_fallback": xgr.VocabType.BYTE_FALLBACK}.get(
        kind, xgr.VocabType.RAW
    ), False


def decoder_vocab_type(raw: RawTokenizer) -> str:
    """ "byte_level", "byte_fallback" or "raw", from the tokenizer's decoder."""
    decoder = json.loads(raw.to_str()).get("decoder") or {}
    kinds = {d.get("type") for d in [decoder, *decoder.get("decoders", [])] if isinstance(d, dict)}
    if "ByteLevel" in kinds:
        return "byte_level"
    return "byte_fallback" if "ByteFallback" in kinds else "raw"


# -- llguidance ------------------------------------------------------------------------------------------------


class GuidanceBackend(CachedBackend):
    """llguidance: grammars compiled lazily (an Earley parser over a lexer), masks computed per step."""

    name = "guidance"

    def __init__(self, vocab: GrammarVocab, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.vocab = vocab
        self.ll_tokenizer = _guidance_tokenizer(vocab)
        # llguidance compiles lazily (fast: the work is in each step's mask, bounded by its own lexer fuel), so no
        # worker process; the source-size budget applies (GrammarCompiler). It reports no grammar's size: the entry
        # count bounds its cache.
        self._cache = GrammarCache(cache_size)

    def _new_matcher(self, grammar: CompiledGrammar) -> GrammarMatcher:
        return GuidanceMatcher(grammar.handle.deep_copy(), self.vocab.stop_token_ids, self.ll_tokenizer.vocab_size)

    def _compile(self, params: StructuredOutputsParams, caller: Future[Any] | None) -> CompiledGrammar:
        import llguidance as llg

        try:
            grammar = _guidance_grammar(params)
        except (ValueError, TypeError) as e:
            raise _compile_error(params, e) from e
        prototype = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if prototype.is_error():
            error = _compile_error(params, prototype.get_error())
            error.unsupported = _guidance_unimplemented(error.reason)
            raise error
        return CompiledGrammar(params.key, self.name, params.kind, prototype)


_UNIMPLEMENTED_RE = re.compile(r"Unimplemented keys: (\[[^\]]*\])")


def _guidance_unimplemented(reason: str) -> tuple[str, ...]:
    """The keywords llguidance names in its refusal of a schema ("Unimplemented keys: ["propertyNames"]"), if any."""
    found = _UNIMPLEMENTED_RE.search(reason)
    if found is None:
        return ()
    try:
        keys = json.loads(found.group(1))
    except json.JSONDecodeError:
        return ()
    return tuple(k for k in keys if isinstance(k, str))


def _guidance_grammar(params: StructuredOutputsParams) -> str:
    import llguidance as llg

    if params.kind in (ConstraintKind.JSON, ConstraintKind.JSON_OBJECT):
        # Strict like xgrammar (vLLM's default backend): an object that does not say otherwise takes no other
        # properties, so that auto's fallback does not change what a schema means, and a small model cannot wander
        # off into invented keys. vLLM's guidance backend does this only with disable_additional_properties.
        schema = no_additional_properties(params.schema)
        options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.disable_any_whitespace:  # xgrammar's compact separators, json.dumps' too: what models have seen
            options.update(item_separator=", ", key_separator=": ")
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]
    if params.kind is ConstraintKind.REGEX:
        return llg.LLMatcher.grammar_from_regex(params.regex or "")
    if params.kind is ConstraintKind.CHOICE:
        return llg.grammar_from("choice", params.choice)  # type: ignore[arg-type]
    return llg.grammar_from("grammar", params.grammar or "")  # Lark, or GBNF converted to Lark


def no_additional_properties(schema: Any) -> Any:
    """A copy of `schema` with additionalProperties: false on every object that does not set it (xgrammar's strict
    mode, and vLLM's disable_additional_properties, for llguidance, which otherwise allows extra properties)."""
    if isinstance(schema, list):
        return [no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: no_additional_properties(v) for k, v in schema.items()}
    # Only where this node lists the properties itself: `{"type": "object"}` alone means any object, and properties
    # listed in anyOf / allOf branches would be forbidden by a false here (llguidance then finds it unsatisfiable).
    combined = any(k in out for k in ("anyOf", "oneOf", "allOf", "$ref", "patternProperties"))
    if "properties" in out and "additionalProperties" not in out and not combined:
        out["additionalProperties"] = False
    return out


def _guidance_tokenizer(vocab: GrammarVocab) -> Any:
    """llguidance's tokenizer from the `tokenizers` JSON; a character vocabulary that its JSON reader does not
    take (no byte-level or byte-fallback decoder) goes through its Python wrapper instead."""
    import llguidance as llg

    stops = list(vocab.stop_token_ids)
    try:
        return llg.LLTokenizer(vocab.raw.to_str(), n_vocab=vocab.vocab_size, eos_token=stops)
    except ValueError as e:
        if decoder_vocab_type(vocab.raw) != "raw":
            raise ValueError(f"llguidance cannot read this tokenizer: {e}") from e
    return llg.LLTokenizer(llg.TokenizerWrapper(_RawVocabTokenizer(vocab)), eos_token=stops)


class _RawVocabTokenizer:
    """The interface llguidance's TokenizerWrapper reads, for a vocabulary whose tokens are their own text."""

    def __init__(self, vocab: GrammarVocab) -> None:
        self._raw = vocab.raw
        size = vocab.tokenizer_vocab_size
        self.tokens = [(vocab.raw.id_to_token(i) or "").encode("utf-8") for i in range(size)]
        self.special_token_ids = sorted(i for i in vocab.special_ids if i < size)
        self.eos_token_id = vocab.stop_token_ids[0]
        self.bos_token_id = None

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._raw.encode(text, add_special_tokens=False).ids


# -- auto, and building by name --------------------------------------------------------------------------------


class AutoBackend:
    """xgrammar first; a constraint it refuses is compiled by llguidance, whose tokenizer is built on first need."""

    name = "auto"

    def __init__(
        self, vocab: GrammarVocab, cache_size: int = DEFAULT_CACHE_SIZE, config: StructuredOutputsConfig | None = None
    ) -> None:
        self.vocab = vocab
        self._cache_size = cache_size
        self.primary = XgrammarBackend(vocab, cache_size, config)
        self._fallback: GuidanceBackend | None = None
        self._fallback_lock = threading.Lock()

    def close(self) -> None:
        self.primary.close()

    def compile(self, params: StructuredOutputsParams, caller: Future[Any] | None = None) -> CompiledGrammar:
        try:
            return self.primary.compile(params, caller)
        except GrammarCompileLimit:
            raise  # over a budget: not a constraint the other library should try
        except GrammarCompileError as first:
            try:
                compiled = self.fallback().compile(params, caller)
            except GrammarCompileError as second:
                # Both refused: xgrammar's "not supported" only sent it on; llguidance's reason is the one to read.
                raise (second if first.what == "not supported by xgrammar" else first) from None
            logger.info(
                "structured output: xgrammar refused a %s constraint (%s); using llguidance",
                params.kind.value,
                first.reason,
            )
            return compiled

    def lookup(self, params: StructuredOutputsParams) -> CompiledGrammar | None:
        found = self.primary.lookup(params)
        if found is None:
            with self._fallback_lock:
                fallback = self._fallback
            found = fallback.lookup(params) if fallback is not None else None
        return found

    def matcher(self, grammar: CompiledGrammar) -> GrammarMatcher:
        if grammar.backend == self.primary.name:
            return self.primary.matcher(grammar)
        return self.fallback().matcher(grammar)

    def fallback(self) -> GuidanceBackend:
        with self._fallback_lock:
            if self._fallback is None:
                self._fallback = GuidanceBackend(self.vocab, self._cache_size)
            return self._fallback


def make_backend(
    name: str, vocab: GrammarVocab, cache_size: int = DEFAULT_CACHE_SIZE, config: StructuredOutputsConfig | None = None
) -> GrammarBackend:
    """The backend `--structured-outputs-backend` names, within `config`'s budgets (default: the flag's defaults)."""
    if name == "xgrammar":
        return XgrammarBackend(vocab, cache_size, config)
    if name == "guidance":
        return GuidanceBackend(vocab, cache_size)
    if name == "auto":
        return AutoBackend(vocab, cache_size, config)
    raise ValueError(f"structured outputs backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")
