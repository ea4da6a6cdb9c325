"""The fingerprint of everything that makes stored KV reusable, and the identity of a model's weight files.

Why so many fields: a block's K/V is a function of its tokens and of every setting that changes the numbers computed
for them. Two engines that agree on all of these compute bit-identical K/V for the same prefix (so a restored block is
the block a cold run would have computed); if any differs, even the kernel instruction set, a restored block would be
silently not quite the one attention expects. The persistent tier keeps each fingerprint in its own subdirectory and
never reads or deletes another's."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import xxhash

from kvserve.kv.offload.record import FORMAT_VERSION
from kvserve.units import MiB

# What a checkpoint directory's identity covers: its weights and the files that say how to read them.
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".json")
_CHUNK = 16 * MiB
# Under kvserve's cache directory: one small file per weight file hashed, named by what changes when the file does.
_CACHE_SUBDIR = "weights-identity"


def weights_identity(path: Path, cache_dir: Path | None = None) -> str:
    """A content identity of a model's weights (a file, or a checkpoint directory's config and weight files): sha256
    over each file's name, size and xxh3-128 of all its bytes. Every byte counts: a fine-tuned or edited file of the
    same name and size is another model (its first and last MiB, the identity's old sample, can be unchanged). The
    whole-file digest streams at memory speed and is cached under `cache_dir` (kvserve's cache), so that only the
    first start after a file changes reads it."""
    files = (
        [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file())
    )
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name}\0{file.stat().st_size}\0{cached_file_digest(file, cache_dir)}\0".encode())
    return digest.hexdigest()


def cached_file_digest(file: Path, cache_dir: Path | None) -> str:
    """file_digest(file), from the cache when an entry for this very file exists. The entry is named by the file's
    device, inode, size, mtime and ctime: an edit in place changes mtime and ctime, a copy or a replacement the inode,
    and ctime cannot be set back by a user (mtime can, with touch), so a stale entry is never found for a changed file.
    The cache is a hint: failing to read or write it only costs a read of the file."""
    st = file.stat()
    if cache_dir is None:
        return file_digest(file)
    entry = cache_dir / _CACHE_SUBDIR / f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}-{st.st_ctime_ns}"
    try:
        known = entry.read_text().strip()
        if len(known) == 32 and all(c in "0123456789abcdef" for c in known):
            return known
    except OSError:
        pass
    value = file_digest(file)
    try:
        entry.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = entry.parent / f".tmp-{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(value + "\n")
        os.replace(tmp, entry)
    except OSError:
        pass
    return value


def file_digest(file: Path) -> str:
    """xxh3-128 of the file's bytes, read in chunks into one buffer (a GGUF of 250 MB: a fraction of a second from
    the page cache)."""
    digest = xxhash.xxh3_128()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(file, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class KVFingerprint:
    """What a stored block was computed under. `static_kv_scales` is a string ("" without): floats print exactly."""

    weights: str
    weight_quantization: str
    activation_quantization: str
    kernels: str  # "torch", or the native kernels' instruction set (avx2, avx512, ...)
    attention_backend: str
    device_type: str
    dtype: str
    kv_cache_dtype: str
    tier_dtype: str  # how the tier stores blocks: "auto" (the cache's own) or "int8"
    static_kv_scales: str
    block_size: int
    hash_algo: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # The KV cache groups (kv/groups.py, KVCacheLayout.signature): a block holds the layers of one group.
    kv_cache_groups: str
    torch_version: str
    kvserve_version: str
    format_version: int = FORMAT_VERSION
    # What the records hold: pool blocks' K/V, or a hybrid model's state snapshots (state_fingerprint): each kind
    # has its own subdirectory, its own record size and its own share of the tier's budget.
    records: str = "kv blocks"

    def for_state_snapshots(self, state: str) -> KVFingerprint:
        """The fingerprint of the state snapshots stored beside these blocks; `state`: what one holds
        (StateSpec.describe)."""
        return replace(self, records=f"state snapshots: {state}")

    def describe(self) -> dict[str, str | int]:
        return asdict(self)

    @property
    def digest(self) -> bytes:
        """16 bytes: sha256 of the fields as canonical JSON, cut (the records carry it; the directory is its hex)."""
        return hashlib.sha256(json.dumps(self.describe(), sort_keys=True).encode()).digest()[:16]

    @property
    def name(self) -> str:
        return self.digest.hex()

    @property
    def family(self) -> str:
        """What one process's subdirectories share: the fingerprint but for what a record holds (its blocks' and its
        state snapshots' subdirectories have one family). A subdirectory of another family is another model's, flags'
        or version's, whose records count against the directory's budget (stores.py)."""
        return family_of(self.describe())


def family_of(description: Mapping[str, object]) -> str:
    """The family (KVFingerprint.family) of a fingerprint's description, as fingerprint.json holds it."""
    rest = {k: v for k, v in description.items() if k != "records"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, default=str).encode()).hexdigest()[:32]
