"""The fingerprint of everything that makes stored KV reusable, and the identity of a model's weight files.

Why so many fields: a block's K/V is a function of its tokens and of every setting that changes the numbers computed
for them. Two engines that agree on all of these compute bit-identical K/V for the same prefix (so a restored block is
the block a cold run would have computed); if any differs, even the kernel instruction set, a restored block would be
silently not quite the one attention expects. The persistent tier keeps each fingerprint in its own subdirectory and
never reads or deletes another's."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from kvserve.kv.offload.record import FORMAT_VERSION
from kvserve.units import MiB

# Bytes read from each end of a weight file for its identity: enough to tell files apart (headers, tensor data),
# cheap enough for every start (a whole-file sha256 of a 250 MB GGUF costs about a second).
_IDENTITY_SPAN = MiB


def weights_identity(path: Path) -> str:
    """A content identity of a model's weights (a file, or a checkpoint directory's config and weight files): sha256
    over each file's name, size and first and last MiB. A copy of the same file has the same identity; a re-quantized
    or edited one does not (its size or its bytes at either end change)."""
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".gguf", ".bin", ".json") and p.is_file())
    )
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            digest.update(f.read(_IDENTITY_SPAN))
            if size > 2 * _IDENTITY_SPAN:
                f.seek(size - _IDENTITY_SPAN)
                digest.update(f.read(_IDENTITY_SPAN))
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

    def describe(self) -> dict[str, str | int]:
        return asdict(self)

    @property
    def digest(self) -> bytes:
        """16 bytes: sha256 of the fields as canonical JSON, cut (the records carry it; the directory is its hex)."""
        return hashlib.sha256(json.dumps(self.describe(), sort_keys=True).encode()).digest()[:16]

    @property
    def name(self) -> str:
        return self.digest.hex()
