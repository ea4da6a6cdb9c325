"""Tokenizer wrapper on a tiny HF checkpoint dir built in tmp_path: BOS rules, chat templates, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from kvserve.model.chat_template import GEMMA_CHAT_TEMPLATE, folded_system_messages, resolve_chat_template
from kvserve.model.source import ModelFormat, ModelSource
from kvserve.model.tokenizer import load_tokenizer

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
WORDS = ["hello", "world", "user", "model", "system", "hi", "there", "be", "brief", "\n", "A", "B", "C"]
TEMPLATE_WITH_BOS = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def make_checkpoint(root: Path, chat_template: str | None = TEMPLATE_WITH_BOS, with_bos: bool = True) -> Path:
    """A tokenizer-only 'checkpoint': word-level vocab, BOS post-processor like Gemma's."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit()])
    raw.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    raw.add_special_tokens(SPECIALS)
    if with_bos:
        raw.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    root.mkdir(parents=True, exist_ok=True)
    raw.save(str(root / "tokenizer.json"))
    cfg: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<eos>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
    }
    if with_bos:
        cfg["bos_token"] = "<bos>"
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return root


def source(path: Path) -> ModelSource:
    return ModelSource(ModelFormat.HF, path, path.name)


@pytest.fixture
def tok(tmp_path):
    return load_tokenizer(source(make_checkpoint(tmp_path / "ckpt")))


def test_loads_tiny_checkpoint(tok):
    assert tok.bos_token_id == 2 and tok.eos_token_id == 1
    assert tok.add_bos
    assert tok.vocab_size == len(SPECIALS) + len(WORDS)
    assert {0, 1, 2, 3} <= set(tok.all_special_ids)
    assert tok.token_to_id("<end_of_turn>") == 5
    assert tok.token_to_id("not-a-token") is None


def test_string_prompt_gets_bos_once(tok):
    assert tok.encode("hello world") == [2, 6, 7]
    assert tok.encode("hello world", add_special_tokens=False) == [6, 7]
    assert tok.encode("<bos> hello") == [2, 6]  # text that already starts with BOS: no second one
    assert tok.encode("") == [2]
    assert tok.decode([2, 6, 7]) == "hello world"
    assert tok.decode([2, 6, 7], skip_special_tokens=False) == "<bos> hello world"


def test_chat_template_that_writes_bos_gets_no_second(tok):
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert prompt == "<bos><start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(prompt)
    assert ids.count(2) == 1 and ids[0] == 2


def test_list_of_parts_content(tok):
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    as_parts = tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=False)
    as_text = tok.apply_chat_template([{"role": "user", "content": "hello\nworld"}], add_generation_prompt=False)
    assert as_parts == as_text
    with pytest.raises(ValueError, match="image_url"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_gemma_template(tok):
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": " hi \n"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "there"},
    ]
    out = tok.apply_chat_template(msgs, chat_template=GEMMA_CHAT_TEMPLATE)
    assert out == (
        "<bos><start_of_turn>user\nbe brief\n\nhi<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>\n"
        "<start_of_turn>user\nthere<end_of_turn>\n<start_of_turn>model\n"
    )
    no_prompt = tok.apply_chat_template(msgs[1:2], add_generation_prompt=False, chat_template=GEMMA_CHAT_TEMPLATE)
    assert no_prompt == "<bos><start_of_turn>user\nhi<end_of_turn>\n"
    with pytest.raises(ValueError, match="alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}], chat_template=GEMMA_CHAT_TEMPLATE)


# A system turn anywhere, as Qwen's template renders it (TEMPLATE_WITH_BOS renders every role as a turn too, but its
# leading system message is a turn of its own: it has a system turn).
SYSTEM_TURN_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Drops every system message but the first (as the tool tests' template does when it renders tools).
DROPPING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] != 'system' or loop.first %}<{{ m['role'] }}>{{ m['content'] }}\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
# Claude Code's shape: a system message after the first user turn, another after a later one.
MID_SYSTEM = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "system", "content": "A"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "there"},
    {"role": "system", "content": "B"},
]


