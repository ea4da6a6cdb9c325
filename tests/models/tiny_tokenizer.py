"""A character-level tokenizer with exactly 256 ids, to pair with the tiny random checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as RawTokenizer

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # ids 0..3, matching the tiny configs' pad 0 / eos 1... bos 2


def _characters(count: int) -> list[str]:
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    code = 0xC0
    while len(chars) < count:
        chars.append(chr(code))
        code += 1
    return chars


def write_char_tokenizer(path: Path, vocab_size: int = 256) -> None:
    """Every id below vocab_size decodes to something, so random models' outputs always detokenize."""
    tokens = SPECIALS + _characters(vocab_size - len(SPECIALS))
    raw = RawTokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens(SPECIALS)
    raw.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    path.mkdir(parents=True, exist_ok=True)
    raw.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
