"""One way to print a count: ``7.16M`` parameters, ``115.90M`` FLOPs, ``-`` for a value not measured."""

from __future__ import annotations

__all__ = ["si"]


def si(value: float | None) -> str:
    """``1.22M``-style number: two decimals with a K, M, G or T prefix from a thousand on, four
    significant digits below; ``-`` for None."""
    if value is None:
        return "-"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.4g}"
