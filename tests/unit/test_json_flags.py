"""vLLM's JSON-object flags (--speculative-config, --kv-events-config) are typed: a wrong type or a non-finite
number is a clear error naming the flag and the key, never a TypeError deep in the engine, and JSON's true is no
integer (the hostile run found all four reaching the engine: "4", 4.5, 1e400, "nan")."""

from __future__ import annotations

import pytest

from kvserve.cli import main
from kvserve.kv.events_config import parse_kv_events_config
from kvserve.spec_decode.config import parse_speculative_config


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{"method": "ngram", "num_speculative_tokens": "4"}', 'num_speculative_tokens must be an integer, got "4"'),
        ('{"method": "ngram", "num_speculative_tokens": 4.5}', "num_speculative_tokens must be an integer, got 4.5"),
        ('{"method": "ngram", "num_speculative_tokens": 1e400}', "num_speculative_tokens must be an integer"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens must be an integer, got true"),
        ('{"method": "suffix", "suffix_decoding_min_token_prob": NaN}', "must be a finite number, got nan"),
        ('{"method": "suffix", "suffix_decoding_max_spec_factor": -Infinity}', "must be a finite number"),
        ('{"method": "ngram", "min_acceptance_rate": "0.5"}', 'min_acceptance_rate must be a number, got "0.5"'),
        ('{"method": 5}', "method must be a string, got 5"),
        ('{"method": "ngram", "prompt_lookup_max": null}', "prompt_lookup_max must be an integer, got null"),
    ],
)
def test_a_wrongly_typed_speculative_config_names_the_key(config: str, message: str) -> None:
    with pytest.raises(ValueError, match="--speculative-config: ") as error:
        parse_speculative_config(config)
    assert message in str(error.value)


def test_well_typed_values_pass_and_integers_serve_as_numbers() -> None:
    config = parse_speculative_config('{"method": "ngram", "min_acceptance_rate": 1, "num_speculative_tokens": 3}')
    assert config is not None and config.min_acceptance_rate == 1 and config.num_speculative_tokens == 3


def test_kv_events_config_is_typed_the_same_way() -> None:
    with pytest.raises(ValueError, match="--kv-events-config: buffer_steps must be an integer, got true"):
        parse_kv_events_config('{"enable_kv_cache_events": true, "buffer_steps": true}')
    with pytest.raises(ValueError, match="replay_endpoint must be a string or null, got 7"):
        parse_kv_events_config('{"replay_endpoint": 7}')


def test_serve_refuses_it_at_start_with_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": "4"}']) == 2
    err = capsys.readouterr().err
    assert "kvserve: error: --speculative-config: num_speculative_tokens must be an integer" in err
    assert "Traceback" not in err
