"""Per-request grammar matchers and the token bitmask they fill, applied to the logits of constrained rows only.

One matcher per constrained request (per sequence, with n > 1): the sampler asks it for the set of allowed next
tokens as a packed bitmask (bit i of word i // 32 set = token i allowed), masks that row's logits, samples, and
tells the matcher which token was accepted. Preemption and rejected speculative tokens roll the matcher back.

The two backends' matchers differ in ways a caller should not see, so both classes give one contract:
- a refused token leaves the matcher as it was (llguidance would enter a permanent error state);
- a stop token (EOS) is accepted only where the grammar is complete, and then the matcher is terminated, takes
  no other token, and masks everything but the stop tokens; rolling back one token undoes the termination
  (llguidance would not record an EOS taken after its grammar has stopped, so a plain rollback would undo one
  token too many).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    import llguidance
    import xgrammar

BITMASK_DTYPE = torch.int32


class MaskSource(Protocol):
    """What the sampler needs of a constrained row: its allowed next tokens."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (a CPU int32 tensor of ceil(vocab / 32) words)."""
        ...


class GrammarMatcher(MaskSource, Protocol):
    """What the engine needs from one request's matcher, whichever backend compiled its grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) if the grammar does not allow it."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (preemption, rejected speculative tokens)."""
        ...

    def is_terminated(self) -> bool:
        """Whether a stop token has been accepted (the constrained output is complete)."""
        ...

    def reset(self) -> None:
        """Back to the initial state, as if no token had been accepted."""
        ...

    @property
    def num_accepted(self) -> int:
        """Tokens accepted and not rolled back (the stop token included)."""
        ...

    def error(self) -> str | None:
        """Why the matcher can go no further (llguidance: a parser limit hit mid-output), else None. The engine
        ends such a request with an error; meanwhile its mask allows only the stop tokens."""
        ...


def validate_tokens(matcher: GrammarMatcher, token_ids: Sequence[int]) -> int:
    """How many of `token_ids`, from the first, the grammar accepts without completing (a token that would
    complete it ends the count before it); the matcher ends as it started.

    For speculative decoding: the drafter keeps that many draft tokens, so that every verified position has a
    live grammar state to mask with (draft_masks)."""
    accepted = 0
    for token_id in token_ids:
        if not matcher.accept_token(token_id):
            break
        accepted += 1
        if matcher.is_terminated():
            accepted -= 1
            matcher.rollback(1)
            break
    if accepted:
        matcher.rollback(accepted)
    return accepted


@dataclass(frozen=True, slots=True)
class RowMask:
    """One grammar state's mask, computed ahead: a verified draft position's row (draft_masks)."""

    words: torch.Tensor  # [ceil(vocab / 32)] int32

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].copy_(self.words)


def draft_masks(matcher: GrammarMatcher, draft: Sequence[int], vocab_size: int) -> list[RowMask]:
    """The mask of each verified position of a drafted request (len(draft) + 1): position i's is the grammar's
    state after the drafts before it, which is what a one-token step there would mask with (a row is used only
    while the drafts before it are accepted). The drafts must be grammar-valid (validate_tokens); the matcher ends
    as it started: tokens are accepted for real only as verification appends them."""
    bitmask = allocate_token_bitmask(len(draft) + 1, vocab_size)
    for i in range(len(draft) + 1):
        matcher.fill_bitmask(bitmask, i)
        if i < len(draft) and not matcher.accept_token(draft[i]):
            matcher.rollback(i)
            raise ValueError(f"draft token {draft[i]} at position {i} is not allowed by the grammar")
    if draft:
        matcher.rollback(len(draft))
    return [RowMask(bitmask[i]) for i in range(len(draft) + 1)]


