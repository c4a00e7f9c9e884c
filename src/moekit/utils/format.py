"""One way to print a count: ``7.16M`` parameters, ``115.90M`` FLOPs, ``-`` for a value not measured."""

from __future__ import annotations

__all__ = ["si", "with_prefix"]

_PREFIXES = (("K", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12), ("P", 1e15))


def with_prefix(value: float, spec: str, largest: str = "T") -> str:
    """``value`` with the smallest SI prefix (``K`` to ``largest``) whose mantissa, formatted with ``spec``, stays
    below 1000 as printed: 999996 with ``.2f`` is ``1.00M``, not ``1000.00K``."""
    for unit, scale in _PREFIXES:
        mantissa = f"{value / scale:{spec}}"
        if abs(float(mantissa)) < 1e3 or unit == largest:
            return mantissa + unit
    raise ValueError(f"largest={largest!r}; allowed: {[unit for unit, _ in _PREFIXES]}")


def si(value: float | None) -> str:
    """``1.22M``-style number: two decimals with a K, M, G or T prefix from a thousand on, four
    significant digits below; ``-`` for None."""
    if value is None:
        return "-"
    if not float(f"{abs(value):.4g}") >= 1e3:  # NaN too
        return f"{value:.4g}"
    return with_prefix(value, ".2f")
