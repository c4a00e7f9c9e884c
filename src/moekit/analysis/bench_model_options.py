"""Checks of the model benchmark's options (:mod:`moekit.analysis.bench_models`): ``--sweep`` and ``--override``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["parse_sweep", "check_overrides_applied"]


def parse_sweep(sweep: str | None) -> tuple[str, list[str]] | None:
    """``"key=v1,v2"`` -> ``("key", ["v1", "v2"])``; None stays None."""
    if sweep is None:
        return None
    key, _, values = sweep.partition("=")
    choices = [v.strip() for v in values.split(",") if v.strip()]
    if not key or not choices:
        raise SystemExit(f"--sweep {sweep!r}: write key=value1,value2 (e.g. moe.slots_per_expert=1,2,4)")
    return key, choices


def check_overrides_applied(group: str, overrides: Sequence[str], applied: Iterable[str]) -> None:
    """Refuse the ``overrides`` that no model of ``group`` applied (a key none of their configs has: a misspelt
    key), which the table's title would otherwise list as if they had run."""
    unused = [o for o in overrides if o not in set(applied)]
    if unused:
        raise SystemExit(f"--override {' '.join(unused)}: no model of group {group!r} has such a key in its config")
