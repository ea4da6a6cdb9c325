"""Deltas between two KV inspector snapshots (engine/inspector.py), and applying one: what the live stream sends
after its first full snapshot, so that a 7,000-block pool costs kilobytes per update instead of a megabyte.

Delta format (documented in docs/UI.md). Every key is optional: absent means unchanged.
- any top-level snapshot field other than the four collections below (pool, gauges, capacity, redacted,
  events_dropped, version): its new value, whole (they are small)
- block_states: [[id, state], ...]: the characters of `block_states` that changed
- blocks: block entries added or changed; blocks_removed: ids whose entry went away (the block became free)
- evict_order: {removed: [ids], appended: [ids]}: the cached, evictable blocks in eviction order (the ids of
  `blocks` by `evict_rank`); after a delta every block entry's and prefix node's `evict_rank` is its index in that
  order (null when absent). Ranks are not diffed entry by entry: one eviction shifts every rank, which would make
  each delta as large as a snapshot, while the order itself changes at its ends (reused blocks leave the head,
  freed ones join the tail), so its delta is small.
- requests: request entries added or changed (keyed by seq_id); request_order: the seq_ids' order delta
- prefix_cache: nodes added or changed (keyed by block_id); prefix_order: the block_ids' order delta
An order delta {removed, appended} turns the old list into the new one: drop the removed ids, append the appended
ones (a moved id is in both). `blocks` stays sorted by id.

Why a pure function of two snapshots rather than dirty tracking in the pool: the snapshot is already the one place
that reads the engine's state (on the engine thread); diffing two immutable snapshots needs no engine state, so it
can run anywhere (the server runs it in a worker thread, see server/kv_stream.py), and `apply_delta` is the
executable definition of the format that the page's app.js mirrors and the tests check.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

COLLECTIONS = ("block_states", "blocks", "requests", "prefix_cache")
DELTA_ONLY = ("blocks_removed", "evict_order", "request_order", "prefix_order")
KEYED = (("requests", "seq_id", "request_order"), ("prefix_cache", "block_id", "prefix_order"))
FRAME = ("seq", "base", "time", "events")  # the stream's frame around a delta: not snapshot state
RANK = "evict_rank"


def _same_but_rank(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Equal apart from the eviction rank (tried only when the entries differ, so rank shifts cost little)."""
    return old.keys() == new.keys() and all(old[k] == new[k] for k in new if k != RANK)


def order_delta(old: Sequence[Any], new: Sequence[Any]) -> dict[str, list[Any]] | None:
    """How `old` became `new` (unique ids each): the longest run of `old` kept in order as `new`'s head (walked
    greedily), the rest of `old` removed, the rest of `new` appended. Always exact; small when the lists change at
    their ends, as a queue does. None when equal."""
    if old == new:
        return None
    removed: list[Any] = []
    i = j = 0
    while i < len(old) and j < len(new):
        if old[i] == new[j]:
            j += 1
        else:
            removed.append(old[i])
        i += 1
    removed.extend(old[i:])
    return {"removed": removed, "appended": list(new[j:])}


def apply_order(old: Iterable[Any], delta: dict[str, list[Any]] | None) -> list[Any]:
    if delta is None:
        return list(old)
    gone = set(delta["removed"])
    return [x for x in old if x not in gone] + list(delta["appended"])


def _evict_order(blocks: Iterable[dict[str, Any]]) -> list[int]:
    ranked = sorted((b[RANK], b["id"]) for b in blocks if b[RANK] is not None)
    return [block_id for _, block_id in ranked]


def _keyed(
    old: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]], key: str
) -> tuple[list[dict[str, Any]], dict[str, list[Any]] | None]:
    """Entries of `new` added or changed (ranks aside), and the order delta of their keys."""
    before = {e[key]: e for e in old}
    changed = []
    for entry in new:
        prev = before.get(entry[key])
        if prev is None or (prev != entry and not _same_but_rank(prev, entry)):
            changed.append(entry)
    return changed, order_delta([e[key] for e in old], [e[key] for e in new])


def diff_snapshots(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The delta that turns snapshot `old` into snapshot `new` (two snapshots of the same engine: same pool size).
    O(num_blocks + requests + cached blocks); an empty dict when nothing changed."""
    delta: dict[str, Any] = {k: v for k, v in new.items() if k not in COLLECTIONS and old.get(k) != v}
    before = {b["id"]: b for b in old["blocks"]}
    blocks, states = [], []
    for b in new["blocks"]:
        prev = before.pop(b["id"], None)
        if prev is None or (prev != b and not _same_but_rank(prev, b)):
            blocks.append(b)
            if prev is None or prev["state"] != b["state"]:
                states.append([b["id"], b["state"]])
    new_states = new["block_states"]
    states.extend([block_id, new_states[block_id]] for block_id in before)  # entries gone: now free
    if len(old["block_states"]) != len(new_states):
        raise ValueError("snapshots of different pools: a delta needs the same pool")
    if states:
        delta["block_states"] = sorted(states)
    if blocks:
        delta["blocks"] = blocks
    if before:
        delta["blocks_removed"] = sorted(before)
    evict = order_delta(_evict_order(old["blocks"]), _evict_order(new["blocks"]))
    if evict is not None:
        delta["evict_order"] = evict
    for name, key, order_name in KEYED:
        changed, order = _keyed(old[name], new[name], key)
        if changed:
            delta[name] = changed
        if order is not None:
            delta[order_name] = order
    return delta


def _apply_keyed(
    old: list[dict[str, Any]], changed: list[dict[str, Any]] | None, order: dict[str, list[Any]] | None, key: str
) -> list[dict[str, Any]]:
    entries = {e[key]: e for e in old}
    entries.update((e[key], e) for e in changed or ())
    return [entries[k] for k in apply_order((e[key] for e in old), order)]


def apply_delta(snapshot: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """The snapshot `delta` leads to from `snapshot` (a new dict; `snapshot` is left as it was). Keys of the
    stream's frame that are not state (seq, base, time, events) are ignored."""
    out = dict(snapshot)
    for k, v in delta.items():
        if k not in COLLECTIONS and k not in DELTA_ONLY and k not in FRAME:
            out[k] = v
    states = list(snapshot["block_states"])
    for block_id, state in delta.get("block_states", ()):
        states[block_id] = state
    out["block_states"] = "".join(states)
    blocks = {b["id"]: b for b in snapshot["blocks"]}
    for block_id in delta.get("blocks_removed", ()):
        del blocks[block_id]
    blocks.update((b["id"], b) for b in delta.get("blocks", ()))
    order = apply_order(_evict_order(snapshot["blocks"]), delta.get("evict_order"))
    ranks = {block_id: rank for rank, block_id in enumerate(order)}

    def ranked(entry: dict[str, Any], block_id: int) -> dict[str, Any]:
        rank = ranks.get(block_id)
        return entry if entry[RANK] == rank else {**entry, RANK: rank}

    out["blocks"] = [ranked(blocks[i], i) for i in sorted(blocks)]
    out["requests"] = _apply_keyed(snapshot["requests"], delta.get("requests"), delta.get("request_order"), "seq_id")
    nodes = _apply_keyed(snapshot["prefix_cache"], delta.get("prefix_cache"), delta.get("prefix_order"), "block_id")
    out["prefix_cache"] = [ranked(n, n["block_id"]) for n in nodes]
    return out
