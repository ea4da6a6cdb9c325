"""Workloads: random-token requests for offline benchmarks and random-word prompts for HTTP ones.

Random tokens (as vLLM's and nano-vllm's throughput benchmarks use) make every prompt distinct, so no
prefix-cache hit flatters a figure, and they need no dataset on a machine without internet.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenRange:
    """An inclusive range of lengths, parsed from "32-512" or "64"."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> TokenRange:
        parts = text.split("-")
        try:
            low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (-1, -1)
        except ValueError:
            low, high = -1, -1
        if low < 1 or high < low:
            raise ValueError(f"invalid range {text!r}: expected N or LOW-HIGH with 1 <= LOW <= HIGH")
        return cls(low, high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


@dataclass(frozen=True, slots=True)
class TokenRequest:
    """One offline request: prompt token ids and the exact number of tokens to generate (ignore_eos)."""

    prompt_token_ids: list[int]
    output_len: int


def random_token_ids(rng: random.Random, length: int, vocab_size: int, exclude: Iterable[int] = ()) -> list[int]:
    """`length` ids drawn uniformly from the vocabulary, special tokens excluded."""
    excluded = set(exclude)
    ids: list[int] = []
    while len(ids) < length:
        token = rng.randrange(vocab_size)
        if token not in excluded:
            ids.append(token)
    return ids


def random_token_requests(
    num_requests: int,
    input_len: TokenRange,
    output_len: TokenRange,
    vocab_size: int,
    seed: int,
    exclude: Iterable[int] = (),
) -> list[TokenRequest]:
    rng = random.Random(seed)
    excluded = list(exclude)
    return [
        TokenRequest(
            random_token_ids(rng, rng.randint(input_len.low, input_len.high), vocab_size, excluded),
            rng.randint(output_len.low, output_len.high),
        )
        for _ in range(num_requests)
    ]


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """Request lengths in tokens (prompt + output): lognormal with the given mean, clipped to [2, max_len].
    Real chat traffic is long-tailed like this (most requests short, a few near the context limit), which is
    exactly what makes reserving max-model-len per request wasteful."""

    mean: float
    max_len: int
    sigma: float = 1.0

    def __post_init__(self) -> None:
        if self.max_len < 2 or not 0 < self.mean <= self.max_len or self.sigma < 0:
            raise ValueError(
                f"invalid length distribution: mean {self.mean}, max {self.max_len}, sigma {self.sigma}"
                " (need 0 < mean <= max, max >= 2, sigma >= 0)"
            )

    def sample(self, rng: random.Random, n: int) -> list[int]:
        mu = math.log(self.mean) - self.sigma**2 / 2  # so that the unclipped mean is `mean`
        return [min(self.max_len, max(2, round(rng.lognormvariate(mu, self.sigma)))) for _ in range(n)]


def split_length(length: int, output_share: float) -> tuple[int, int]:
    """(prompt, output) tokens of a request `length` tokens long, each at least one."""
    if length < 2:
        raise ValueError(f"a request needs at least 2 tokens (1 prompt + 1 output), got {length}")
    output = min(length - 1, max(1, round(length * output_share)))
    return length - output, output


# Plain English words written for this file; prompts made of them tokenize to roughly one token per word.
_WORDS = """
the a of and to in is that it was for on are as with his they at be this from have or by one had not but what all
were when we there can an your which their said if do will each about how up out them then she many some so these
would other into has more her two like him see time could no make than first been its who now people my made over
did down only way find use may water long little very after words called just where most know get through back
much before go good new write our used me man too any day same right look think also around another came come work
three word must because does part even place well such here take why things help put years different away again
off went old number great tell men say small every found still between name should home big give air line set own
under read last never us left end along while might next sound below saw something thought both few those always
looked show large often together asked house world going want school important until form food keep children feet
land side without boy once animals life enough took sometimes four head above kind began almost live page got
earth need far hand high year mother light parts country father let night following picture being study second
eyes soon times story boys since white days ever paper hard near sentence better best across during today others
however sure means knew try told young miles sun ways thing whole hear example heard several change answer room
sea against top turned learn point city play toward five using himself usually river mountain winter garden
""".split()


def random_word_prompts(num_prompts: int, words: TokenRange, seed: int) -> list[str]:
    """Prompts of a random number of words each, as the serving benchmark sends them."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(_WORDS, k=rng.randint(words.low, words.high))) for _ in range(num_prompts)]


@dataclass(frozen=True, slots=True)
class TenantRequest:
    """One request of the multi-tenant workload: its tenant's system prompt followed by its own question."""

    tenant: int
    prompt_token_ids: list[int]


def word_token_ids(rng: random.Random, num_tokens: int, encode: Callable[[str], list[int]]) -> list[int]:
    """Exactly `num_tokens` ids of random English words (encoded, then cut), so that lengths are exact in the
    server's own tokens whatever the tokenizer's words-per-token."""
    words = rng.choices(_WORDS, k=num_tokens)
    ids = encode(" " + " ".join(words))
    while len(ids) < num_tokens:
        words += rng.choices(_WORDS, k=num_tokens)
        ids = encode(" " + " ".join(words))
    return ids[:num_tokens]


def tenant_requests(
    num_tenants: int,
    prefix_tokens: int,
    num_requests: int,
    question_tokens: TokenRange,
    encode: Callable[[str], list[int]],
    bos: Sequence[int],
    seed: int,
    requests_per_tenant: int = 0,
) -> list[TenantRequest]:
    """Shared-prefix traffic: `num_tenants` system prompts of `prefix_tokens` tokens (`bos` included), and
    requests that each pick a tenant at random and append a distinct short question. With
    `requests_per_tenant` > 0, that many requests per tenant (tenants in turn) come first: a warm-up that
    gives every tenant the same start under every routing policy."""
    rng = random.Random(seed)
    prefixes = [[*bos, *word_token_ids(rng, prefix_tokens - len(bos), encode)] for _ in range(num_tenants)]
    tenants = [t for _ in range(requests_per_tenant) for t in range(num_tenants)]
    tenants += [rng.randrange(num_tenants) for _ in range(num_requests)]
    return [
        TenantRequest(
            t, prefixes[t] + word_token_ids(rng, rng.randint(question_tokens.low, question_tokens.high), encode)
        )
        for t in tenants
    ]