def test_mid_conversation_system_messages_as_the_template_allows(tok):
    """Issue 55: Claude Code sends `role: "system"` messages inside the conversation. A template with a system turn
    renders them where they are; Gemma's (no system role: its leading system text goes into the first user turn, and
    any other system message was a 400 or an invented `system` turn) gets each merged into the user turn next to it;
    a template that would drop one gets it merged too."""
    native = tok.apply_chat_template(MID_SYSTEM, chat_template=SYSTEM_TURN_TEMPLATE)
    assert native == (
        "<|system|>be brief<|end|><|user|>hi<|end|><|system|>A<|end|><|assistant|>hello<|end|>"
        "<|user|>there<|end|><|system|>B<|end|><|assistant|>"
    )
    gemma = tok.apply_chat_template(MID_SYSTEM, chat_template=GEMMA_CHAT_TEMPLATE)
    assert gemma == (
        "<bos><start_of_turn>user\nbe brief\n\nhi\n\nA<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>\n"
        "<start_of_turn>user\nthere\n\nB<end_of_turn>\n<start_of_turn>model\n"
    )
    # the first turn of Claude Code's conversation, and a prefix of the second: the same merge, so a cacheable prefix
    first = tok.apply_chat_template(MID_SYSTEM[:3], chat_template=GEMMA_CHAT_TEMPLATE)
    assert first == "<bos><start_of_turn>user\nbe brief\n\nhi\n\nA<end_of_turn>\n<start_of_turn>model\n"
    dropped = tok.apply_chat_template(MID_SYSTEM[:4], chat_template=DROPPING_TEMPLATE)
    assert dropped == "<system>be brief\n<user>hi\n\nA\n<assistant>hello\n<assistant>"


@pytest.mark.parametrize(
    "messages,expected",
    [
        # several leading system messages: one (Codex's two developer messages)
        ([("system", "a"), ("system", "b"), ("user", "u")], [("system", "a\n\nb"), ("user", "u")]),
        # after an assistant turn: before the next user message, as a leading system text is
        (
            [("user", "u"), ("assistant", "x"), ("system", "s"), ("user", "v")],
            [("user", "u"), ("assistant", "x"), ("user", "s\n\nv")],
        ),
        # between two assistant turns, or last after one: a user turn of its own
        (
            [("user", "u"), ("assistant", "x"), ("system", "s"), ("assistant", "y")],
            [("user", "u"), ("assistant", "x"), ("user", "s"), ("assistant", "y")],
        ),
        ([("user", "u"), ("assistant", "x"), ("system", "s")], [("user", "u"), ("assistant", "x"), ("user", "s")]),
        # adjacent user messages end up one (turns alternate)
        ([("user", "u"), ("system", "s"), ("user", "v")], [("user", "u\n\ns\n\nv")]),
    ],
)
def test_folded_system_messages(messages, expected):
    folded = folded_system_messages([{"role": r, "content": c} for r, c in messages])
    assert [(m["role"], m["content"]) for m in folded] == expected


def test_chat_template_override(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    file = tmp_path / "t.jinja"
    file.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    from_file = load_tokenizer(source(ckpt), chat_template=str(file))
    assert from_file.apply_chat_template([{"role": "user", "content": "A"}]) == "[A]"
    from_str = load_tokenizer(source(ckpt), chat_template="{{ messages[0]['content'] }}!")
    assert from_str.apply_chat_template([{"role": "user", "content": "A"}]) == "A!"
    with pytest.raises(ValueError, match="no such file"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))


def test_no_chat_template_is_a_clear_error(tmp_path):
    tok = load_tokenizer(source(make_checkpoint(tmp_path / "ckpt", chat_template=None)))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_tokenizer_without_bos(tmp_path):
    tok = load_tokenizer(source(make_checkpoint(tmp_path / "ckpt", with_bos=False)))
    assert not tok.add_bos and tok.bos_token_id is None
    assert tok.encode("hello world") == [6, 7]


