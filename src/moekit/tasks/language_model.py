"""Causal language modelling with MoE (or dense) LMs as a LightningModule.

Loss = next-token cross-entropy (nats per token, averaged over all target tokens) + the weighted
auxiliary losses of the MoE layers. A batch ``(inputs, targets, padding_mask)`` (the text data with ``pack=False``)
passes the mask to the network, and its padding targets (:data:`~moekit.data.text.PAD_TARGET`) count nowhere.
Metrics, per split: ``ce``, perplexity ``ppl = exp(ce)`` and bits per byte ``bpb = ce / ln 2 / bytes_per_token``
(the data module's UTF-8 bytes per token of that split, so byte-level and BPE models compare). Evaluation figures
are means over the whole split's real target tokens (torchmetrics, reduced over ranks), taken before the
exponential; training's epoch means weigh each batch by its real target tokens too.

The network config must build a causal LM (:class:`~moekit.models.TransformerLM`,
:class:`~moekit.models.LSTMMoELM`): ``net(input_ids [batch, tokens]) -> logits [batch, tokens, vocab]``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric

from moekit.checkpoint import load_weights, read_state_dict
from moekit.data.text import PAD_TARGET
from moekit.data.tokenizers import build_tokenizer
from moekit.models import fit_hash_routing, upcycle
from moekit.models.hf_import import apply_hf_settings, read_hf_state_dict
from moekit.models.hf_layout import HF_PREFIX

from .base import MoETask, check_trained_architecture, plain, trained_network

__all__ = ["LanguageModel"]

log = logging.getLogger("moekit")


class LanguageModel(MoETask):
    """Language-model training/evaluation.

    Args:
        net: the network config (Hydra ``_target_`` dict), instantiated here.
        vocab_size: the tokenizer's vocabulary (the network's may be larger: padding rows no text uses).
        optimizer: ``{name, lr, weight_decay, betas, eps, decay_1d}``.
        scheduler: :class:`~moekit.tasks.optim.ScheduleConfig` fields.
        compile: ``torch.compile`` the network in place (state-dict keys unchanged).
        init_from: weights to start from: our checkpoint, a safetensors or torch state dict of the same network, or
            ``hf:<folder>``, a transformers model folder of the Mixtral or Qwen2-MoE layout, whose architecture then
            replaces the network config's (:func:`moekit.models.hf_import.apply_hf_settings`; the run keeps its
            ``max_seq_len``, ``dropout`` and MoE loss weights).
        init_mode: ``"finetune"`` (load every weight) or ``"upcycle"`` (a dense twin's checkpoint into this MoE
            network: experts copy the dense MLP of their block, routers start fresh; :func:`moekit.models.upcycle`).
        run_config: the resolved run configuration, stored with the checkpoint and logged.
    """

    def __init__(
        self,
        net: Mapping[str, Any],
        vocab_size: int,
        optimizer: Mapping[str, Any] | None = None,
        scheduler: Mapping[str, Any] | None = None,
        compile: bool = False,
        init_from: str | None = None,
        init_mode: str = "finetune",
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        net, optimizer, scheduler, run_config = map(plain, (net, optimizer, scheduler, run_config))
        if init_mode not in ("finetune", "upcycle"):
            raise ValueError(f"init_mode={init_mode!r}; allowed: 'finetune', 'upcycle'")
        hf_folder = init_from[len(HF_PREFIX) :] if init_from and init_from.startswith(HF_PREFIX) else None
        if hf_folder is not None:
            net = self._hf_architecture(net, hf_folder, vocab_size, init_mode)
        self.save_hyperparameters(
            {
                "net": net,
                "vocab_size": vocab_size,
                "optimizer": optimizer,
                "scheduler": scheduler,
                "compile": compile,
                "init_from": init_from,
                "init_mode": init_mode,
                "run_config": run_config,
            }
        )
        self.setup_training(net, optimizer, scheduler)
        net_vocab = getattr(self.net, "vocab_size", vocab_size)
        if net_vocab < vocab_size:  # more is padding (as transformers models and nanoGPT pad): rows no text uses
            raise ValueError(
                f"the network has vocab_size={net_vocab} but the tokenizer has vocab_size={vocab_size}; "
                "set model.vocab_size to the tokenizer's (data.vocab_size)"
            )
        if hf_folder is not None:
            load_weights(self.net, read_hf_state_dict(hf_folder), source=init_from)
        elif init_from and init_mode == "upcycle":
            upcycle(self.net, read_state_dict(init_from), architecture=trained_network(init_from))
        elif init_from:
            check_trained_architecture(self.net, init_from)
            load_weights(self.net, read_state_dict(init_from), source=init_from)
        if compile:
            self.compile_net()
        # Token-weighted mean cross-entropy of each evaluation split, reduced over ranks.
        self.eval_ce = nn.ModuleDict({split: MeanMetric() for split in ("val", "test")})

    @staticmethod
    def _hf_architecture(net: dict, folder: str, vocab_size: int, init_mode: str) -> dict:
        """``net`` with the architecture of the transformers model in ``folder`` (the changes are logged)."""
        if init_mode != "finetune":
            raise ValueError(
                f"init_mode={init_mode!r} with task.init_from=hf:{folder}: a transformers folder holds an MoE model "
                "already; use init_mode=finetune"
            )
        net, changes = apply_hf_settings(net, folder)
        own = _folder_tokenizer_size(folder)  # its embedding may have more rows than tokens (Qwen's padding)
        if net["vocab_size"] != vocab_size and not (own == vocab_size < net["vocab_size"]):
            raise ValueError(
                f"the transformers model in {folder} has a vocabulary of {net['vocab_size']} tokens but the data's "
                f"tokenizer has {vocab_size}; train with the model's own tokenizer: data.tokenizer.kind=file "
                f"data.tokenizer.path={folder}/tokenizer.json data.vocab_size={own or net['vocab_size']}"
            )
        if net["vocab_size"] > vocab_size:
            log.info(
                "the embedding of %s has %d rows for its tokenizer's %d tokens: the last %d are padding no text uses",
                folder, net["vocab_size"], vocab_size, net["vocab_size"] - vocab_size,
            )  # fmt: skip
        log.info("the architecture of %s replaces the model config:\n  %s", folder, "\n  ".join(changes) or "(same)")
        return net

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        seq_len, max_seq_len = getattr(datamodule, "seq_len", None), getattr(self.net, "max_seq_len", None)
        if seq_len is not None and max_seq_len is not None and seq_len > max_seq_len:
            raise ValueError(
                f"data.seq_len={seq_len} exceeds the model's max_seq_len={max_seq_len}; set data.seq_len <= "
                f"{max_seq_len} or model.max_seq_len >= {seq_len}"
            )
        if stage == "fit":  # hash tables fitted from the training split (a resumed run restores its own)
            train_tokens = getattr(datamodule, "split_tokens", {}).get("train")
            for name in fit_hash_routing(self.net, train_tokens):
                method = self.net.get_submodule(name).router.hash_method
                log.info("fitted the %s hash routing table of %s", method, name)
                if method == "clustered" and not self.hparams.init_from:
                    log.warning(
                        "%s: hash_method=clustered clusters the token embeddings of a model that starts from random "
                        "weights, so its table is random too; start from a trained model (task.init_from=<ckpt>) "
                        "to cluster embeddings that mean something",
                        name,
                    )

    def forward(self, input_ids: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """``input_ids: [batch, tokens]`` -> logits ``[batch, tokens, vocab_size]``; ``padding_mask: [batch, tokens]``
        bool, True for real tokens."""
        return self.net(input_ids) if padding_mask is None else self.net(input_ids, padding_mask=padding_mask)

    def _shared_step(self, batch, split: str) -> Tensor:
        input_ids, targets, *rest = batch
        padding_mask = rest[0] if rest else None
        logits = self(input_ids, padding_mask)
        ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=PAD_TARGET)
        # the means weigh a batch by its real targets (a real input's target may be left out: a prompt's), on the device
        real_targets = (targets != PAD_TARGET).sum()
        ce = ce.where(real_targets > 0, 0.0)  # a batch of no real target: 0 of weight 0, not the NaN of 0 / 0
        if split == "train":
            loss = self.add_aux_losses(split, ce, batch_size=real_targets)
            self.log("train/ppl", ce.detach().exp(), on_step=True, on_epoch=False, prog_bar=True)
        else:  # token-weighted over the split, as ppl and bpb (the count read on the host: evaluation only)
            loss = self.add_aux_losses(split, ce, batch_size=int(real_targets))
            self.eval_ce[split].update(ce.detach(), weight=real_targets)
        return loss

    def _log_eval_metrics(self, split: str) -> None:
        metric = self.eval_ce[split]
        if metric.update_count == 0:
            return
        ce = metric.compute()
        metric.reset()
        self.log(f"{split}/ppl", ce.exp(), prog_bar=True, sync_dist=False)
        bytes_per_token = self._bytes_per_token(split)
        if bytes_per_token:
            self.log(f"{split}/bpb", ce / math.log(2) / bytes_per_token, sync_dist=False)

    def _bytes_per_token(self, split: str) -> float | None:
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        return (getattr(datamodule, "bytes_per_token", None) or {}).get(split)

    def training_step(self, batch, batch_idx: int) -> Tensor:
        return self._shared_step(batch, "train")

    def validation_step(self, batch, batch_idx: int) -> Tensor:
        return self._shared_step(batch, "val")

    def test_step(self, batch, batch_idx: int) -> Tensor:
        return self._shared_step(batch, "test")

    def on_validation_epoch_end(self) -> None:
        self._log_eval_metrics("val")

    def on_test_epoch_end(self) -> None:
        self._log_eval_metrics("test")


def _folder_tokenizer_size(folder: str) -> int | None:
    """The vocabulary of the ``tokenizer.json`` in a transformers folder (None without one)."""
    path = Path(folder) / "tokenizer.json"
    return build_tokenizer(kind="file", path=str(path)).vocab_size if path.is_file() else None
