"""Incremental detokenization: streamed text == full decode (transformers' decode, the reference), no partial
characters, stop strings."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.model.tokenizer import Tokenizer as KvTokenizer
from kvserve.sampling_params import SamplingParams

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there! Stop here: STOP and END.",
    "你好，世界。今天天气很好。我们去公园吧。",
    "Emoji time 😀 🎉 👍🏽 and more text 🙂",
    "café naïve résumé — “quotes” ok",
]
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_end|>"]


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|im_end|>"],
        clean_up_tokenization_spaces=False,
    )


def _byte_level_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return _wrap(tok)


def _sentencepiece_like(strip_leading_space: bool) -> PreTrainedTokenizerFast:
    """BPE over "▁"-spaced text with <0xNN> byte-fallback tokens (Llama-style when
    `strip_leading_space`, Gemma-style otherwise). Rare characters are left out of the learned
    alphabet so that Chinese and emoji partly go through byte fallback."""
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Replace(" ", "▁")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, limit_alphabet=45)
    trained.train_from_iterator(CORPUS, trainer=trainer)
    learned = json.loads(trained.to_str())["model"]
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for t in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(t, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    steps = [normalizers.Replace(" ", "▁")]
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if strip_leading_space:
        steps.insert(0, normalizers.Prepend("▁"))
        dec.append(decoders.Strip(" ", 1, 0))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence(dec)
    tok.add_special_tokens(SPECIALS)
    return _wrap(tok)


TOKENIZERS = {
    "byte_level": _byte_level_bpe(),
    "sp_llama": _sentencepiece_like(strip_leading_space=True),
    "sp_gemma": _sentencepiece_like(strip_leading_space=False),
}


def _stream(tokenizer, ids, **params):
    detok = IncrementalDetokenizer(KvTokenizer.from_hf(tokenizer), [1, 2, 3], SamplingParams(**params))
    deltas, stopped = [], None
    for t in ids:
        r = detok.append(t)
        deltas.append(r.delta_text)
        if r.stopped_on is not None:
            stopped = r.stopped_on
            break
    else:
        final = detok.finish()  # text held back until the end (a byte-fallback run) may complete a stop
        deltas.append(final.delta_text)
        stopped = final.stopped_on
    return deltas, stopped, detok


def test_fixture_uses_byte_fallback():
    tok = TOKENIZERS["sp_llama"]
    pieces = tok.convert_ids_to_tokens(tok.encode("你好 😀 猫🐱", add_special_tokens=False))
    assert any(p.startswith("<0x") for p in pieces), pieces


@pytest.mark.parametrize("name", list(TOKENIZERS))
@pytest.mark.parametrize("text", CORPUS + ["  leading spaces", "x😀y", "中", "猫🐱 unseen ß"])
def test_stream_of_real_text_equals_decode(name, text):
    tok = TOKENIZERS[name]
    ids = tok.encode(text, add_special_tokens=False)
    deltas, _, detok = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", list(TOKENIZERS))
@pytest.mark.parametrize("skip", [True, False])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stream_of_random_ids_equals_decode(name, skip, data):
    tok = TOKENIZERS[name]
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=40))
    deltas, _, _ = _stream(tok, ids, skip_special_tokens=skip)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_no_partial_characters_are_streamed(name):
    tok = TOKENIZERS[name]
    ids = tok.encode("你好世界 😀🎉👍🏽 中文", add_special_tokens=False)
    deltas, _, _ = _stream(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)


def test_byte_fallback_character_is_emitted_whole():
    tok = TOKENIZERS["sp_gemma"]
    byte_ids = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "中".encode()]
    ids = byte_ids + tok.encode("a", add_special_tokens=False)
    deltas, _, _ = _stream(tok, ids)
    assert deltas[:3] == ["", "", ""]  # held until a non-byte token closes the run
    assert deltas[3].startswith("中")


def test_skip_special_tokens():
    tok = TOKENIZERS["byte_level"]
    ids = tok.encode("hello", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert "".join(_stream(tok, ids, skip_special_tokens=True)[0]) == "hello"
    assert "".join(_stream(tok, ids, skip_special_tokens=False)[0]) == "hello<|im_end|>"


def _char_ids(tok, text):
    """One token per character, so stop strings straddle token boundaries."""
    return [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(include):
    tok = TOKENIZERS["byte_level"]
    ids = _char_ids(tok, "say STOP now")
    deltas, stopped, detok = _stream(tok, ids, stop=["STOP"], include_stop_str_in_output=include)
    expected = "say STOP" if include else "say "
    assert stopped == "STOP"
    assert "".join(deltas) == expected


def test_partial_stop_string_is_held_back_then_released():
    tok = TOKENIZERS["byte_level"]
    detok = IncrementalDetokenizer(KvTokenizer.from_hf(tok), [], SamplingParams(stop=["STOP"]))
    streamed = ""
    for t in _char_ids(tok, "a STO"):
        streamed += detok.append(t).delta_text
    assert streamed == "a "  # "STO" could still become "STOP"
    for t in _char_ids(tok, "x"):
        streamed += detok.append(t).delta_text
    assert streamed == "a STOx"
    for t in _char_ids(tok, "ST"):
        streamed += detok.append(t).delta_text
    assert streamed == "a STOx"
    streamed += detok.finish().delta_text  # ended for another reason: nothing is held any more
    assert streamed == "a STOxST"


def test_earliest_stop_string_wins_within_one_token():
    tok = TOKENIZERS["byte_level"]
    ids = tok.encode("Hello world, hello there!", add_special_tokens=False)
    deltas, stopped, _ = _stream(tok, ids, stop=["there", "world"])
    assert stopped == "world"
    assert "".join(deltas) == "Hello "


def test_stop_strings_wait_for_min_tokens():
    tok = TOKENIZERS["byte_level"]
    ids = _char_ids(tok, "ab ab")
    deltas, stopped, _ = _stream(tok, ids, stop=["ab"], min_tokens=2)
    assert stopped == "ab"
    assert "".join(deltas) == "ab "


@pytest.mark.parametrize("name", list(TOKENIZERS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_stop_strings_match_cut_decode(name, data):
    tok = TOKENIZERS[name]
    text = data.draw(st.sampled_from(CORPUS))
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    a = data.draw(st.integers(0, len(full) - 1))
    stop = full[a : a + data.draw(st.integers(1, 4))]
    deltas, stopped, _ = _stream(tok, ids, stop=[stop])
    # The stream never shows a partial stop string, and stops where the decode first has it.
    assert stopped == stop
    assert "".join(deltas) == full[: full.index(stop)]
