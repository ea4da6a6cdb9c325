"""Fixtures for the structured-output tests: the tiny character tokenizer (with a padded logits width) and the
default model's Gemma tokenizer, and one grammar backend of each kind over each, built once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))

from structured_support import TINY_LOGITS_WIDTH
from tiny_tokenizer import write_char_tokenizer
from tool_server_support import tools_client, tools_model_dir, tools_server  # noqa: F401 (fixtures)

from kvserve.model.tokenizer import Tokenizer
from kvserve.structured.backend import GrammarBackend, GrammarVocab, make_backend


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """256 character tokens; ids 0..3 are <pad> <eos> <bos> <unk>."""
    from tokenizers import Tokenizer as RawTokenizer

    path = tmp_path_factory.mktemp("tiny-tokenizer")
    write_char_tokenizer(path)
    raw = RawTokenizer.from_file(str(path / "tokenizer.json"))
    return Tokenizer(raw, {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"})


@pytest.fixture(scope="session")
def tiny_vocab(tiny_tokenizer: Tokenizer) -> GrammarVocab:
    """Logits wider than the tokenizer (a padded lm_head): ids 256..319 exist only in the logits."""
    return GrammarVocab.from_tokenizer(tiny_tokenizer, vocab_size=TINY_LOGITS_WIDTH)


@pytest.fixture(scope="session")
def tiny_backends(tiny_vocab: GrammarVocab) -> dict[str, GrammarBackend]:
    return {name: make_backend(name, tiny_vocab) for name in ("xgrammar", "guidance", "auto")}


@pytest.fixture(scope="session")
def gemma_tokenizer() -> Tokenizer:
    from kvserve.model.source import resolve_model
    from kvserve.model.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="session")
def gemma_backends(gemma_tokenizer: Tokenizer) -> dict[str, GrammarBackend]:
    """Both backends over the 262,144-token vocabulary; stop tokens <eos> and <end_of_turn>, as for chat."""
    vocab = GrammarVocab.from_tokenizer(gemma_tokenizer, stop_token_ids=[1, 106])
    return {name: make_backend(name, vocab) for name in ("xgrammar", "guidance")}
