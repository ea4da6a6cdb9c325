"""Encoding a text from an earlier one's encoding (kvserve/model/prefix_encoding.py) gives exactly Tokenizer.encode's
ids, on the default model's tokenizer (Gemma 3: BOS added) and the agents' model's (Qwen2.5: none), for texts that
extend, shorten, or part from each other anywhere: inside an added token, just before one, after whitespace, in
multi-byte characters. And it reuses: an agent's next turn tokenizes only its new turns."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from kvserve.model.prefix_encoding import EncodedText, PrefixEncoder, common_prefix_length
from kvserve.model.source import resolve_model
from kvserve.model.tokenizer import Tokenizer, load_tokenizer
from kvserve.server.prepare import RenderedTokens

FIXTURES = Path(__file__).parent.parent / "fixtures" / "agents"
# Each model's turn markers, as its chat template writes them.
TURNS = {
    None: ("<start_of_turn>user\n", "<start_of_turn>model\n", "<end_of_turn>\n"),
    "qwen2.5-coder-0.5b-instruct": ("<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>\n"),
}


@pytest.fixture(scope="module", params=list(TURNS), ids=["gemma3", "qwen2.5"])
def model(request: pytest.FixtureRequest) -> tuple[Tokenizer, tuple[str, str, str]]:
    return load_tokenizer(resolve_model(request.param)), TURNS[request.param]


class RecordingBackend:
    """The tokenizer's backend, recording the texts it is asked to encode."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.texts: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        self.texts.append(text)
        return self._backend.encode(text, add_special_tokens=add_special_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def _recording(tokenizer: Tokenizer) -> tuple[PrefixEncoder, RecordingBackend]:
    backend = RecordingBackend(tokenizer.backend)
    copy = Tokenizer(backend, tokenizer.special_tokens, name=tokenizer.name)  # type: ignore[arg-type]
    return PrefixEncoder(copy), backend


def _fixture_strings() -> list[str]:
    """Real agent prose and JSON: the recorded requests' strings."""
    found: list[str] = []

    def walk(x: Any) -> None:
        if isinstance(x, str) and len(x) > 20:
            found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    for path in sorted(FIXTURES.glob("*.json")):
        walk(json.loads(path.read_text()))
    return found


def test_common_prefix_length() -> None:
    assert common_prefix_length("", "abc") == 0
    assert common_prefix_length("abc", "abc") == 3
    assert common_prefix_length("abcd", "abXd") == 2
    assert common_prefix_length("ab", "abcd") == 2
    assert common_prefix_length("x" * 1000 + "a", "x" * 1000 + "b") == 1000


def test_a_conversation_growing_turn_by_turn_reuses_its_earlier_turns(model) -> None:
    tokenizer, (user, assistant, end) = model
    encoder, backend = _recording(tokenizer)
    strings = _fixture_strings()[:40]
    conversation = ""
    earlier: list[EncodedText] = []
    for i, s in enumerate(strings):
        conversation += (user if i % 2 == 0 else assistant) + s + end
        prompt = conversation + assistant  # the generation prompt: the next turn parts from it inside its reply
        backend.texts.clear()
        encoded = encoder.extend(prompt, earlier)
        assert list(encoded.ids) == tokenizer.encode(prompt), i
        if earlier:
            assert sum(map(len, backend.texts)) < len(s) + 100, "only the new turn is tokenized"
        earlier = [encoded]


def test_texts_that_part_anywhere_encode_exactly(model) -> None:
    """Random texts over the added tokens, their fragments, whitespace and multi-byte characters; each encoded from a
    random earlier one that shares a random prefix with it."""
    tokenizer, turns = model
    encoder = PrefixEncoder(tokenizer)
    specials = [t for t in tokenizer.backend.get_added_tokens_decoder().values() if t.content][:40]
    pieces = [
        *turns,
        *(t.content for t in specials),
        *(t.content[: len(t.content) // 2] for t in specials),
        " ",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "é",
        "日本語",
        "🙂",
        "def f(x):\n    return x\n",
        "word",
        "<",
        "|",
        ">",
        *(_fixture_strings()[:5]),
    ]
    rng = random.Random(0)
    pool: list[EncodedText] = [encoder.encode("")]
    for step in range(300):
        base = rng.choice(pool).text
        keep = rng.randint(0, len(base))
        text = base[:keep] + "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        candidates = rng.sample(pool, min(len(pool), 3))
        encoded = encoder.extend(text, candidates)
        assert list(encoded.ids) == tokenizer.encode(text), (step, text[-200:])
        whole = encoder.encode(text)
        assert (encoded.cut_chars, encoded.cut_tokens) == (whole.cut_chars, whole.cut_tokens)
        pool = [*pool[-20:], encoded]


def test_the_memo_encodes_a_marks_render_from_the_whole_prompt(model) -> None:
    """/v1/messages' order: the whole prompt, then each mark's render (a prefix of it without the generation prompt):
    the mark reuses the whole, and another salt's render reuses nothing."""
    tokenizer, (user, assistant, end) = model
    encoder, backend = _recording(tokenizer)
    memo = RenderedTokens(max_tokens=100_000)
    strings = _fixture_strings()[:6]
    mark = "".join((user if i % 2 == 0 else assistant) + s + end for i, s in enumerate(strings))
    whole = mark + user + "and now?" + end + assistant
    assert memo.get("a", whole, encoder) == tokenizer.encode(whole)
    backend.texts.clear()
    assert memo.get("a", mark, encoder) == tokenizer.encode(mark)
    assert sum(map(len, backend.texts)) < len(strings[-1]) + 50
    backend.texts.clear()
    assert memo.get("b", mark, encoder) == tokenizer.encode(mark)
    assert backend.texts == [mark]
