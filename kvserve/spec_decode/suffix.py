"""Suffix drafting (SuffixDecoding, arXiv 2411.04975): drafts from a count trie over the request's own prompt and
output, and from one over the outputs of recent finished requests.

The trie holds every substring of at most `max_depth` tokens with how often it occurred, so "what followed the
last m tokens, and how often" is a walk from the node of those m tokens. Insertion keeps, per indexed sequence, the
nodes of its current suffixes (lengths 0..depth-1); a new token extends each of them by one child, so a token costs
O(depth) and a prompt O(len * depth), once. Only real tokens are indexed (the engine hands in the request's prompt
and output, never its drafts), so a rolled-back draft never enters a trie and a preempted request, whose tokens
are unchanged, keeps its trie."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.spec_decode.drafter import DraftSource


class _Node:
    """One substring: how often it occurred (`count`), how often it was followed by a token (`total`, the sum of
    the children's counts), and its most frequent follower (`best`, its node `best_child`), kept on update so a
    greedy walk is O(1). Most nodes have at most one child (deep in the trie nearly every substring is unique):
    that child is `best` alone, and the `children` dict (about 3x a node's size) exists only from a second one."""

    __slots__ = ("children", "count", "total", "best", "best_child")

    def __init__(self) -> None:
        self.children: dict[int, _Node] | None = None
        self.count = 0
        self.total = 0
        self.best: int | None = None
        self.best_child: _Node | None = None

    def child(self, token: int) -> _Node | None:
        if self.best == token:
            return self.best_child
        return None if self.children is None else self.children.get(token)

    def add_child(self, token: int) -> _Node:
        child = _Node()
        if self.best is None:
            self.best, self.best_child = token, child
            return child
        if self.children is None:
            assert self.best_child is not None
            self.children = {self.best: self.best_child}
        self.children[token] = child
        return child

    def drop_child(self, token: int) -> None:
        """Forget a child whose count reached zero, and pick the most frequent of the others."""
        if self.children is not None:
            del self.children[token]
        if self.best != token:
            return
        if self.children:
            best = max(self.children, key=lambda t: self.children[t].count)  # type: ignore[index]
            self.best, self.best_child = best, self.children[best]
        else:
            self.children, self.best, self.best_child = None, None, None

    def counted(self, token: int, child: _Node) -> None:
        """`child` (for `token`) gained an occurrence: it becomes the best on a tie, since in a repetitive text the
        latest copy is the one being continued."""
        self.total += 1
        if self.best != token and self.best_child is not None and child.count >= self.best_child.count:
            self.best, self.best_child = token, child


class SuffixTrie:
    """A depth-bounded count trie of all substrings of the sequences indexed into it.

    `extend` adds one token to a sequence (given the sequence's suffix nodes, returning the new ones); `remove`
    takes a whole sequence back out (the global cache's eviction); `match` finds a context's suffix nodes."""

    __slots__ = ("root", "max_depth", "num_nodes")

    def __init__(self, max_depth: int) -> None:
        self.root = _Node()
        self.max_depth = max_depth
        self.num_nodes = 1

    def start(self) -> list[_Node]:
        """The suffix nodes of an empty sequence (just the root)."""
        return [self.root]

    def extend(self, suffixes: list[_Node], token: int) -> list[_Node]:
        """Count `token` after each of the sequence's suffixes (`suffixes[m]`: the node of its last m tokens, m
        below max_depth) and return the new suffix nodes: O(max_depth)."""
        new = [self.root]
        keep = self.max_depth - 1
        for m, node in enumerate(suffixes):
            child = node.child(token)
            if child is None:
                child = node.add_child(token)
                self.num_nodes += 1
            child.count += 1
            node.counted(token, child)
            if m < keep:
                new.append(child)
        return new

    def insert(self, tokens: Iterable[int]) -> None:
        """Index a whole sequence."""
        suffixes = self.start()
        for token in tokens:
            suffixes = self.extend(suffixes, token)

    def remove(self, tokens: Sequence[int]) -> None:
        """Take back a sequence `insert` indexed: the same counts down, in the same order, dropping nodes that
        reach zero (their subtrees occurred only inside them, so they are empty too)."""
        keep = self.max_depth - 1
        suffixes = self.start()
        for token in tokens:
            new = [self.root]
            for m, node in enumerate(suffixes):
                child = node.child(token)
                assert child is not None, "removing a sequence that was not inserted"
                child.count -= 1
                node.total -= 1
                if child.count == 0:
                    node.drop_child(token)
                    self.num_nodes -= 1
                elif node.best == token and node.children is not None:  # it fell: another may be the best now
                    best = max(node.children, key=lambda t: node.children[t].count)  # type: ignore[index]
                    node.best, node.best_child = best, node.children[best]
                if m < keep:
                    new.append(child)  # a dropped child still walks on, detached: its counts go to 0 with it
            suffixes = new

    def match(self, context: Sequence[int]) -> list[_Node]:
        """The nodes of the context's last m tokens, m = 0, 1, ... while present (at most max_depth - 1). A
        substring's substrings are all present, so the first missing m ends the list."""
        nodes = [self.root]
        n = len(context)
        for m in range(1, min(self.max_depth - 1, n) + 1):
            node: _Node | None = self.root
            for token in context[n - m :]:
                assert node is not None
                node = node.child(token)
                if node is None:
                    return nodes
            assert node is not None
            nodes.append(node)
        return nodes


@dataclass(frozen=True, slots=True)
class Draft:
    """A proposed continuation and its score: the sum of its tokens' estimated probabilities of being reached, i.e.
    the expected number of accepted tokens if the counts are right. Drafts from the two tries compare by it."""

    tokens: list[int] = field(default_factory=list)
    score: float = 0.0


def best_draft(suffix_nodes: Sequence[_Node], k: int, max_spec_factor: float, min_token_prob: float) -> Draft:
    """The best greedy draft over all match lengths: from the node of the last m tokens (`suffix_nodes[m]`), follow
    the most frequent continuation while the product of the steps' frequencies (count(child) / total(node)) stays
    at least `min_token_prob`, for at most min(k, floor(max_spec_factor * m)) tokens. A longer match predicts
    better but, in a depth-bounded trie, leaves less depth to draft from: every m is tried and the highest score
    wins (the longer match on a tie)."""
    best = Draft()
    for m in range(len(suffix_nodes) - 1, 0, -1):
        limit = min(k, int(max_spec_factor * m))
        node = suffix_nodes[m]
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        while len(tokens) < limit and node.best is not None:
            child = node.best_child
            assert child is not None
            prob *= child.count / node.total
            if prob < min_token_prob:
                break
            tokens.append(node.best)
            score += prob
            node = child
        if score > best.score:
            best = Draft(tokens, score)
    return best


@dataclass(slots=True)
class _RequestTrie:
    """A request's own trie and how far its prompt + output is indexed into it."""

    trie: SuffixTrie
    suffixes: list[_Node]
    num_indexed: int = 0


class SuffixDrafter:
    """The `suffix` method: per-request tries over prompt + output (made at the request's first draft, brought up
    to date at each later one, released when it finishes) and a global trie over the outputs of the last
    `max_cached_requests` finished requests (oldest evicted; 0: no global trie). Each draft is the better of the
    two tries' best drafts."""

    def __init__(self, max_depth: int, max_cached_requests: int, max_spec_factor: float, min_token_prob: float) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.global_trie = SuffixTrie(max_depth)
        self._cached: deque[list[int]] = deque()  # the outputs in the global trie, oldest first
        self._requests: dict[str, _RequestTrie] = {}

    @property
    def num_live_requests(self) -> int:
        """Requests holding a trie (drafted and not finished yet)."""
        return len(self._requests)

    @property
    def num_cached_requests(self) -> int:
        return len(self._cached)

    def propose(self, request: DraftSource, k: int) -> list[int]:
        state = self._sync(request)
        context = _context(request, self.max_depth - 1)
        local = best_draft(state.suffixes, k, self.max_spec_factor, self.min_token_prob)
        if not self._cached:
            return local.tokens
        shared = best_draft(self.global_trie.match(context), k, self.max_spec_factor, self.min_token_prob)
        return shared.tokens if shared.score > local.score else local.tokens

    def on_finished(self, request: DraftSource) -> None:
        """Release the request's trie and index its output into the global trie (a request that never drafted
        has no trie to release; its output is cached all the same)."""
        self._requests.pop(request.request_id, None)
        output = list(request.output_token_ids)
        if self.max_cached_requests == 0 or not output:
            return
        self.global_trie.insert(output)
        self._cached.append(output)
        while len(self._cached) > self.max_cached_requests:
            self.global_trie.remove(self._cached.popleft())

    def _sync(self, request: DraftSource) -> _RequestTrie:
        """The request's trie with every real token so far indexed (only the new ones cost anything)."""
        state = self._requests.get(request.request_id)
        if state is None:
            trie = SuffixTrie(self.max_depth)
            state = self._requests[request.request_id] = _RequestTrie(trie, trie.start())
        prompt, output = request.prompt_token_ids, request.output_token_ids
        n_prompt = len(prompt)
        trie, suffixes = state.trie, state.suffixes
        for i in range(state.num_indexed, n_prompt + len(output)):
            suffixes = trie.extend(suffixes, prompt[i] if i < n_prompt else output[i - n_prompt])
        state.suffixes, state.num_indexed = suffixes, n_prompt + len(output)
        return state


def _context(request: DraftSource, n: int) -> list[int]:
    """The request's last `n` real tokens (prompt and output together)."""
    output = request.output_token_ids
    if len(output) >= n:
        return list(output[len(output) - n :])
    prompt = request.prompt_token_ids
    return list(prompt[max(0, len(prompt) - (n - len(output))) :]) + list(output)
