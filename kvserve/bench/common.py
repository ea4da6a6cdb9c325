"""Steps every engine-backed bench command takes: build kvserve and its peers, warm them, alternate runs."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from kvserve.bench.systems import KVServeSystem, System, build_engine

if TYPE_CHECKING:
    from kvserve.bench.peers.hf import HFPeer

log = logging.getLogger(__name__)
T = TypeVar("T")
K = TypeVar("K")


def load_kvserve(args: argparse.Namespace) -> KVServeSystem:
    system = KVServeSystem(build_engine(args))
    warm_up(system)
    return system


INT8_PEER = "kvserve-int8"  # --peer kvserve-int8: kvserve again, with --activation-quantization int8


def load_int8_activation_peer(args: argparse.Namespace) -> KVServeSystem:
    """kvserve on the same flags with --activation-quantization int8: the exact path and int8 activations
    measured side by side in one run (the command's own kvserve is the exact one)."""
    from dataclasses import replace

    from kvserve.engine.engine import LLMEngine
    from kvserve.engine_args import engine_config_from_args

    config = engine_config_from_args(args)
    if config.activation_quantization != "none":
        raise SystemExit(
            f"--peer {INT8_PEER} sets the int8 activations on the peer; run kvserve itself with "
            "--activation-quantization none (the default)"
        )
    system = KVServeSystem(LLMEngine.from_config(replace(config, activation_quantization="int8")))
    system.name = INT8_PEER
    warm_up(system)
    return system


def load_hf_peer(args: argparse.Namespace, kvserve: KVServeSystem) -> HFPeer:
    """HF transformers on the very file kvserve loaded, in kvserve's compute dtype."""
    from kvserve.bench.peers.hf import HFPeer
    from kvserve.model.source import resolve_model

    dtype = next(p.dtype for p in kvserve.engine.core.runner.model.parameters() if p.is_floating_point())
    log.info("loading the HF transformers peer (for the default GGUF this takes a minute or two)")
    peer = HFPeer.load(resolve_model(args.model), dtype=dtype)
    warm_up(peer)
    return peer


def warm_up(system: System) -> None:
    """One tiny generation first, so that thread pools and allocators start outside any measurement."""
    system.timed_generate([[100 + i for i in range(8)]], 2)


def alternate_rounds(
    sides: Sequence[K], repeats: int, run: Callable[[K, int], T], flip: bool = False
) -> dict[K, list[T]]:
    """Run every side once per round, in turns, so that a slow spell on a shared machine hits all of them rather
    than one; with `flip`, each round reverses the previous one's order, so that no side always runs first (into
    caches the other warmed). Returns each side's results in round order."""
    results: dict[K, list[T]] = {side: [] for side in sides}
    for round_index in range(repeats):
        order = list(sides)[::-1] if flip and round_index % 2 else sides
        for side in order:
            results[side].append(run(side, round_index))
    return results


def alternate(systems: Sequence[System], repeats: int, run: Callable[[System, int], T]) -> dict[str, list[T]]:
    """alternate_rounds over systems, their results by system name."""
    return {system.name: runs for system, runs in alternate_rounds(systems, repeats, run).items()}