def test_malformed_tokenizer_json_names_the_file(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    (ckpt / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        load_tokenizer(source(ckpt))


def test_missing_tokenizer_files(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_tokenizer(source(ckpt))


# -- GGUF vocabulary -> fast tokenizer, cached -----------------------------------------------------------

GGUF_TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "\n",
    "▁",
    "▁hello",
    "▁world",
    "h",
    "e",
    "l",
    "o",
    "w",
    "r",
    "d",
    "▁h",
    "he",
    "ll",
    "lo",
    "▁w",
]


def make_gguf(path: Path, with_vocab: bool = True, chat_template: str | None = None, arch: str = "llama") -> Path:
    """A tiny GGUF (llama or gemma3 architecture) with an SPM-style vocabulary (control, normal and byte tokens)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    tokens = GGUF_TOKENS + [f"<0x{i:02X}>" for i in range(256)]
    if with_vocab:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores([0.0] * 7 + [-1.0, -2.0, -3.0] + [-5.0] * 12 + [0.0] * 256)
        w.add_token_types([3, 3, 3, 2, 3, 3, 1] + [1] * 15 + [6] * 256)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(False)
        if chat_template is not None:
            w.add_chat_template(chat_template)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_source(path: Path) -> ModelSource:
    return ModelSource(ModelFormat.GGUF, path, path.stem)


def test_gguf_tokenizer_is_cached(tmp_path):
    from unittest import mock

    from transformers import AutoTokenizer

    from kvserve.model.tokenizer import gguf_tokenizer_cache_path

    path = make_gguf(tmp_path / "tiny.gguf", chat_template="{{ messages[0]['content'] }}")
    cache = tmp_path / "cache"
    first = load_tokenizer(gguf_source(path), cache_dir=cache)
    ids = first.encode("hello world")
    assert ids[0] == 2 and first.decode(ids) == "hello world"
    assert first.encode("<bos>hello")[:2] != [2, 2]
    assert first.apply_chat_template([{"role": "user", "content": "A"}]) == "A"  # the file's own template
    entry = gguf_tokenizer_cache_path(path, cache)
    assert (entry / "tokenizer.json").is_file()

    calls: list = []
    real = AutoTokenizer.from_pretrained
    with mock.patch.object(
        AutoTokenizer, "from_pretrained", side_effect=lambda *a, **k: calls.append(k.get("gguf_file")) or real(*a, **k)
    ):
        second = load_tokenizer(gguf_source(path), cache_dir=cache)
    assert calls == []  # read from the cache: no GGUF conversion, no transformers tokenizer at all
    assert second.encode("hello world") == ids
    assert second.chat_template == first.chat_template

    (entry / "tokenizer.json").write_text("{not json")  # a damaged entry is rebuilt, not fatal
    third = load_tokenizer(gguf_source(path), cache_dir=cache)
    assert third.encode("hello world") == ids


def test_gguf_tokenizer_named_by_architecture_is_transformers_own(tmp_path):
    """For a known architecture kvserve names the tokenizer class (skipping AutoTokenizer's slow config pass);
    the result must be what plain AutoTokenizer builds."""
    from transformers import AutoTokenizer

    path = make_gguf(tmp_path / "gemma.gguf", arch="gemma3")
    ours = load_tokenizer(gguf_source(path), cache_dir=tmp_path / "cache")
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name, local_files_only=True)
    assert ours.backend.to_str() == ref.backend_tokenizer.to_str()
    assert ours.special_tokens == ref.special_tokens_map and set(ref.all_special_ids) <= ours.special_ids
    for text in ("hello world", "<bos>hello", "hello<end_of_turn>"):
        ids = ref.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == ids and ours.decode(ids) == ref.decode(
            ids, skip_special_tokens=True
        )


def test_gguf_without_vocabulary_names_the_file(tmp_path):
    path = make_gguf(tmp_path / "novocab.gguf", with_vocab=False)
    with pytest.raises(ValueError, match=r"novocab\.gguf.*tokenizer"):
        load_tokenizer(gguf_source(path), cache_dir=tmp_path / "cache")


# -- the wrapper against transformers' own tokenizer (the reference) --------------------------------------

TEXTS = ["hello world", "<bos> hello", "hello <end_of_turn> world", "", "A B C not-a-token", "hi\nthere"]


def test_matches_transformers_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    ckpt = make_checkpoint(tmp_path / "ckpt")
    ours, hf = load_tokenizer(source(ckpt)), AutoTokenizer.from_pretrained(str(ckpt))
    assert ours.vocab_size == len(hf) and ours.vocab() == hf.get_vocab()
    assert set(hf.all_special_ids) <= ours.special_ids
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert [ours.id_to_token(i) for i in ids] == hf.convert_ids_to_tokens(ids)
    msgs = [{"role": "user", "content": "hello"}, {"role": "model", "content": "world", "name": None}]
    for template in (TEMPLATE_WITH_BOS, GEMMA_CHAT_TEMPLATE.replace("assistant", "model")):
        for prompt in (True, False):
            assert ours.apply_chat_template(msgs, prompt, template) == hf.apply_chat_template(
                msgs, chat_template=template, add_generation_prompt=prompt, tokenize=False
            )


def test_clean_up_tokenization_spaces_as_transformers(tmp_path):
    """A WordLevel tokenizer that asks for transformers' clean-up of spaces before punctuation."""
    from transformers import AutoTokenizer

    ckpt = make_checkpoint(tmp_path / "ckpt")
    raw = RawTokenizer.from_file(str(ckpt / "tokenizer.json"))
    raw.add_tokens([".", "n't", "'s"])
    raw.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    raw.save(str(ckpt / "tokenizer.json"))
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**cfg, "clean_up_tokenization_spaces": True}))
    ours, hf = load_tokenizer(source(ckpt)), AutoTokenizer.from_pretrained(str(ckpt))
    ids = hf.encode("hello world . A n't B 's", add_special_tokens=False)
    assert ours.decode(ids) == hf.decode(ids) == "hello world. An't B's"


