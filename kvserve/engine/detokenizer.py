"""Incremental detokenization for streaming, with stop strings.

The concatenated deltas (after `finish()`) equal `tokenizer.decode(output_ids, skip_special_tokens=...)`,
cut at a stop string. Each step decodes only a small window of recent tokens (the prefix/read-offset
method): `ids[prefix:read]` was decoded in the previous step and gives the context, so that
decoders which treat the first token specially (SentencePiece's leading-space strip) or merge
neighbours (byte fallback) decode the new tokens as they would inside the whole sequence.

Text is held back, never emitted partially:
  * while the window ends in U+FFFD (a multi-byte character split over tokens, byte-level BPE);
  * while the last visible token is a byte-fallback token (`<0xE4>`): the decoder turns a run of
    byte tokens into text only as a whole (an invalid run becomes one U+FFFD per byte), so the run's
    text is final only once a non-byte token closes it;
  * while the text ends with what may be the start of a stop string (unless
    include_stop_str_in_output, where a partial stop string is ordinary output either way).

Stop strings are matched by an automaton fed only the new characters (engine/stop_strings.py), so the
work per token does not grow with the number or the length of the stop strings.

The engine should not append the eos / stop token that ended a request unless
include_stop_str_in_output, as vLLM leaves it out of the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.engine.stop_strings import StopStringMatcher

if TYPE_CHECKING:
    from kvserve.model.tokenizer import Tokenizer
    from kvserve.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class DetokenizeResult:
    delta_text: str  # new text for the stream; may be empty while text is held back
    stopped_on: str | None  # the stop string that ended the output, if any


def _is_byte_token(token: str | None) -> bool:
    return token is not None and len(token) == 6 and token.startswith("<0x") and token.endswith(">")


class IncrementalDetokenizer:
    """Decodes one output sequence token by token. `prompt_token_ids` is accepted for the engine's
    convenience but unused: the output is decoded on its own, as `tokenizer.decode(output_ids)`."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> None:
        del prompt_token_ids
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._special_ids = tokenizer.special_ids if params.skip_special_tokens else frozenset()
        self._stops = StopStringMatcher(params.stop) if params.stop else None
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset])
        self._text = ""  # all decided text (cut at the stop string once stopped)
        self._emitted = 0  # characters of _text already streamed
        self._stopped_on: str | None = None
        self._finished = False

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    @property
    def stopped_on(self) -> str | None:
        return self._stopped_on

    def append(self, token_id: int) -> DetokenizeResult:
        """Adds one output token; returns the text that may be streamed now."""
        if self._finished:
            raise RuntimeError("append() after the output was finished or stopped")
        self._ids.append(token_id)
        if self._closes_text(token_id):
            text = self._decode(self._prefix_offset, len(self._ids))
            if not text.endswith(_REPLACEMENT):
                self._advance(text)
        return self._result(final=False)

    def finish(self) -> DetokenizeResult:
        """Ends the output (length, eos, abort): flushes held-back tokens and text."""
        if not self._finished:
            if self._read_offset < len(self._ids):
                self._advance(self._decode(self._prefix_offset, len(self._ids)))
        return self._result(final=True)

    # -- internals --------------------------------------------------------------------------------

    def _closes_text(self, token_id: int) -> bool:
        """Whether text up to this token can be final: not a byte-fallback token (its run may go on)
        nor a skipped special token (invisible to the decoder, so it closes nothing)."""
        if token_id in self._special_ids:
            return False
        return not _is_byte_token(self._tokenizer.id_to_token(token_id))

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def _advance(self, window_text: str) -> None:
        """Takes the window's new text and moves the offsets so the next window starts here."""
        # A decoder that is not prefix-stable (e.g. clean-up of spaces) could rewrite the context;
        # what was streamed cannot be taken back, so everything past its length counts as new.
        new_text = window_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._add_text(new_text)

    def _add_text(self, new_text: str) -> None:
        self._text += new_text
        if self._stops is None:
            return
        # As vLLM: stop strings count only after min_tokens tokens (text before that is still fed, so that
        # the hold-back and later matches see it); only a match that ends in the new text is new.
        match = self._stops.feed(new_text, detect=len(self._ids) > self._min_tokens)
        if match is not None:
            end = match.start + len(match.stop) if self._include_stop else match.start
            self._text = self._text[:end]
            self._stopped_on = match.stop
            self._finished = True

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that could still grow into a stop string."""
        if self._include_stop or self._stops is None:
            return 0
        return self._stops.held_back

    def _result(self, final: bool) -> DetokenizeResult:
        if final:
            self._finished = True
        end = len(self._text) if self._finished else len(self._text) - self._held_back()
        end = max(end, self._emitted)
        delta = self._text[self._emitted : end]
        self._emitted = end
        return DetokenizeResult(delta, self._stopped_on)
