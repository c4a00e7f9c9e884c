"""One way to print a count: ``7.16M`` parameters, ``115.90M`` FLOPs, ``-`` for a value not measured."""

from __future__ import annotations

__all__ = ["si"]


def si(value: float | None) -> str:
    """``1.22M``-style number: two decimals with a K, M, G or T prefix from a thousand on, four
    significant digits below; ``-`` for None."""
    if value is None:
        return "-"
    if not float(f"{abs(value):.4g}") >= 1e3:  # NaN too
        return f"{value:.4g}"
    for unit, scale in (("K", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12)):
        if float(f"{abs(value) / scale:.2f}") < 1e3 or unit == "T":  # as printed: 999996 is 1.00M, not 1000.00K
            return f"{value / scale:.2f}{unit}"
