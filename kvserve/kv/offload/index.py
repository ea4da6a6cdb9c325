"""TierIndex: which blocks this process knows the offload tier to hold, with their content keys, so that the KV
inspector can show which prefixes the tier keeps (docs/UI.md) without walking a directory or parsing records.

Why an index of its own: the host tier's store knows its blocks, but a disk tier's files carry their keys only inside
the records, and other processes (replicas, earlier runs) add and evict files unseen. The index therefore holds what
this process stored or restored, less what it saw evicted; records of other processes appear once restored here.
Engine thread only; bounded, oldest entries out first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kvserve.kv.hashing import BlockKey

MAX_INDEXED_BLOCKS = 1 << 16
HASH_PREFIX_HEX = 16  # as the inspector's other hashes


class TierIndex:
    def __init__(self, max_blocks: int = MAX_INDEXED_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._keys: OrderedDict[bytes, BlockKey] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, block_hash: bytes, key: BlockKey) -> None:
        self._keys[block_hash] = key
        self._keys.move_to_end(block_hash)
        if len(self._keys) > self.max_blocks:
            self._keys.popitem(last=False)

    def remove(self, block_hash: bytes) -> None:
        self._keys.pop(block_hash, None)

    def prefixes(
        self, block_size: int, in_pool: Callable[[bytes], bool], limit: int, include_tokens: bool
    ) -> list[dict[str, Any]]:
        """The indexed blocks grouped into prefixes: each block joins the prefix of its oldest ancestor the index
        holds (a chain of a prompt's blocks, or a tree where prompts share a start). Per prefix: its root's hash, how
        many blocks and tokens it holds, how many of those blocks the pool holds too, and (unless redacted) the root
        block's token ids; the largest `limit` prefixes, largest first."""
        roots: dict[bytes, bytes] = {}

        def root_of(block_hash: bytes) -> bytes:
            path = []
            node = block_hash
            while node not in roots:
                parent = self._keys[node].parent
                if parent is None or parent not in self._keys:
                    roots[node] = node
                    break
                path.append(node)
                node = parent
            root = roots[node]
            for visited in path:
                roots[visited] = root
            return root

        groups: dict[bytes, list[bytes]] = {}
        for block_hash in self._keys:
            groups.setdefault(root_of(block_hash), []).append(block_hash)
        ranked = sorted(groups.items(), key=lambda item: -len(item[1]))[:limit]
        return [
            {
                "root": root.hex()[:HASH_PREFIX_HEX],
                "blocks": len(members),
                "tokens": len(members) * block_size,
                "in_pool": sum(1 for h in members if in_pool(h)),
                "token_ids": list(self._keys[root].token_ids) if include_tokens else None,
            }
            for root, members in ranked
        ]
