"""Stop-string matching that costs O(new characters) per step, whatever the stop list: an Aho-Corasick automaton.

Why: scanning every stop string over the tail of the text at each step (and testing every prefix of every stop
for the hold-back) costs (number of stops) x (their length) or worse per token, on the engine thread, so one
request with many long stop strings slowed every other user's decode. Here the automaton is built once per
sequence, in time linear in the stop strings' total length (bounded in SamplingParams), and each step feeds it
only the characters it adds; failure-link hops are paid for by earlier characters (amortized O(1) per character).

The state after feeding a text is the longest suffix of that text that is a prefix of some stop string. From it:
  * the hold-back: the longest suffix that is a *proper* prefix of a stop string (it may still become one);
  * the match: the longest stop string ending at this character (the one that starts earliest).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_CHAR_BITS = 21  # every code point (<= 0x10FFFF) fits: a transition is keyed by (state << 21) | code point


@dataclass(frozen=True, slots=True)
class StopMatch:
    start: int  # offset of the stop string in the whole fed text
    stop: str


class StopStringMatcher:
    """One sequence's stop strings: feed the text as it grows, read the hold-back, get the earliest match.

    `steps` counts automaton transitions and failure-link hops: the work done, which the tests bound."""

    __slots__ = ("_stops", "_goto", "_fail", "_hold", "_match", "_max_len", "_state", "_fed", "steps")

    def __init__(self, stops: Sequence[str]) -> None:
        if not stops or not all(stops):
            raise ValueError("stop strings must be a non-empty list of non-empty strings")
        self._stops = tuple(stops)
        self._max_len = max(len(s) for s in stops)
        self._goto: dict[int, int] = {}
        self.steps = 0
        self._link(*self._build_trie())
        self._state = 0
        self._fed = 0
        self.steps = 0  # building is linear in the stop strings' length; count only the feeding

    def _build_trie(self) -> tuple[list[int], list[int], list[tuple[int, int] | None]]:
        """The trie of the stop strings; per node its parent, last character, and (length, index) of the
        stop string it spells (the first in list order, for duplicates), if any."""
        goto = self._goto
        parents, chars = [0], [0]
        own: list[tuple[int, int] | None] = [None]
        for index, stop in enumerate(self._stops):
            node = 0
            for code in map(ord, stop):
                key = node << _CHAR_BITS | code
                child = goto.get(key)
                if child is None:
                    child = goto[key] = len(parents)
                    parents.append(node)
                    chars.append(code)
                node = child
            own.extend([None] * (len(parents) - len(own)))
            if own[node] is None:
                own[node] = (len(stop), index)
        return parents, chars, own

    def _link(self, parents: list[int], chars: list[int], own: list[tuple[int, int] | None]) -> None:
        """Failure links, hold-back lengths and matches, in breadth-first order (a node's failure target is
        shallower, so its values are final when the node is reached)."""
        n = len(parents)
        depth = [0] * n
        has_child = [False] * n
        for v in range(1, n):  # a parent was always created before its children
            depth[v] = depth[parents[v]] + 1
            has_child[parents[v]] = True
        fail, hold, match = [0] * n, [0] * n, own
        self._fail, self._hold, self._match = fail, hold, match
        for v in sorted(range(1, n), key=depth.__getitem__):
            u = parents[v]
            if u:
                fail[v] = self._next(fail[u], chars[v])
            hold[v] = depth[v] if has_child[v] else hold[fail[v]]
            if match[v] is None:
                match[v] = match[fail[v]]

    def _next(self, state: int, code: int) -> int:
        """The transition from `state` on one character, following failure links."""
        goto, fail = self._goto, self._fail
        while True:
            self.steps += 1
            child = goto.get(state << _CHAR_BITS | code)
            if child is not None:
                return child
            if not state:
                return 0
            state = fail[state]

    @property
    def held_back(self) -> int:
        """Length of the longest suffix of the fed text that could still grow into a stop string."""
        return self._hold[self._state]

    def feed(self, text: str, detect: bool = True) -> StopMatch | None:
        """Advances over `text`; with `detect`, returns the earliest-starting stop string that ends inside
        `text` (ties: first in the stop list). Matches that end before `text` were the caller's to take.
        A match ends the sequence: the rest of `text` may be left unread, so feed nothing after one."""
        best: tuple[int, int] | None = None
        for ch in text:
            self._state = self._next(self._state, ord(ch))
            self._fed += 1
            found = self._match[self._state] if detect else None
            if found is not None:
                candidate = (self._fed - found[0], found[1])
                best = candidate if best is None or candidate < best else best
            if best is not None and self._fed - self._max_len >= best[0]:
                break  # no later match can start at or before this one
        return None if best is None else StopMatch(best[0], self._stops[best[1]])
