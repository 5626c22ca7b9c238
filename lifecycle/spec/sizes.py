"""Byte sizes written the way people write them: ``"2GiB"``, ``"512 MB"``, ``1048576``."""

from __future__ import annotations

import re
from decimal import Decimal

from lifecycle.shown import shown

__all__ = ["SIZE_PATTERN", "ByteSize", "format_bytes", "format_sizes"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
MAX_BYTES = 2**63  # 8 EiB: larger is a typo, and would not fit the counters it feeds
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
SIZE_PATTERN = r"^\s*\d+(\.\d+)?\s*([kKmMgGtT][iI]?[bB]|[bB])?\s*$"


class ByteSize(int):
    """A number of bytes, decoded from an int or a string with a unit."""

    @classmethod
    def parse(cls, value: object) -> ByteSize:
        """Return the size ``value`` denotes.

        Raises:
            ValueError: ``value`` is not a non-negative int or a number with a
                unit among B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, or it exceeds 8 EiB.
        """
        count: Decimal | int | None = None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            count = value
        elif isinstance(value, str):
            match = _SIZE.match(value)
            if match and match.group(2).lower() in _UNITS:
                # Decimal, not float: exact, and no overflow however many digits
                count = Decimal(match.group(1)) * _UNITS[match.group(2).lower()]
        if count is None:
            raise ValueError(
                f'Expected a size like "2GiB", "512MB" or a byte count, got {shown(value)}'
            )
        if count > MAX_BYTES:
            raise ValueError(f"Expected a size of at most 8 EiB ({MAX_BYTES} bytes), got more")
        return cls(int(count))

    def __str__(self) -> str:
        return format_bytes(self)


def format_bytes(count: int, digits: int = 1) -> str:
    """Return ``count`` bytes in the largest binary unit that keeps it >= 1."""
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.{digits}f} {unit}"
        size /= 1024
    return f"{size:.{digits}f} TiB"


def format_sizes(*counts: int) -> tuple[str, ...]:
    """Return each of ``counts`` formatted with the fewest digits that keep different sizes apart.

    A message that compares sizes ("needs 242.84 KiB, more than the 242.81 KiB
    budget") must never print two different sizes as the same text; when even
    four digits do not separate them, exact byte counts do.
    """
    distinct = len(set(counts))
    for digits in range(1, 5):
        texts = tuple(format_bytes(count, digits) for count in counts)
        if len(set(texts)) == distinct:
            return texts
    return tuple(f"{int(count)} B" for count in counts)  # a ByteSize prints its unit
