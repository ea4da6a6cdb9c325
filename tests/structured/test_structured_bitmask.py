"""The step bitmask: allocated only when a row is constrained, applied to the selected rows only, and the C++
kernel agrees with the torch reference."""

from __future__ import annotations

import pytest
import torch
from structured_support import TINY_LOGITS_WIDTH

from kvserve.structured.matcher import (
    allocate_token_bitmask,
    apply_token_bitmask_,
    apply_token_bitmask_torch_,
    fill_only,
    fill_step_bitmask,
)
from kvserve.structured.params import StructuredOutputsParams


def random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    return torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)


@pytest.mark.parametrize("vocab", [320, 1000, 262_144])
@pytest.mark.parametrize("rows", [[0], [1, 3], [0, 1, 2, 3]])
def test_only_selected_rows_change_and_kernel_matches_reference(vocab: int, rows: list[int]) -> None:
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    bitmask = random_bitmask(4, vocab, seed=2)
    ours, reference = logits.clone(), logits.clone()
    apply_token_bitmask_(ours, bitmask, rows)
    apply_token_bitmask_torch_(reference, bitmask, rows)
    assert torch.equal(ours, reference)
    for r in range(4):
        if r not in rows:
            assert torch.equal(ours[r], logits[r])  # bit-identical: an unconstrained neighbour pays nothing
            continue
        bits = ((bitmask[r].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)[:vocab].bool()
        assert torch.equal(ours[r][bits], logits[r][bits])
        assert torch.isneginf(ours[r][~bits]).all()


def test_bf16_and_non_contiguous_rows() -> None:
    logits = torch.randn(3, 64).to(torch.bfloat16)
    bitmask = random_bitmask(3, 64, seed=3)
    ours, reference = logits.clone(), logits.clone()
    apply_token_bitmask_(ours, bitmask, [2])
    apply_token_bitmask_torch_(reference, bitmask, [2])
    assert torch.equal(ours, reference)
    wide = torch.randn(64, 6)
    view = wide.t()  # a non-contiguous [6, 64] view: the torch path, same result
    expected = view.clone()
    apply_token_bitmask_torch_(expected, random_bitmask(6, 64, 4), [1, 5])
    apply_token_bitmask_(view, random_bitmask(6, 64, 4), [1, 5])
    assert torch.equal(view, expected)
    tall = torch.randn(8, 64)
    every_other = tall[::2]  # a row stride of two rows: the kernel path
    expected = every_other.clone()
    apply_token_bitmask_torch_(expected, random_bitmask(4, 64, 5), [0, 3])
    apply_token_bitmask_(every_other, random_bitmask(4, 64, 5), [0, 3])
    assert torch.equal(every_other, expected) and torch.equal(tall[::2], expected)


def test_no_rows_is_a_no_op_and_bad_rows_are_refused() -> None:
    logits = torch.randn(2, 64)
    before = logits.clone()
    apply_token_bitmask_(logits, random_bitmask(2, 64, 0), [])
    assert torch.equal(logits, before)
    with pytest.raises(IndexError):
        apply_token_bitmask_(logits, random_bitmask(2, 64, 0), [2])
    with pytest.raises(IndexError):
        apply_token_bitmask_(logits, random_bitmask(2, 64, 0), [1, 1])
    with pytest.raises(ValueError, match="covers 32 tokens"):
        apply_token_bitmask_(logits, random_bitmask(2, 32, 0), [0])


def test_step_bitmask_only_for_constrained_batches(tiny_backends: dict) -> None:
    assert fill_step_bitmask([None, None], TINY_LOGITS_WIDTH) is None  # nothing allocated, nothing masked
    backend = tiny_backends["xgrammar"]
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(choice=["ab", "cd"])))
    step = fill_step_bitmask([None, matcher, None], TINY_LOGITS_WIDTH)
    assert step is not None
    bitmask, rows = step
    assert rows == [1] and bitmask.shape == (3, TINY_LOGITS_WIDTH // 32)
    assert (bitmask[0] == -1).all() and (bitmask[2] == -1).all()
    logits = torch.randn(3, TINY_LOGITS_WIDTH)
    before = logits.clone()
    apply_token_bitmask_(logits, bitmask, rows)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert int(torch.isfinite(logits[1]).sum()) == 2  # 'a' and 'c'


def test_fill_only_sets_exactly_those_bits() -> None:
    bitmask = allocate_token_bitmask(2, 100)
    fill_only(bitmask, 1, [1, 31, 63, 99])
    bits = ((bitmask[1].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)
    assert bits.nonzero().view(-1).tolist() == [1, 31, 63, 99]
    assert (bitmask[0] == -1).all()


def test_matchers_refuse_a_wrong_bitmask(tiny_backends: dict) -> None:
    for name in ("xgrammar", "guidance"):
        backend = tiny_backends[name]
        matcher = backend.matcher(backend.compile(StructuredOutputsParams(regex="a")))
        with pytest.raises(ValueError, match="2-D CPU int32"):
            matcher.fill_bitmask(torch.zeros(1, 10, dtype=torch.int64), 0)
        with pytest.raises(IndexError):
            matcher.fill_bitmask(allocate_token_bitmask(1, TINY_LOGITS_WIDTH), 1)


def test_non_finite_logits_keep_masked_fill_semantics() -> None:
    """Blocked -> -inf even when the logit was +inf or NaN; allowed values untouched, NaN and inf included."""
    logits = torch.randn(2, 64)
    bitmask = allocate_token_bitmask(2, 64)
    fill_only(bitmask, 0, [0, 1, 2])
    logits[0, 0], logits[0, 1] = float("inf"), float("nan")  # allowed
    logits[0, 10], logits[0, 11], logits[0, 12] = float("inf"), float("nan"), float("-inf")  # blocked
    logits[1, 5] = float("nan")  # an unselected row keeps its NaN
    ours, reference = logits.clone(), logits.clone()
    apply_token_bitmask_(ours, bitmask, [0])
    apply_token_bitmask_torch_(reference, bitmask, [0])
    torch.testing.assert_close(ours, reference, rtol=0, atol=0, equal_nan=True)
    assert ours[0, 0] == float("inf") and torch.isnan(ours[0, 1]) and torch.isneginf(ours[0, 10:13]).all()
    assert torch.isnan(ours[1, 5])
