"""Byte sizes and block counts, declared once: parsing "4GiB", printing sizes, whole blocks for n tokens.
Pure Python (no torch)."""

from __future__ import annotations

import re

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# Decimal (k, M, G, T as in "2G") and binary (Ki, Mi, Gi, Ti) units, case-insensitive, an optional trailing b.
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "ki": KiB,
    "kib": KiB,
    "mi": MiB,
    "mib": MiB,
    "gi": GiB,
    "gib": GiB,
    "ti": 1 << 40,
    "tib": 1 << 40,
}
# Largest first: format_bytes picks the first unit the value reaches.
_BINARY_UNITS = (("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks of b tokens that hold a tokens."""
    return -(-a // b)


def parse_size(value: str | int) -> int:
    """Parse a byte size such as 4GiB, 512MiB, 2G or 1048576."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"invalid size {value!r}: expected a number with an optional unit such as 4GiB or 512MiB")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def format_gib(num_bytes: float, decimals: int = 2) -> str:
    """`num_bytes` in GiB with thousands separators, e.g. "1,024.00 GiB"."""
    return f"{num_bytes / GiB:,.{decimals}f} GiB"


def format_bytes(num_bytes: float, spec: str = ",.2f") -> str:
    """The largest binary unit the value reaches, e.g. "1.50 GiB", "512.00 KiB", or whole bytes "900 B";
    `spec` formats the number (".4g" gives "1 GiB", "64 MiB")."""
    for unit, size in _BINARY_UNITS:
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:{spec}} {unit}"
    return f"{int(num_bytes):,} B"
