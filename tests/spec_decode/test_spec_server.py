"""Speculative decoding behind the OpenAI server: a streamed completion (several tokens per step arrive as one
delta) equals the non-streamed one and the plain engine's, and /metrics has vLLM's spec-decode counters."""

from __future__ import annotations

import json

from server_support import MODEL, metric_values

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
PROMPT = [2, 213, 188, 124, 205, 213, 188, 124, 205, 213, 188, 124, 205, 213, 188, 124, 205, 100, 13, 11]


def _complete(server, stream: bool) -> list[str] | str:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": stream}
    with server.client() as client:
        if not stream:
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]
        pieces = []
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    pieces += [c["text"] for c in json.loads(line[6:])["choices"]]
        return pieces


def test_streamed_and_plain_completions_match_and_counters_are_exported(make_server):
    plain = _complete(make_server(), stream=False)
    server = make_server(speculative_config=SPEC)
    assert _complete(server, stream=False) == plain
    assert "".join(_complete(server, stream=True)) == plain
    with server.client() as client:
        values = metric_values(client)
    assert values["kvserve:spec_decode_num_drafts_total"] > 0
    assert (
        0
        < values["kvserve:spec_decode_num_accepted_tokens_total"]
        <= values["kvserve:spec_decode_num_draft_tokens_total"]
    )
    per_pos = [
        values[f"kvserve:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}"]
        for i in range(SPEC["num_speculative_tokens"])
    ]
    assert sum(per_pos) == values["kvserve:spec_decode_num_accepted_tokens_total"]
