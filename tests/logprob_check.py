"""vLLM's check_logprobs_close rule, for comparing greedy outputs where near-ties make exact equality
meaningless: sequences may differ only where, at the first differing position, each side's token is among
the other side's top-k candidates; after that they are not compared."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def assert_logprobs_close(
    ref_tokens: Sequence[int],
    ref_top: Sequence[Mapping[int, object]],
    test_tokens: Sequence[int],
    test_top: Sequence[Mapping[int, object]],
    name: str = "",
) -> int:
    """Returns the index of the first difference (len if none); fails if the difference is not a near-tie."""
    for i, (a, b) in enumerate(zip(ref_tokens, test_tokens)):
        if a != b:
            assert a in test_top[i] and b in ref_top[i], (
                f"{name}: outputs diverge at token {i} ({a} vs {b}) and neither is a near-tie: "
                f"ref top {list(ref_top[i])}, test top {list(test_top[i])}\n"
                f"ref  {list(ref_tokens)}\ntest {list(test_tokens)}"
            )
            return i
    assert len(ref_tokens) == len(test_tokens), f"{name}: lengths differ: {len(ref_tokens)} vs {len(test_tokens)}"
    return len(ref_tokens)