def test_cached_gguf_tokenizer_loads_without_transformers(tmp_path):
    """A later start reads the cache with `tokenizers` alone: transformers' import (~1 s) stays out of it."""
    import subprocess
    import sys

    path = make_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    first = load_tokenizer(gguf_source(path), cache_dir=cache)
    script = (
        "import sys; from pathlib import Path\n"
        "from kvserve.model.source import ModelFormat, ModelSource\n"
        "from kvserve.model.tokenizer import load_tokenizer\n"
        f"tok = load_tokenizer(ModelSource(ModelFormat.GGUF, Path({str(path)!r}), 'tiny'), cache_dir={str(cache)!r})\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
        "print(tok.encode('hello world'), tok.bos_token_id, tok.eos_token_id, sorted(tok.special_ids), tok.add_bos)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == (
        f"{first.encode('hello world')} {first.bos_token_id} {first.eos_token_id} "
        f"{sorted(first.special_ids)} {first.add_bos}"
    )


def test_gguf_tokenizer_falls_back_to_autotokenizer_when_the_named_class_fails(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    path = make_gguf(tmp_path / "gemma.gguf", arch="gemma3")
    real = AutoTokenizer.from_pretrained.__func__
    calls: list = []

    def flaky(cls, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs.get("tokenizer_type"))
        if kwargs.get("tokenizer_type"):
            raise OSError("this class cannot read the file")
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(flaky))
    tok = load_tokenizer(gguf_source(path), cache_dir=tmp_path / "cache")
    assert calls == ["gemma3", None]
    assert tok.encode("hello world")[0] == 2
