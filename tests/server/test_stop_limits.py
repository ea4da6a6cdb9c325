"""The stop list is bounded (SamplingParams' MAX_STOP_STRINGS / MAX_STOP_STRING_CHARS): beyond the bounds a request
gets 400 naming `stop`; within them, long stop lists work, and the server goes on serving."""

from __future__ import annotations

from server_support import MODEL

from kvserve.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS


def _error(response):
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_stop_list_over_the_bounds_is_400(http):
    too_many = {"model": MODEL, "prompt": "hi", "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}
    err = _error(http.post("/v1/completions", json=too_many))
    assert err["param"] == "stop" and f"at most {MAX_STOP_STRINGS} strings" in err["message"]
    too_long = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stop": ["x" * (MAX_STOP_STRING_CHARS + 1)],
    }
    err = _error(http.post("/v1/chat/completions", json=too_long))
    assert err["param"] == "stop" and f"at most {MAX_STOP_STRING_CHARS} characters" in err["message"]


def test_stop_list_at_the_bounds_is_served(http):
    stops = [chr(0x4E00 + i) * MAX_STOP_STRING_CHARS for i in range(MAX_STOP_STRINGS)]  # never generated
    r = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "hello", "max_tokens": 8, "stop": stops, "ignore_eos": True, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