class XgrammarMatcher:
    """An xgrammar GrammarMatcher (rollback is unlimited in xgrammar >= 0.2)."""

    __slots__ = ("_matcher", "_stop_token_ids", "_accepted")

    def __init__(self, compiled: xgrammar.CompiledGrammar, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self._stop_token_ids = tuple(stop_token_ids)
        self._accepted = 0

    @property
    def num_accepted(self) -> int:
        return self._accepted

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        _check_bitmask(bitmask, row)
        if self._matcher.is_terminated():  # xgrammar computes no mask once terminated
            fill_only(bitmask, row, self._stop_token_ids)
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        ok = bool(self._matcher.accept_token(int(token_id)))
        self._accepted += ok
        return ok

    def rollback(self, num_tokens: int) -> None:
        _check_rollback(num_tokens, self._accepted)
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self._accepted -= num_tokens

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def reset(self) -> None:
        self._matcher.reset()
        self._accepted = 0

    def error(self) -> str | None:
        return None


class GuidanceMatcher:
    """An llguidance LLMatcher, given the contract above (see the module docstring for the two differences)."""

    __slots__ = ("_matcher", "_stop_token_ids", "_tokenizer_words", "_accepted", "_terminated")

    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: Sequence[int], tokenizer_vocab: int) -> None:
        self._matcher = matcher
        self._stop_token_ids = frozenset(stop_token_ids)
        self._tokenizer_words = math.ceil(tokenizer_vocab / 32)  # llguidance writes exactly this many words
        self._accepted = 0
        self._terminated = False

    @property
    def num_accepted(self) -> int:
        return self._accepted

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        _check_bitmask(bitmask, row)
        if self._terminated:
            fill_only(bitmask, row, self._stop_token_ids)
            return
        target = bitmask[row]
        words = self._tokenizer_words
        if words > target.numel():
            raise ValueError(f"bitmask row has {target.numel()} words; the tokenizer needs {words}")
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), words * 4)
        if words < target.numel():
            target[words:] = 0  # ids past the tokenizer's vocabulary (a padded lm_head) are never allowed
        if self._matcher.is_error():  # never raise on the engine thread: end this request, not the batch
            fill_only(bitmask, row, self._stop_token_ids)

    def accept_token(self, token_id: int) -> bool:
        if self._terminated:
            return False
        if token_id in self._stop_token_ids:
            if not self._matcher.is_accepting():
                return False
            self._terminated = True  # kept out of llguidance's history: see the module docstring
        elif self._matcher.try_consume_tokens([int(token_id)]) != 1:
            return False
        self._accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        _check_rollback(num_tokens, self._accepted)
        remaining = num_tokens
        if remaining and self._terminated:
            self._terminated = False
            remaining -= 1
        if remaining:
            self._matcher.rollback(remaining)
        self._accepted -= num_tokens

    def is_terminated(self) -> bool:
        return self._terminated

    def reset(self) -> None:
        self._matcher.reset()
        self._accepted = 0
        self._terminated = False

    def error(self) -> str | None:
        if not self._matcher.is_error():
            return None
        return self._matcher.get_error() or "llguidance matcher error"


def _check_rollback(num_tokens: int, accepted: int) -> None:
    if num_tokens < 0 or num_tokens > accepted:
        raise ValueError(f"cannot roll back {num_tokens} tokens: the matcher has accepted {accepted}")


def _check_bitmask(bitmask: torch.Tensor, row: int) -> None:
    """The backends write through raw pointers: a wrong dtype, device or layout would corrupt memory."""
    if bitmask.dtype != BITMASK_DTYPE or bitmask.device.type != "cpu" or bitmask.dim() != 2:
        raise ValueError(
            f"bitmask must be a 2-D CPU int32 tensor, got {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}"
        )
    if not bitmask.is_contiguous():
        raise ValueError("bitmask must be contiguous")
    if not 0 <= row < bitmask.shape[0]:
        raise IndexError(f"bitmask row {row} out of range for {bitmask.shape[0]} rows")


def fill_only(bitmask: torch.Tensor, row: int, token_ids: Sequence[int] | frozenset[int]) -> None:
    """Allow exactly `token_ids` in `bitmask[row]`."""
    target = bitmask[row]
    target.zero_()
    for token_id in token_ids:
        word, bit = divmod(int(token_id), 32)
        if word < target.numel():
            value = int(target[word]) | (1 << bit)
            target[word] = value - (1 << 32) if value >= 1 << 31 else value  # int32 wraps bit 31 to the sign


# -- the step's bitmask ----------------------------------------------------------------------------------------


def bitmask_words(vocab_size: int) -> int:
    return math.ceil(vocab_size / 32)


def allocate_token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A [rows, ceil(vocab / 32)] int32 CPU bitmask, every token allowed (-1 = all 32 bits set)."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=BITMASK_DTYPE)


