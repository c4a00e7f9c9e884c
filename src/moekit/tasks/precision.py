"""A task's training step on a random batch, timed in each precision: what ``trainer.precision=auto`` measures on
a CPU whose bf16 speed its flags do not tell (:func:`moekit.utils.machine.resolve_precision`), and what the model
benchmark times."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator, Sequence

import torch
from lightning import LightningDataModule
from torch import Tensor

from .base import MoETask
from .language_model import LanguageModel

__all__ = ["AUTOCAST_DTYPES", "autocast", "forward_backward_seconds", "no_trainer_warnings", "random_batch"]

AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "bf16": torch.bfloat16, "16-mixed": torch.float16}
"""Lightning's mixed precisions and the dtype of their autocast."""


def autocast(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """What Lightning runs a training step under for ``precision``: autocast for a mixed one, else nothing."""
    device = torch.device(device)
    if precision in AUTOCAST_DTYPES:
        return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])
    return contextlib.nullcontext()


@contextlib.contextmanager
def no_trainer_warnings() -> Iterator[None]:
    """``self.log`` without a trainer only warns (and logs nothing): silence that warning alone."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*self\.log\(\).*trainer.*")
        yield


def random_batch(
    task: MoETask, datamodule: LightningDataModule, batch_size: int, device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor]:
    """A batch of the data module's shapes (read from its attributes; no data is loaded): ``(images [B, C, S, S],
    labels [B])``, or ``(input_ids [B, T], targets [B, T])`` for a language model."""
    if isinstance(task, LanguageModel):
        tokens = torch.randint(datamodule.vocab_size, (batch_size, datamodule.seq_len + 1))
        batch = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    else:
        size = datamodule.img_size
        images = torch.randn(batch_size, datamodule.in_chans, size, size)
        batch = images, torch.randint(datamodule.num_classes, (batch_size,))
    return tuple(t.to(device) for t in batch)


def forward_backward_seconds(
    task: MoETask, batch: tuple[Tensor, Tensor], precisions: Sequence[str], rounds: int = 2
) -> dict[str, float]:
    """The fastest of ``rounds`` timings of ``task.training_step`` and its backward under each precision, after
    one untimed step in each; the precisions take turns, so that a slow phase of the machine hits them alike.
    The gradients are dropped after each step (the task's parameters are not updated)."""
    device = next(task.parameters()).device
    seconds: dict[str, list[float]] = {p: [] for p in precisions}
    task.train()
    for timed in [False] + [True] * rounds:
        for precision in precisions:
            start = time.perf_counter()
            with autocast(precision, device), no_trainer_warnings():
                loss = task.training_step(batch, 0)
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if timed:
                seconds[precision].append(time.perf_counter() - start)
            task.zero_grad(set_to_none=True)
    return {p: min(s) for p, s in seconds.items()}
