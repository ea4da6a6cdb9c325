"""Engine logprobs -> OpenAI's two logprob formats (legacy completions, and chat's `content` list).

Why token texts are decoded here, in context: a token's text depends on what precedes it (SentencePiece
drops a leading space at the start, byte-level pieces only make sense together), and text_offset must add
up to the text the client sees. So each token's text is what it adds to the decoding of a few tokens
before it, which is also how incremental detokenizers work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvserve.outputs import Logprob
from kvserve.server.protocol import ChatLogprob, ChatTopLogprob, CompletionLogprobs

if TYPE_CHECKING:
    from kvserve.model.tokenizer import Tokenizer

_CONTEXT_TOKENS = 6  # enough context for any merge of pieces into characters
_MIN_LOGPROB = -9999.0  # JSON has no -inf; a token the model rules out gets this instead


def _finite(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


LogprobEntry = dict[int, Logprob]


def context_tail(prompt: Sequence[int], generated: Sequence[int], position: int) -> list[int]:
    """The ids just before generated token `position` (reaching back into the prompt), as many as a
    token's text needs: a stream's piece is measured against these, never against the whole sequence."""
    tail = list(generated[max(0, position - _CONTEXT_TOKENS) : position])
    missing = _CONTEXT_TOKENS - len(tail)
    if missing > 0:
        tail = list(prompt[max(0, len(prompt) - missing) :]) + tail
    return tail


class TokenTexts:
    """The text each token adds after the tokens before it, decoded on the event loop with the front end's
    tokenizer (the one the streams detokenize with there; the preparation thread has its own)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def context(self, ids: Sequence[int], position: int) -> tuple[list[int], str]:
        """The few ids before `position` and their text: what that token's piece is measured against."""
        window = list(ids[max(0, position - _CONTEXT_TOKENS) : position])
        return window, self.decode(window) if window else ""

    def piece(self, context: tuple[list[int], str], token_id: int) -> str:
        window, before = context
        after = self.decode([*window, token_id])
        if window and after.startswith(before):
            return after[len(before) :]
        return self.decode([token_id])

    def is_special(self, token_id: int) -> bool:
        return token_id in self._tokenizer.special_ids


def completion_logprobs(
    texts: TokenTexts,
    context: Sequence[int],
    token_ids: Sequence[int],
    entries: Sequence[LogprobEntry | None],
    text_offset: int,
    skip_special_tokens: bool = True,
) -> CompletionLogprobs:
    """Legacy format for `token_ids` (which follow `context`): one entry per token; an entry of None (the
    first prompt token, which nothing predicts) gives null logprobs. top_logprobs holds the token itself
    and the top-n, so the argmax is always there; tokens that decode alike keep the highest logprob."""
    out = CompletionLogprobs()
    full = [*context, *token_ids]
    for i, (tid, entry) in enumerate(zip(token_ids, entries)):
        ctx = texts.context(full, len(context) + i)
        piece = texts.piece(ctx, tid)
        out.tokens.append(piece)
        out.text_offset.append(text_offset)
        if not (skip_special_tokens and texts.is_special(tid)):
            text_offset += len(piece)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_finite(entry[tid].logprob))
        top: dict[str, float] = {}
        for alt, lp in entry.items():
            key = piece if alt == tid else texts.piece(ctx, alt)
            if key not in top or _finite(lp.logprob) > top[key]:
                top[key] = _finite(lp.logprob)
        out.top_logprobs.append(top)
    return out


def chat_logprobs(
    texts: TokenTexts,
    context: Sequence[int],
    token_ids: Sequence[int],
    entries: Sequence[LogprobEntry],
    num_top: int,
) -> list[ChatLogprob]:
    """Chat format: per token its text, logprob and UTF-8 bytes, and the `num_top` most likely tokens."""
    out = []
    full = [*context, *token_ids]
    for i, (tid, entry) in enumerate(zip(token_ids, entries)):
        ctx = texts.context(full, len(context) + i)
        piece = texts.piece(ctx, tid)
        ranked = sorted((lp.rank or 0, alt, lp.logprob) for alt, lp in entry.items() if (lp.rank or 0) <= num_top)
        top = []
        for _, alt, value in ranked[:num_top]:
            alt_text = piece if alt == tid else texts.piece(ctx, alt)
            top.append(ChatTopLogprob(token=alt_text, logprob=_finite(value), bytes=list(alt_text.encode("utf-8"))))
        out.append(
            ChatLogprob(
                token=piece, logprob=_finite(entry[tid].logprob), bytes=list(piece.encode("utf-8")), top_logprobs=top
            )
        )
    return out
