"""Where MoE layers go in a stack of blocks: shared by the MoE ViTs (:mod:`moekit.models.vit`) and the
Transformer LM (:mod:`moekit.models.transformer_lm`).

Placement (``moe_blocks``), for a model of ``depth`` blocks numbered ``0 .. depth - 1``:

* ``"second_half"``: blocks ``depth // 2 .. depth - 1`` (Soft MoE paper);
* ``"all"``: every block;
* ``"every_<k>"``: every k-th block, counted back from the last one, so the last block is MoE
  (V-MoE's "Every-k"; ``"every_2"`` of 12 blocks is 1, 3, ..., 11);
* ``"last_<n>"``: the last ``n`` blocks;
* ``"every_<k>_last_<n>"``: the last ``n`` blocks of ``"every_<k>"`` (V-MoE's "Last-n" is
  ``"every_2_last_<n>"``: ``"every_2_last_5"`` of 12 blocks is 3, 5, 7, 9, 11);
* a sequence of block indices (negative ones count from the end).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["MoEBlocks", "resolve_moe_blocks"]

MoEBlocks = str | Sequence[int]

_PLACEMENT_FORMS = (
    "'second_half', 'all', 'every_<k>', 'last_<n>', 'every_<k>_last_<n>' (k, n >= 1) or a sequence of block indices"
)
_PLACEMENT_RE = re.compile(r"^(?:every_(?P<every>[1-9]\d*)(?:_last_(?P<last>[1-9]\d*))?|last_(?P<last_only>[1-9]\d*))$")


def _every_k(depth: int, k: int) -> list[int]:
    return [i for i in range(depth) if (depth - 1 - i) % k == 0]


def resolve_moe_blocks(
    moe_blocks: MoEBlocks, depth: int, *, model_name: str = "ViT", setting: str = "moe_blocks", kind: str = "MoE"
) -> tuple[int, ...]:
    """Turn a placement (see the module docstring) into sorted block indices in ``[0, depth)``.

    ``model_name`` names the model in error messages ("a ViT of depth=6 has only ..."), ``setting`` the
    setting and ``kind`` the blocks (``mod.blocks`` places Mixture-of-Depths blocks, ``kind="routed"``).

    Raises ``ValueError`` for an unknown placement string, an index out of range, a duplicate index,
    more MoE blocks than blocks, or a placement that selects no block.
    """
    if isinstance(moe_blocks, str):
        match = _PLACEMENT_RE.match(moe_blocks)
        if moe_blocks == "second_half":
            indices = list(range(depth // 2, depth))
        elif moe_blocks == "all":
            indices = list(range(depth))
        elif match:
            candidates = _every_k(depth, int(match["every"] or 1))
            last = int(match["last"] or match["last_only"] or len(candidates))
            if last > len(candidates):
                raise ValueError(
                    f"{setting}={moe_blocks!r} asks for {last} {kind} blocks but a {model_name} of depth={depth} has "
                    f"only {len(candidates)} such blocks"
                )
            indices = candidates[len(candidates) - last :]
        else:
            raise ValueError(f"{setting}={moe_blocks!r} is not a placement; use {_PLACEMENT_FORMS}")
    else:
        if not isinstance(moe_blocks, Sequence) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in moe_blocks
        ):
            raise ValueError(f"{setting}={moe_blocks!r} is not a placement; use {_PLACEMENT_FORMS}")
        if len(moe_blocks) > depth:
            raise ValueError(f"{setting}={list(moe_blocks)} names {len(moe_blocks)} {kind} blocks but depth={depth}")
        for i in moe_blocks:
            if not -depth <= i < depth:
                raise ValueError(
                    f"{setting} index {i} is out of range for depth={depth} (allowed: {-depth} .. {depth - 1})"
                )
        indices = [i % depth for i in moe_blocks]
        if len(set(indices)) != len(indices):
            raise ValueError(f"{setting}={list(moe_blocks)} names a block twice (indices {indices} modulo depth)")
    if not indices:
        raise ValueError(f"{setting}={moe_blocks!r} selects no block; it must select at least one {kind} block")
    return tuple(sorted(indices))
