"""Encoding a text that extends one encoded before by tokenizing only what is new.

Why: an agent's chat prompt is rendered again every turn, 10-25k tokens of which only the last few hundred are new,
and /v1/messages renders it more than once a turn (each cache_control mark, then the whole prompt). Encoding 19k
tokens costs 70-150 ms on a 2-core host: most of a cached turn's time to first token went to tokenizing text whose
tokens were known.

Why it is exact: a `tokenizers` tokenizer first cuts its input at every added token (its special tokens:
`<|im_start|>`, `<start_of_turn>`, ...), then normalizes, pre-tokenizes and tokenizes each piece on its own. So where a
text shares with an earlier one everything up to and including an added token at which the earlier encoding was cut,
the text's ids are the earlier ids before that token followed by the ids of the text from that token on. That holds for
the added tokens matched in the raw text (not normalized ones), that do not absorb the whitespace before them (no
lstrip), that start with no whitespace, and that lie inside no other added token (so no longer match can span the cut);
`_cut_tokens` keeps only those. The cut positions come from the encoding's own offsets, never from a text search.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Encoding
    from tokenizers import Tokenizer as RawTokenizer

    from kvserve.model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class EncodedText:
    """A text, its ids as Tokenizer.encode gives them (special tokens added), and where the encoding can be cut."""

    text: str
    ids: tuple[int, ...]
    cut_chars: tuple[int, ...]  # the character where each cutting added token starts, ascending
    cut_tokens: tuple[int, ...]  # that token's index in ids


def common_prefix_length(a: str, b: str) -> int:
    """How many leading characters a and b share: a binary search over slice comparisons (each one a C memcmp)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _cut_tokens(backend: RawTokenizer) -> dict[int, int]:
    """The added tokens an encoding may be cut at: id -> length of the token's text (see the module docstring)."""
    added = backend.get_added_tokens_decoder()
    contents = [t.content for t in added.values()]
    cuts = {}
    for token_id, token in added.items():
        text = token.content
        if token.normalized or token.lstrip or not text or text[0].isspace():
            continue
        if any(text in other and text != other for other in contents):
            continue
        cuts[token_id] = len(text)
    return cuts


class PrefixEncoder:
    """Tokenizer.encode (special tokens added), keeping what a later text that extends this one can reuse."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cut_lengths = _cut_tokens(tokenizer.backend)

    def encode(self, text: str) -> EncodedText:
        """The text encoded whole."""
        encoding = self._tokenizer.backend.encode(text, add_special_tokens=False)
        bos = self._tokenizer.bos_prefix(encoding.ids)
        chars, tokens = self._cuts(encoding, 0, len(bos))
        return EncodedText(text, (*bos, *encoding.ids), chars, tokens)

    def extend(self, text: str, earlier: Iterable[EncodedText]) -> EncodedText:
        """The text encoded, reusing the earlier encoding that shares the most of it up to a cut (whole when none
        does)."""
        best: tuple[int, EncodedText, int] | None = None  # (cut character, earlier encoding, index of its cut)
        for before in earlier:
            shared = common_prefix_length(before.text, text)
            k = bisect.bisect_right(before.cut_chars, shared) - 1
            # the last cut whose added token lies wholly inside the shared text, past the start
            while k >= 0 and before.cut_chars[k] + self._cut_lengths[before.ids[before.cut_tokens[k]]] > shared:
                k -= 1
            if k >= 0 and before.cut_chars[k] > 0 and (best is None or before.cut_chars[k] > best[0]):
                best = (before.cut_chars[k], before, k)
        if best is None:
            return self.encode(text)
        start, before, k = best
        first = before.cut_tokens[k]
        encoding = self._tokenizer.backend.encode(text[start:], add_special_tokens=False)
        chars, tokens = self._cuts(encoding, start, first)
        return EncodedText(
            text,
            (*before.ids[:first], *encoding.ids),
            (*before.cut_chars[:k], *chars),
            (*before.cut_tokens[:k], *tokens),
        )

    def _cuts(self, encoding: Encoding, char_shift: int, token_shift: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Where an encoding of text[char_shift:] can be cut, as positions in the whole text and its ids."""
        at = [i for i, t in enumerate(encoding.ids) if t in self._cut_lengths]
        if not at:
            return (), ()
        offsets = encoding.offsets
        return tuple(char_shift + offsets[i][0] for i in at), tuple(token_shift + i for i in at)
