"""A request body's long lists stop validating at their first bad item (issue 14): an invalid body of a hundred
thousand items yields a handful of errors (one per union member that could hold the list), not one per item, so
the 400 for a large hostile body costs what a small one does."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

N = 100_000
MESSAGE = {"role": "user", "content": "hi"}


def _num_errors(model: type[BaseModel], body: dict[str, Any]) -> int:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return len(info.value.errors())


@pytest.mark.parametrize(
    ("model", "body"),
    [
        (DetokenizeRequest, {"tokens": [1] + ["x"] * N}),
        (CompletionRequest, {"prompt": "hi", "stop_token_ids": [1] + ["x"] * N}),
        (CompletionRequest, {"prompt": "hi", "stop": ["a"] + [1] * N}),
        (CompletionRequest, {"prompt": "hi", "guided_choice": ["a"] + [1] * N}),
        (ChatCompletionRequest, {"messages": [MESSAGE] + [1] * N}),
        (ChatCompletionRequest, {"messages": [MESSAGE], "tools": [{}] + [1] * N}),
        (ChatCompletionRequest, {"messages": [MESSAGE], "functions": [{}] + [1] * N}),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{}] + [1] * N}]}),
        (ChatCompletionRequest, {"messages": [{"role": "assistant", "tool_calls": [{}] + [1] * N}]}),
        (TokenizeRequest, {"messages": [MESSAGE] + [1] * N}),
        (TokenizeRequest, {"messages": [MESSAGE], "tools": [{}] + [1] * N}),
    ],
    ids=[
        "detokenize-tokens",
        "stop_token_ids",
        "stop",
        "guided_choice",
        "messages",
        "tools",
        "functions",
        "content-parts",
        "tool_calls",
        "tokenize-messages",
        "tokenize-tools",
    ],
)
def test_a_long_invalid_list_reports_its_first_bad_item_only(model: type[BaseModel], body: dict[str, Any]) -> None:
    assert _num_errors(model, body) <= 4  # a union member or two beside the list: never one per item


@pytest.mark.parametrize(
    "prompt",
    [
        [1] + ["x"] * N,  # token ids with bad items
        ["a"] + [1.5] * N,  # strings with bad items
        [[1]] + [["x"]] * N,  # lists of token ids with bad items
    ],
    ids=["ids", "strings", "id-lists"],
)
def test_a_long_invalid_prompt_list_stops_early_in_every_union_member(prompt: list[Any]) -> None:
    """`prompt` is a union of list types: each member stops at its first bad item (one error each, at most)."""
    assert _num_errors(CompletionRequest, {"prompt": prompt}) <= 4


def test_valid_lists_still_validate_whole() -> None:
    request = CompletionRequest.model_validate({"prompt": [[1, 2], [3]], "stop": ["a", "b"], "stop_token_ids": [7]})
    assert request.prompt == [[1, 2], [3]] and request.stop == ["a", "b"] and request.stop_token_ids == [7]
    assert DetokenizeRequest.model_validate({"tokens": list(range(1000))}).tokens == list(range(1000))


def test_the_first_bad_item_is_the_one_reported() -> None:
    with pytest.raises(ValidationError) as info:
        DetokenizeRequest.model_validate({"tokens": [1, 2, "x", "y"]})
    assert [e["loc"] for e in info.value.errors()] == [("tokens", 2)]
