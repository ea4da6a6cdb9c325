"""Keying the prefix cache is linear in the tokens keyed: each block copies O(block_size) tokens, never the whole
sequence. It once rebuilt prompt + output per block (0.42 s to publish a 32k prompt, again at every lookup
retry). Measured structurally: the tokens the KV manager copies out of the request, not the time taken."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvserve.engine.request import Request
from kvserve.kv.hashing import MAX_CACHE_SALT_CHARS, check_cache_salt_length
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.pool import BlockPool

BS = 16


@dataclass
class Params:
    seed: int | None = None
    prompt_logprobs: int | None = None


@dataclass(eq=False)
class CountingRequest(Request):
    """A Request that counts the tokens handed out by token_slice, the KV manager's only way to read them."""

    tokens_copied: int = 0

    def token_slice(self, start: int, end: int) -> list[int]:
        out = Request.token_slice(self, start, end)
        self.tokens_copied += len(out)
        return out


def manager(num_tokens: int) -> KVCacheManager:
    return KVCacheManager(BlockPool(2 * num_tokens // BS + 2), BS)


@pytest.mark.parametrize("num_tokens", [1024, 8192, 32768])
def test_publishing_a_prompt_copies_each_token_a_bounded_number_of_times(num_tokens: int) -> None:
    kv = manager(num_tokens)
    r = CountingRequest("a", list(range(num_tokens)), Params())
    assert kv.allocate_slots(r, num_tokens)
    assert len(kv.pool.cached[0]) == num_tokens // BS
    assert r.tokens_copied <= 2 * num_tokens  # once to hash, once for the content key: linear, whatever the length


@pytest.mark.parametrize("num_tokens", [1024, 32768])
def test_lookup_retries_while_waiting_stay_linear_and_hash_once(num_tokens: int) -> None:
    kv = manager(num_tokens)
    first = Request("a", list(range(num_tokens)), Params())
    assert kv.allocate_slots(first, num_tokens)
    waiting = CountingRequest("b", list(range(num_tokens)) + [1], Params())
    blocks, hit = kv.get_computed_blocks(waiting)
    assert hit == num_tokens and waiting.tokens_copied <= 2 * num_tokens
    waiting.tokens_copied = 0
    for _ in range(3):  # the request could not be admitted and looks up again at later steps
        assert kv.get_computed_blocks(waiting)[1] == num_tokens
    assert waiting.tokens_copied <= 3 * num_tokens  # content keys only: the hashes are kept


def test_decoding_publishes_each_new_block_once() -> None:
    kv = manager(4096)
    r = CountingRequest("a", list(range(100)), Params())
    assert kv.allocate_slots(r, 100)
    r.num_computed_tokens = 100
    for i in range(1000):
        r.output_token_ids.append(i)
        assert kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
    assert len(kv.pool.cached[0]) == 1100 // BS
    assert r.tokens_copied <= 2 * 1100


def test_token_slice_matches_the_concatenated_sequence() -> None:
    r = Request("a", [10, 11, 12, 13], Params(), output_token_ids=[20, 21, 22])
    whole = r.prompt_token_ids + r.output_token_ids
    for start in range(len(whole) + 1):
        for end in range(start, len(whole) + 1):
            assert r.token_slice(start, end) == whole[start:end]
    assert r.token_slice(0, 4) is not r.prompt_token_ids  # a copy: the caller may keep it


def test_a_lone_surrogate_salt_keys_without_raising_and_isolates() -> None:
    """A salt the server should have refused ("\\ud800") once raised UnicodeEncodeError on the engine thread."""
    kv = manager(64)
    tokens = list(range(33))
    odd = Request("a", tokens, Params(), cache_salt="\ud800")
    assert kv.allocate_slots(odd, len(tokens))
    assert kv.get_computed_blocks(Request("b", tokens, Params(), cache_salt="\ud800"))[1] == 32
    for other in (None, "\ufffd", "?"):
        assert kv.get_computed_blocks(Request("c", tokens, Params(), cache_salt=other))[1] == 0


def test_a_salt_costs_its_digest_per_block_not_its_length() -> None:
    """Twelve 7 MiB salts once took a server from 1.9 to 7.1 GiB: every block key and history entry held its own copy,
    and hashing joined it to every block. A key now holds a 32-byte digest whatever the salt's length (the longest
    accepted, 1,024 characters, here), salts still never share blocks, and a longer salt is a ValueError naming both
    lengths."""
    kv = manager(64)
    tokens = list(range(33))
    salt = "s" * MAX_CACHE_SALT_CHARS
    r = Request("a", tokens, Params(), cache_salt=salt)
    assert kv.allocate_slots(r, len(tokens))
    hashes = kv.hashes(r, len(tokens))
    assert [len(kv.key(r, hashes, i).extra_keys) for i in range(2)] == [32, 32]
    assert kv.get_computed_blocks(Request("b", tokens, Params(), cache_salt=salt))[1] == 32
    for other in (None, salt[:-1], salt[:-1] + "t"):
        assert kv.get_computed_blocks(Request("c", tokens, Params(), cache_salt=other))[1] == 0
    check_cache_salt_length(salt)
    with pytest.raises(ValueError, match=r"1,025 characters; at most 1,024"):
        check_cache_salt_length(salt + "s")
