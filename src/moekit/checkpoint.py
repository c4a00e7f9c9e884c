"""Reading weights from files users bring: our Lightning checkpoints, safetensors or torch state
dicts (timm exports), with errors that name the file and the mismatched keys."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

__all__ = ["CheckpointError", "read_state_dict", "load_weights", "head_prefixes"]


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or does not fit the model."""


def read_state_dict(path: str | os.PathLike, prefix: str = "net.") -> dict[str, Tensor]:
    """Tensors of a weights file, keyed like the network's own ``state_dict``.

    Accepts a Lightning checkpoint (its ``state_dict``, with the task's ``net.`` prefix removed), a
    ``.safetensors`` file, or a torch-saved state dict (optionally under ``state_dict`` / ``model``).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist (or is not a file); check the path")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # truncated zip, foreign pickle, safetensors header error, ...
        raise CheckpointError(
            f"checkpoint {str(path)!r} could not be read ({type(err).__name__}: {err}). It is corrupt, truncated or "
            "not a PyTorch/safetensors file; use another checkpoint (e.g. an earlier epoch or last.ckpt)."
        ) from None
    if isinstance(state, Mapping) and "state_dict" in state:
        state = state["state_dict"]
    elif isinstance(state, Mapping) and "model" in state and isinstance(state["model"], Mapping):
        state = state["model"]
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"checkpoint {str(path)!r} holds no state dict of tensors (found {type(state).__name__})")
    if prefix and any(k.startswith(prefix) for k in state):
        state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    return dict(state)


def load_weights(
    net: nn.Module,
    state: Mapping[str, Tensor],
    source: str,
    skip_prefixes: tuple[str, ...] = (),
) -> list[str]:
    """Copy ``state`` into ``net``. Keys under ``skip_prefixes`` (a classifier head being replaced)
    are left at their fresh values; any other missing, unexpected or mis-shaped key is an error that
    lists the keys. Returns the names of the skipped parameters."""
    own = net.state_dict()
    skipped = [k for k in own if k.startswith(skip_prefixes)] if skip_prefixes else []
    wanted = {k for k in own if k not in skipped}
    given = {k for k in state if not (skip_prefixes and k.startswith(skip_prefixes))}
    missing = sorted(wanted - given)
    unexpected = sorted(given - wanted)
    mismatched = sorted(
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in wanted & given
        if state[k].shape != own[k].shape
    )
    if missing or unexpected or mismatched:
        parts = []
        for title, keys in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched)):
            if keys:
                shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
                parts.append(f"{title}: {shown}")
        raise CheckpointError(
            f"checkpoint {source!r} does not fit this model ({type(net).__name__}) - " + "; ".join(parts) + ". "
            "Build the model with the configuration the checkpoint was trained with, or fine-tune with a new head "
            "(the head is then skipped)."
        )
    net.load_state_dict({k: state[k] for k in wanted}, strict=False)
    return skipped


def head_prefixes(net: nn.Module) -> tuple[str, ...]:
    """Prefixes of the classifier parameters (timm's ``pretrained_cfg['classifier']``, else ``head``)."""
    cfg: dict | None = getattr(net, "pretrained_cfg", None) or getattr(net, "default_cfg", None)
    classifier = (cfg or {}).get("classifier", "head")
    names = classifier if isinstance(classifier, (list, tuple)) else [classifier]
    return tuple(f"{n}." for n in names)
