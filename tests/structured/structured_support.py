"""Helpers for the structured-output tests: a constrained random walk (random logits, masked, greedy, as the
sampler would do it) and bitmask reading."""

from __future__ import annotations

import torch

from kvserve.structured.backend import CompiledGrammar, GrammarBackend
from kvserve.structured.matcher import GrammarMatcher, apply_token_bitmask_, fill_step_bitmask

TINY_LOGITS_WIDTH = 320  # the tiny tokenizer has 256 ids; 256..319 are lm_head padding


def walk(
    backend: GrammarBackend, grammar: CompiledGrammar, seed: int, max_tokens: int = 600
) -> tuple[list[int], bool, GrammarMatcher]:
    """Greedy over masked random logits until the matcher terminates. Returns the tokens before the stop token,
    whether it terminated, and the matcher. Every sampled token must be accepted: the mask allowed it."""
    matcher = backend.matcher(grammar)
    width = backend.vocab.vocab_size
    gen = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    for _ in range(max_tokens):
        logits = torch.randn(1, width, generator=gen)
        step = fill_step_bitmask([matcher], width)
        assert step is not None
        apply_token_bitmask_(logits, *step)
        token = int(logits.argmax())
        assert matcher.accept_token(token), f"token {token} allowed by the mask but refused"
        if matcher.is_terminated():
            assert token in backend.vocab.stop_token_ids
            return tokens, True, matcher
        tokens.append(token)
    return tokens, False, matcher


def allowed_ids(matcher: GrammarMatcher, width: int) -> set[int]:
    """The token ids the matcher allows next."""
    from kvserve.structured.matcher import allocate_token_bitmask

    bitmask = allocate_token_bitmask(1, width)
    matcher.fill_bitmask(bitmask, 0)
    bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.view(-1)[:width].nonzero().view(-1).tolist())
