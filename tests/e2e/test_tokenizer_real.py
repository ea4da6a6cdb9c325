"""Our GGUF tokenizer on the default Gemma 3 270M gives the reference ids (HF's GGUF tokenizer, llama.cpp).

The fixture comes from scripts/make_tokenizer_fixtures.py; CI never loads HF's own GGUF tokenizer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest

from kvserve.model.chat_template import GEMMA_CHAT_TEMPLATE
from kvserve.model.source import resolve_model
from kvserve.model.tokenizer import gguf_tokenizer_cache_path, load_tokenizer

pytestmark = pytest.mark.real_model
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gemma3_tokenizer_ids.json"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kvserve-cache")


@pytest.fixture(scope="module")
def source():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return resolve_model(None)


@pytest.fixture(scope="module")
def tok(source, cache_dir):
    return load_tokenizer(source, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def fixture() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def test_ids_match_reference(tok, fixture):
    assert tok.bos_token_id == 2 and tok.eos_token_id == 1 and tok.add_bos
    assert tok.vocab_size == 262144
    for case in fixture["cases"]:
        text = case["text"]
        plain = tok.encode(text, add_special_tokens=False)
        assert plain == case["hf_ids_no_special"], text
        assert tok.encode(text) == case["kvserve_ids"], text
        if case.get("llama_cpp_ids_no_special") is not None:
            assert plain == case["llama_cpp_ids_no_special"], text
        if not text.startswith("<bos>"):  # there HF and llama.cpp add a second BOS; kvserve does not
            assert tok.encode(text) == case["hf_ids"], text
            if case.get("llama_cpp_ids") is not None:
                assert tok.encode(text) == case["llama_cpp_ids"], text
        assert tok.decode(plain, skip_special_tokens=False) == text


def test_special_tokens(tok):
    assert tok.token_to_id("<start_of_turn>") == 105
    assert tok.token_to_id("<end_of_turn>") == 106
    assert {1, 2, 105, 106} <= tok.special_ids
    assert tok.decode([2, 105, 2364, 107, 10979, 106]) == "user\nHi"


def test_gemma_chat_template(tok):
    assert tok.chat_template == GEMMA_CHAT_TEMPLATE  # the GGUF file carries none
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    prompt = tok.apply_chat_template(msgs)
    assert prompt == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(prompt)
    assert ids[:2] == [2, 105] and ids.count(2) == 1


def test_second_load_uses_cache(tok, source, cache_dir):
    entry = gguf_tokenizer_cache_path(source.path, cache_dir)
    assert (entry / "tokenizer.json").is_file()
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("gguf_file"))
        return real(*args, **kwargs)

    with mock.patch.object(AutoTokenizer, "from_pretrained", side_effect=spy):
        again = load_tokenizer(source, cache_dir=cache_dir)
    assert calls == [], "the second load must read the cached tokenizer.json with tokenizers alone"
    assert again.encode("The capital of France is") == tok.encode("The capital of France is")


def test_reference_prompts_tokenize_the_same(tok):
    """The HF reference fixture's prompt ids are what kvserve's tokenizer gives for its prompt texts."""
    ref = json.loads((FIXTURE.parent / "gemma3_270m_reference.json").read_text(encoding="utf-8"))
    for p in ref["prompts"]:
        assert tok.encode(p["prompt"]) == p["prompt_token_ids"], p["name"]
        if "messages" in p:
            assert tok.apply_chat_template(p["messages"]) == p["prompt"]
        assert tok.decode(p["token_ids"]) == p["text"]
