"""A small, fast GGUF parser: metadata as plain Python values, tensors as memory-mapped numpy views.

Why not `gguf.GGUFReader`: it builds a numpy view per metadata item and takes ~12 s on the default
model because of its 262,144-entry vocabulary; here that takes well under a second, and scalar fields
come back as plain ints/floats/strs (no `parts`/`data` indexing to get wrong). Dequantization itself
is delegated to `gguf.quants.dequantize`. No torch import, so capacity tools can use it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format (scalars only; 8 = string, 9 = array).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_TYPES = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch/numpy order (outermost first), i.e. GGUF's dims reversed
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """An opened .gguf file: `metadata` (key -> value) and `tensors` (name -> info), data via mmap."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ValueError(f"{self.path}: cannot open GGUF file: {e}") from e
        try:
            self.metadata, self.tensors = self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, KeyError) as e:
            raise ValueError(f"{self.path}: malformed GGUF file: {e}") from e

    # -- parsing -------------------------------------------------------------------------------------
    def _parse(self) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        mm = self._mm
        if mm[:4] != GGUF_MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (bad magic {bytes(mm[:4])!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
        if version < 2:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (need >= 2)")
        pos = 24
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = self._read_str(pos)
            (vtype,) = struct.unpack_from("<I", mm, pos)
            metadata[key], pos = self._read_value(vtype, pos + 4)
        infos = []
        for _ in range(n_tensors):
            name, pos = self._read_str(pos)
            (n_dims,) = struct.unpack_from("<I", mm, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", mm, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", mm, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, ggml_type, offset))
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = (pos + alignment - 1) // alignment * alignment
        tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, ggml_type, offset in infos:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            n_elems = int(np.prod(dims)) if dims else 1
            nbytes = n_elems // block * type_size
            start = data_start + offset
            if start + nbytes > len(mm):
                raise ValueError(f"{self.path}: tensor {name} extends past the end of the file (truncated?)")
            tensors[name] = GGUFTensorInfo(name, tuple(int(d) for d in reversed(dims)), ggml_type, start, nbytes)
        return metadata, tensors

    def _read_str(self, pos: int) -> tuple[str, int]:
        (n,) = _U64.unpack_from(self._mm, pos)
        return self._mm[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"), pos + 8 + n

    def _read_strings(self, count: int, pos: int) -> tuple[list[str], int]:
        mm, length = self._mm, _U64.unpack_from
        out = []
        for _ in range(count):
            (n,) = length(mm, pos)
            pos += 8
            out.append(mm[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        return out, pos

    def _read_value(self, vtype: int, pos: int) -> tuple[Any, int]:
        if vtype == _STRING:
            return self._read_str(pos)
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", self._mm, pos)
            pos += 12
            if etype in _NUMPY_TYPES:
                dt = np.dtype(_NUMPY_TYPES[etype])
                arr = np.frombuffer(self._mm, dtype=dt, count=count, offset=pos)
                return arr.tolist(), pos + count * dt.itemsize
            if etype == _STRING:  # vocabularies: 262k strings, so the loop is kept tight
                return self._read_strings(count, pos)
            out = []
            for _ in range(count):
                value, pos = self._read_value(etype, pos)
                out.append(value)
            return out, pos
        fmt = _SCALAR_FORMATS[vtype]
        (value,) = struct.unpack_from(fmt, self._mm, pos)
        if vtype == 6:  # shortest decimal that round-trips the float32 (1e-06, not 9.999999974752427e-07)
            value = float(str(np.float32(value)))
        return value, pos + struct.calcsize(fmt)

    # -- access --------------------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}` from the metadata, e.g. arch_value("block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tensor_float32(self, name: str) -> np.ndarray:
        """Dequantize one tensor to a fresh float32 array shaped like the torch weight."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors[name]
        qtype = GGMLQuantizationType(info.ggml_type)
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        if qtype == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(info.shape).copy()
        if qtype == GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(info.shape).astype(np.float32)
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        out = dequantize(raw.reshape(rows, -1), qtype)
        return np.ascontiguousarray(out.reshape(info.shape), dtype=np.float32)

    def tensor_blocks(self, name: str) -> np.ndarray:
        """A copy of one tensor's bytes as stored, uint8 [rows, bytes per row] (a quantized tensor's blocks)."""
        info = self.tensors[name]
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset).reshape(rows, -1).copy()

    def close(self) -> None:
        self._mm.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
