"""Prompt-lookup (n-gram) drafting over a request's own prompt and output tokens."""

from __future__ import annotations

from collections.abc import Sequence


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the sequence's last n tokens,
    trying the longest n (max_n down to min_n) first: a longer match predicts better. Empty when nothing
    matches. The most recent occurrence, not the first: in a repetitive output the latest copy is the one
    the model is continuing."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = list(tokens[length - n :])
        first = pattern[0]
        for start in range(length - n - 1, -1, -1):  # an occurrence that ends before the pattern itself
            if tokens[start] == first and list(tokens[start : start + n]) == pattern:
                follow = list(tokens[start + n : start + n + k])
                if follow:
                    return follow
    return []
