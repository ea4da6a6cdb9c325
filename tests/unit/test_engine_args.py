"""#43 item 14: the engine's settings have one source. EngineConfig's field list holds every default (the flags take
theirs from it), the flags become a config without fallbacks, and flag-shaped values (JSON text, dicts, sizes with
units, lists) are parsed by their field's converter before the frozen config is built, never fixed up after."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect

import pytest

import kvserve.config
import kvserve.engine_args
from kvserve.config import EngineConfig
from kvserve.engine_args import add_engine_args, engine_config_from_args
from kvserve.kv.events_config import KVEventsConfig
from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.structured.config import StructuredOutputsConfig


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_every_flag_is_a_field_and_defaults_to_it() -> None:
    args = parser().parse_args([])
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(vars(args)) <= fields
    assert engine_config_from_args(args) == EngineConfig()
    assert "disable_hybrid_kv_cache_manager" in vars(args)


def test_no_default_is_written_twice() -> None:
    """engine_args.py writes no default of its own (a literal default=), and reads no flag with a getattr(...,
    default) fallback."""
    tree = ast.parse(inspect.getsource(kvserve.engine_args))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    literal = [k for c in calls for k in c.keywords if k.arg == "default" and not isinstance(k.value, ast.Call)]
    assert not literal
    assert not [c for c in calls if _name(c) == "getattr"]


def _name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def test_a_command_without_the_engine_flags_is_an_error_not_silent_defaults() -> None:
    args = parser().parse_args([])
    del args.kernel_isa
    with pytest.raises(KeyError, match="kernel_isa"):
        engine_config_from_args(args)


def test_flag_shaped_settings_are_parsed_by_converters_before_construction() -> None:
    config = EngineConfig.parse(
        speculative_config='{"method": "ngram"}',
        kv_events_config={"enable_kv_cache_events": True},
        structured_outputs_config=None,
        kv_cache_memory_bytes="4GiB",
        cuda_graph_sizes=[1, 8],
        kv_offloading_size=16,  # a bare number is GiB, as in vLLM: LLM(kv_offloading_size=16)
    )
    assert isinstance(config.speculative_config, SpeculativeConfig)
    assert isinstance(config.kv_events_config, KVEventsConfig)
    assert config.structured_outputs_config == StructuredOutputsConfig()
    assert config.kv_cache_memory_bytes == 4 << 30 and config.cuda_graph_sizes == (1, 8)
    assert config.kv_offload is not None and config.kv_offload.size_bytes == 16 << 30
    assert config.updated(speculative_config=None, kv_cache_memory_bytes="1MiB").kv_cache_memory_bytes == 1 << 20
    assert "object.__setattr__" not in inspect.getsource(kvserve.config)


@pytest.mark.parametrize(
    "raw",
    [dict(speculative_config={"method": "ngram"}), dict(kv_cache_memory_bytes="4GiB"), dict(cuda_graph_sizes=[1])],
)
def test_the_constructor_itself_takes_parsed_values_only(raw: dict) -> None:
    """A field holds the type it says: a raw value given to the constructor is a clear error naming parse."""
    with pytest.raises(TypeError, match=r"EngineConfig\.parse"):
        EngineConfig(**raw)


def test_the_cli_still_reports_a_bad_json_flag_in_one_line() -> None:
    with pytest.raises(ValueError, match="--speculative-config is not valid JSON"):
        engine_config_from_args(parser().parse_args(["--speculative-config", "{"]))


def test_long_prefill_flags_resolve_per_device_and_are_checked() -> None:
    """--long-prefill-token-threshold unset: the CPU default on CPU, off on CUDA (vLLM's default with one partial
    prefill), off without chunked prefill; --max-long-partial-prefills at least 1 and at most
    --max-num-partial-prefills (vLLM's rule)."""
    args = parser().parse_args(["--long-prefill-token-threshold", "512", "--max-long-partial-prefills", "2"])
    config = engine_config_from_args(args)
    assert (config.long_prefill_threshold, config.max_long_partial_prefills) == (512, 2)
    assert EngineConfig().long_prefill_threshold == kvserve.config.DEFAULT_CPU_LONG_PREFILL_TOKENS
    assert EngineConfig(device="cuda").long_prefill_threshold == 0
    assert EngineConfig(enable_chunked_prefill=False).long_prefill_threshold == 0
    assert EngineConfig(long_prefill_token_threshold=0).long_prefill_threshold == 0
    with pytest.raises(ValueError, match="--long-prefill-token-threshold must be >= 0"):
        EngineConfig(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="--max-long-partial-prefills must be >= 1 and at most"):
        EngineConfig(max_long_partial_prefills=0)
    with pytest.raises(ValueError, match="--max-long-partial-prefills must be >= 1 and at most"):
        EngineConfig(max_long_partial_prefills=2, max_num_partial_prefills=1)
