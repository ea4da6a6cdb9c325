"""Prompt preparation (tokenizing, chat templating, the truncate policy's search) on one thread of its own.

Why not on the event loop: tokenizing costs about a microsecond per character and a chat template is a
program, so one long prompt held there would stall every open stream and every probe for as long. Why one
dedicated thread rather than the default executor: the thread owns a tokenizer of its own, built here from the
front end's (TokenizerSnapshot), so no tokenizer object is used by two threads (the event loop detokenizes the
streams and decodes logprob windows with the front end's own), and preparations run one at a time in arrival
order, so a burst of huge prompts queues here instead of taking every core.

Everything here is synchronous and runs on that thread; the handlers `await` it through `run`. Errors keep
their meaning: ValueError and APIError raised here become the same 400s as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kvserve.engine.facts import EngineFacts, validate_request
from kvserve.model.prefix_encoding import EncodedText, PrefixEncoder
from kvserve.server.errors import bad_request
from kvserve.server.sampling import check_fits, fits

if TYPE_CHECKING:
    from kvserve.model.chat_template import ToolPromptStyle
    from kvserve.model.tokenizer import Tokenizer, TokenizerSnapshot
    from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")

_HEAD_ROLES = ("system", "developer")


def max_prompt_chars(tokenizer: Tokenizer, max_model_len: int) -> int:
    """Text longer than this cannot fit in max_model_len tokens: no token covers more characters than
    the longest vocabulary entry (x2 for normalizers that compose characters). Checked before tokenizing,
    so a multi-megabyte prompt costs a length check, not seconds of the preparation thread."""
    longest = max((len(t) for t in tokenizer.vocab()), default=1)
    return max_model_len * max(longest, 1) * 2


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prepared prompt: its token ids and the text echo shows."""

    text: str
    token_ids: list[int]