def fill_step_bitmask(matchers: Sequence[MaskSource | None], vocab_size: int) -> tuple[torch.Tensor, list[int]] | None:
    """One step's bitmask for a batch whose row i belongs to matchers[i] (None: unconstrained).

    Returns the bitmask (allocated once for the step, one row per batch row) and the constrained rows, or None
    when no row is constrained, so that a batch without structured requests allocates and masks nothing."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    bitmask = allocate_token_bitmask(len(matchers), vocab_size)
    for i in rows:
        matchers[i].fill_bitmask(bitmask, i)  # type: ignore[union-attr]
    return bitmask, rows


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set logits[r, t] = -inf wherever bit t of bitmask[r] is clear, for r in `rows` only; other rows untouched.

    logits: [batch, vocab] floats on any device; bitmask: [batch, >= ceil(vocab / 32)] int32 (the CPU one the
    matchers filled; copied to the logits' device). How: each byte of the mask selects one row of a 256 x 8 table
    of 0 / -inf, and the row is added, so allowed logits keep their exact value. That is about twice as fast on
    the CPU as xgrammar's C++ kernel (0.3 against 0.7 ms for a 262,144-token row) and the same code on CUDA."""
    rows = [int(r) for r in rows]
    if not rows:
        return
    _check_apply(logits, bitmask, rows)
    if sys.byteorder != "little":  # the byte view below assumes bits 0..7 of a word in its first byte
        apply_token_bitmask_torch_(logits, bitmask.to(logits.device), rows)
        return
    vocab = logits.shape[1]
    table = _byte_bias_table(logits.dtype, logits.device)
    words = bitmask[:, : bitmask_words(vocab)].to(logits.device, non_blocking=True)
    for r in rows:
        byte_ids = words[r].contiguous().view(torch.uint8).to(torch.int64)
        bias = table.index_select(0, byte_ids).view(-1)[:vocab]
        row = logits[r]
        row.add_(bias)
        # A blocked +inf or NaN logit is now NaN, not -inf. The row's sum is NaN only then (or when the row held
        # +inf next to -inf): one cheap reduction instead of an isnan pass over every row.
        if bool(torch.isnan(row.sum())):
            row.masked_fill_(torch.isnan(row) & torch.isneginf(bias), float("-inf"))


def _byte_bias_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: entry (b, i) is 0 if bit i of byte b is set (token allowed), else -inf. ~30 us to build."""
    bits = (torch.arange(256, device=device).unsqueeze(1) >> torch.arange(8, device=device)) & 1
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(bits == 1, zero, torch.full((), float("-inf"), dtype=dtype, device=device))


def apply_token_bitmask_torch_(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """The same as apply_token_bitmask_, by shifting every bit out (slower; the reference the tests compare with)."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=BITMASK_DTYPE, device=logits.device)
    for r in rows:
        words = bitmask[r, : bitmask_words(vocab)]
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(-1)[:vocab]
        logits[r].masked_fill_(allowed == 0, float("-inf"))


def _check_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a 2-D float tensor, got {logits.dtype} {tuple(logits.shape)}")
    if bitmask.dim() != 2 or bitmask.dtype != BITMASK_DTYPE:
        raise ValueError(f"bitmask must be a 2-D int32 tensor, got {bitmask.dtype} {tuple(bitmask.shape)}")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"bitmask covers {bitmask.shape[1] * 32} tokens, logits have {logits.shape[1]}")
    limit = min(logits.shape[0], bitmask.shape[0])
    bad = [r for r in rows if not 0 <= r < limit]
    if bad or len(set(rows)) != len(rows):
        raise IndexError(f"rows {rows} must be distinct and below {limit}")


def allowed_tokens(words: torch.Tensor, vocab_size: int, limit: int) -> list[int]:
    """The first `limit` token ids a packed mask row ([ceil(vocab / 32)] int32, bit j of word i = token 32i + j)
    allows, in id order."""
    out: list[int] = []
    for i in torch.nonzero(words).flatten().tolist():
        word = int(words[i]) & 0xFFFFFFFF
        for bit in range(32):
            token = 32 * i + bit
            if word >> bit & 1 and token < vocab_size:
                out.append(token)
                if len(out) == limit:
                    return out
    return out