def split_turns(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    """(leading system messages, turns): a turn starts at each user message and runs to the next one."""
    head_len = 0
    while head_len < len(messages) and messages[head_len].get("role") in _HEAD_ROLES:
        head_len += 1
    turns: list[list[dict[str, Any]]] = []
    for m in messages[head_len:]:
        if not turns or (m.get("role") == "user" and turns[-1] and any(x.get("role") == "user" for x in turns[-1])):
            turns.append([m])
        else:
            turns[-1].append(m)
    return messages[:head_len], turns


class RenderedTokens:
    """The encodings of the last few rendered chat prompts, by (cache salt, text): a memo of the preparation thread.

    Why: an agent's request is rendered several times. /v1/messages places each `cache_control` mark by rendering the
    conversation up to it (kvserve.server.cache_control), and the whole conversation again for the prompt itself; a
    Claude Code turn has three marks, two on its system prompt and tools, whose renders are the same text every turn.
    At 19k tokens each encode costs 70-150 ms on a 2-core host. A text seen before is not encoded again, and a new
    one (this turn's conversation, its newest mark) is encoded from the earlier render that shares the most of it
    (kvserve.model.prefix_encoding): only its new turns are tokenized. Keyed by the cache salt as well as the text,
    as the prefix cache is, and a text reuses only its own salt's renders: reuse is faster, and a client must not
    learn from timing that another tenant sent the same text. Bounded by the tokens it keeps (`max_tokens`, a few
    contexts' worth)."""

    def __init__(self, max_tokens: int, reuse_candidates: int = 8) -> None:
        self.max_tokens = max_tokens
        self.reuse_candidates = reuse_candidates  # the salt's newest renders a new text may extend
        self._encoded: OrderedDict[tuple[str | None, str], EncodedText] = OrderedDict()
        self._held = 0

    def get(self, salt: str | None, text: str, encoder: PrefixEncoder) -> list[int]:
        key = (salt, text)
        hit = self._encoded.get(key)
        if hit is not None:
            self._encoded.move_to_end(key)
            return list(hit.ids)
        same_salt = [e for (s, _), e in reversed(self._encoded.items()) if s == salt][: self.reuse_candidates]
        encoded = encoder.extend(text, same_salt)
        if len(encoded.ids) <= self.max_tokens:
            self._encoded[key] = encoded
            self._held += len(encoded.ids)
            while self._held > self.max_tokens:
                self._held -= len(self._encoded.popitem(last=False)[1].ids)
        return list(encoded.ids)


@dataclass(frozen=True, slots=True)
class _ThreadTokenizer:
    """The preparation thread's own tokenizer and the prompt length it bounds."""

    tokenizer: Tokenizer
    max_prompt_chars: int
    prefix_encoder: PrefixEncoder  # over the same tokenizer, for RenderedTokens

    @classmethod
    def build(cls, snapshot: TokenizerSnapshot, max_model_len: int) -> _ThreadTokenizer:
        tokenizer = snapshot.build()
        return cls(tokenizer, max_prompt_chars(tokenizer, max_model_len), PrefixEncoder(tokenizer))


class PromptPreparer:
    """Owns the preparation thread and the server's tokenizers, built from the engine's snapshot; one per app."""

    def __init__(self, snapshot: TokenizerSnapshot, facts: EngineFacts) -> None:
        self.facts = facts
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-prepare")
        # The thread's first job (about a second for a 262k vocabulary, off the start-up path): its own tokenizer.
        # One worker runs jobs in order, so every preparation, queued behind it, finds it built.
        self._own: Future[_ThreadTokenizer] = self._executor.submit(
            _ThreadTokenizer.build, snapshot, facts.max_model_len
        )
        self._rendered = RenderedTokens(4 * facts.max_model_len)  # read on the preparation thread only

    @property
    def _tokenizer(self) -> Tokenizer:
        """The preparation thread's tokenizer (read on that thread only, where it is always built already)."""
        return self._own.result().tokenizer

    @property
    def max_prompt_chars(self) -> int:
        return self._own.result().max_prompt_chars

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the preparation thread; the event loop stays free meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        """Stop the thread; preparations not yet started are dropped (their requests are gone anyway)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- on the preparation thread --------------------------------------------------------------

    def warm(self) -> None:
        """Import the chat-template renderer now, so that the first chat request does not pay for it."""
        self._tokenizer.prepare_chat_template()

    def check_chars(self, text: str, param: str = "prompt") -> None:
        """400 for text that cannot fit in max-model-len tokens, before spending seconds tokenizing it."""
        if len(text) > self.max_prompt_chars:
            raise bad_request(
                f"The prompt has {len(text)} characters, more than max-model-len ({self.facts.max_model_len} "
                f"tokens) can hold with this tokenizer (at most {self.max_prompt_chars} characters); shorten it.",
                param=param,
            )

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        self.check_chars(text, param)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def completion_prompts(
        self,
        items: Sequence[str | list[int]],
        params: SamplingParams,
        max_tokens: int | None,
        skip_special_tokens: bool,
    ) -> list[Prompt]:
        """Token ids and echo text of each prompt, each checked as the engine will check it, and against
        the tokens asked for (`max_tokens` as the client gave it)."""
        prompts = []
        for item in items:
            ids = self.encode(item) if isinstance(item, str) else list(item)
            validate_request(self.facts, ids, params)  # empty, out-of-vocabulary ids (before decoding them)
            check_fits(len(ids), max_tokens, self.facts.max_model_len)
            text = item if isinstance(item, str) else self._tokenizer.decode(ids, skip_special_tokens)
            prompts.append(Prompt(text, ids))
        return prompts

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        render: ChatRender,
        params: SamplingParams,
        max_tokens: int | None,
        truncate: bool,
    ) -> tuple[list[int], int]:
        """The chat's prompt ids, checked, and how many old turns were dropped to make it fit (truncate)."""
        ids, dropped = self._render_fitting(messages, render, max_tokens, truncate)
        check_fits(len(ids), max_tokens, self.facts.max_model_len)  # first: its 400 names the field (`param`)
        validate_request(self.facts, ids, params)
        return ids, dropped

    def _render_text(self, messages: list[dict[str, Any]], render: ChatRender) -> str:
        return self._tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=render.add_generation_prompt,
            chat_template=render.chat_template,
            tools=render.tools,
            tool_style=render.tool_style,
        )

    def _render(self, messages: list[dict[str, Any]], render: ChatRender) -> list[int]:
        text = self._render_text(messages, render)
        self.check_chars(text, "messages")
        return self._encode_rendered(text, render)

    def _encode_rendered(self, text: str, render: ChatRender) -> list[int]:
        return self._rendered.get(render.cache_salt, text, self._own.result().prefix_encoder)

    def _render_if_fits(
        self, messages: list[dict[str, Any]], render: ChatRender, max_tokens: int | None
    ) -> list[int] | None:
        """The prompt's ids if they fit max-model-len with `max_tokens`, else None (no error: the truncate policy's
        search tries shorter histories next). Text past the character bound cannot fit and is not tokenized."""
        text = self._render_text(messages, render)
        if len(text) > self.max_prompt_chars:
            return None
        ids = self._encode_rendered(text, render)
        return ids if fits(len(ids), max_tokens, self.facts.max_model_len) else None

    def _render_fitting(
        self, messages: list[dict[str, Any]], render: ChatRender, max_tokens: int | None, truncate: bool
    ) -> tuple[list[int], int]:
        """The prompt, and how many old turns the truncate policy dropped for it to fit. Every candidate, the whole
        history first, is judged by whether it fits (characters, then tokens), never refused on the way: a history
        past the character bound is what truncation is for."""
        if not truncate:
            return self._render(messages, render), 0
        whole = self._render_if_fits(messages, render, max_tokens)
        if whole is not None:
            return whole, 0
        head, turns = split_turns(messages)
        best: tuple[list[int], int] | None = None
        lo, hi = 1, len(turns) - 1  # turns to drop; the last turn always stays
        while lo <= hi:  # fewer dropped turns never make the prompt shorter, so the first fit is a boundary
            mid = (lo + hi) // 2
            candidate = self._render_if_fits(head + [m for turn in turns[mid:] for m in turn], render, max_tokens)
            if candidate is not None:
                best, hi = (candidate, mid), mid - 1
            else:
                lo = mid + 1
        if best is not None:
            return best
        # Nothing fits: the 400 of the shortest candidate (the head and the last turn), which says what to shorten.
        return self._render(head + (turns[-1] if turns else []), render), max(len(turns) - 1, 0)

    def tokenize_messages(self, messages: list[dict[str, Any]], render: ChatRender) -> list[int]:
        return self._render(messages, render)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        return [self._tokenizer.id_to_token(i) or "" for i in ids]

    def detokenize(self, ids: Sequence[int]) -> str:
        check_token_ids(self.facts, ids)
        return self._tokenizer.decode(ids, skip_special_tokens=False)


@dataclass(frozen=True, slots=True)
class ChatRender:
    """How a chat request asks for its messages to be rendered: with its tools, written in `tool_style` where the
    template does not render them (kvserve.model.chat_template.tool_fallback_messages)."""

    add_generation_prompt: bool = True
    chat_template: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_style: ToolPromptStyle | None = None
    cache_salt: str | None = None  # whose earlier renders' tokens it may reuse (RenderedTokens)


def check_token_ids(facts: EngineFacts, ids: Sequence[int]) -> None:
    """400 (param `tokens`) for ids outside the vocabulary: decoding them would fail in the tokenizer."""
    bad = next((t for t in ids if not 0 <= t < facts.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is out of the vocabulary (0..{facts.vocab_size - 1})", param="tokens")
