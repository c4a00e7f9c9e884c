"""Bad input, everywhere: a table of mistakes a user makes, each run through the real scripts.

Every case must stop with exit status 1 (or, run in-process, a user error the scripts turn into exit
status 1), a message that names the bad value and says what to do, no Python traceback, and no
damage: the input files (checkpoints, datasets) and an earlier run's checkpoints and logs keep their
bytes, and the checkpoints still load.

Most cases run ``scripts/*.py`` in a subprocess; they are started together, a few at a time, when the
module's first test asks for them (importing torch and Lightning takes most of each one's time).
Cases where the command line adds nothing to what is checked run in-process on the composed config.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import subprocess
import textwrap
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from conftest import REPO, compose_config, run_script
from moekit.checkpoint import load_task
from moekit.cli import user_message
from moekit.commands.evaluate import evaluate
from moekit.commands.export import export
from moekit.commands.quantize import quantize
from moekit.commands.sample import sample
from moekit.commands.train import train
from moekit.data.fashion_mnist import write_fake_fashion_mnist
from moekit.errors import USER_ERRORS
from moekit.utils.atomic import atomic_write

pytestmark = pytest.mark.e2e  # fits models in subprocesses (make test-fast leaves it out)

TINY = ["data.val_size=64", "debug=tiny"]
FAST = [*TINY, "trainer.fast_dev_run=true"]
# A short real run (fast_dev_run writes no checkpoint): one epoch of 2 batches.
SHORT = [*TINY, "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"]
IMAGEFOLDER = [
    "data=imagefolder",
    "data.root={img}",
    "data.num_classes=3",
    "data.img_size=28",
    "data.augment=none",
    "data.auto_augment=null",
    "data.pin_memory=false",
]
CLI_WORKERS = max(2, min(4, os.cpu_count() or 2))

# A wrapper around scripts/train.py whose every torch.save writes a few bytes, then fails like a
# full disk: the checkpoint write dies half-way.
DISK_FULL_WRAPPER = textwrap.dedent(
    """
    import errno, os, runpy, sys
    import torch

    def full_disk_save(obj, f, *args, **kwargs):
        if hasattr(f, "write"):
            f.write(b"the first bytes of a checkpoint")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    torch.save = full_disk_save
    script = {script!r}
    sys.argv = [script, *sys.argv[1:]]
    runpy.run_path(script, run_name="__main__")
    """
)


@dataclass(frozen=True)
class Case:
    """One bad input. ``args`` may hold ``{name}`` placeholders for the paths of :func:`inputs`.

    ``cli``: run the script in a subprocess (else call its function in-process); ``hydra``: the
    message is Hydra's own (config composition fails before our code runs); ``expect``: substrings
    the message must hold, the bad value first, then the fix; ``keeps``: input files whose bytes must
    not change, besides the earlier run's checkpoints and logs.
    """

    id: str
    script: str
    args: list[str]
    expect: list[str]
    cli: bool = True
    hydra: bool = False
    keeps: list[str] = field(default_factory=list)
    root_skip: str = ""

    def __str__(self) -> str:
        return self.id


CASES = [
    # -- unknown config keys and groups (Hydra's own messages: they name the key and the options) --
    Case(
        "key_typo",
        "train.py",
        ["trainer.max_epoch=3"],
        ["trainer.max_epoch is not a setting of this config", "did you mean trainer.max_epochs?"],
    ),
    Case(
        "key_typo_without_a_close_match",
        "eval.py",
        ["ckpt_path=x.ckpt", "hydra.run.dir={tmp}/eval_run", "trainer.zzz=1"],
        ["trainer.zzz is not a setting of this config; check its spelling", "a new key needs a leading +"],
    ),
    Case(
        "unknown_model",
        "train.py",
        ["model=nonexistent"],
        ["model/nonexistent", "Available options in 'model'", "transformer_lm"],
        hydra=True,
    ),
    Case(
        "unknown_launcher",
        "train.py",
        ["-m", "hydra/launcher=submitit_slurmm"],
        ["hydra/launcher/submitit_slurmm", "Available options in 'hydra/launcher'", "submitit_slurm"],
        hydra=True,
    ),
    Case(
        "unknown_sweeper",
        "train.py",
        ["-m", "hparams_search=soft_moe_optuan"],
        ["hparams_search/soft_moe_optuan", "Available options in 'hparams_search'", "soft_moe_optuna"],
        hydra=True,
    ),
    Case(
        "unknown_experiment",
        "train.py",
        ["experiment=soft_moe_vitt"],
        ["experiment/soft_moe_vitt", "Available options in 'experiment'", "soft_moe_vit"],
        hydra=True,
    ),
    Case(
        "unknown_experiment_nope",
        "eval.py",
        ["experiment=nope", "ckpt_path={ckpt}"],
        ["experiment=nope", "+experiment=nope"],
        hydra=True,
    ),
    Case(
        "added_key_typo",
        "train.py",
        [*FAST, "data.root={fm}", "+trainer.max_epoch=3"],
        ["trainer.max_epoch", "did you mean trainer.max_epochs"],
        cli=False,
    ),
    Case(
        "unknown_moe_recipe",
        "train.py",
        ["moe=swich"],
        ["moe/swich", "Available options in 'moe'", "switch"],
        hydra=True,
    ),
    Case(
        "added_key_nothing_reads",
        "train.py",
        [*FAST, "data.root={fm}", "+foo=1"],
        ["'+foo=1' adds foo, which nothing in the run reads", "remove it"],
    ),
    Case(
        "added_callback_entry",
        "train.py",
        [*FAST, "data.root={fm}", "+callbacks.foo=1"],
        ["callbacks.foo=1 is not a callbacks config", "a mapping with a _target_"],
    ),
    Case(
        "added_data_key_typo",
        "train.py",
        [*FAST, "data.root={fm}", "+data.batchsize=4"],
        [
            "data.batchsize is not an argument of moekit.data.ImageClassificationDataModule",
            "did you mean data.batch_size",
        ],
        cli=False,
    ),
    Case(
        "added_logger_key_typo",
        "train.py",
        [*FAST, "data.root={fm}", "+logger.csv.versionn=1"],
        ["logger.csv.versionn is not an argument of moekit.loggers.ResumableCSVLogger", "did you mean"],
        cli=False,
    ),
    Case(
        "added_vit_key_typo",
        "train.py",
        [*FAST, "data.root={fm}", "+model.embed_dimm=16"],
        ["embed_dimm is not a VisionTransformer keyword", "did you mean embed_dim"],
        cli=False,
    ),
    Case(
        "added_lm_key_typo",
        "train.py",
        ["experiment=moe_transformer_lm", "debug=fdr", "+model.dimm=32"],
        ["model.dimm is not an argument of moekit.models.TransformerLM", "did you mean model.dim"],
        cli=False,
    ),
    Case(
        "hash_recipe_in_a_vit",
        "train.py",
        ["experiment=soft_moe_vit", "moe=hash"],
        ["recipe 'hash' routes each token by its token id", "hash routing serves the language models"],
    ),
    Case(
        "token_mixing_recipe_in_an_lm",
        "train.py",
        ["experiment=moe_transformer_lm", "moe=experts_choice"],
        ["recipe 'experts_choice'", "would see the future", "use a per-token router: moe=mixtral"],
    ),
    Case(
        "expert_parallel_lory",
        "train.py",
        ["experiment=moe_transformer_lm", "moe=lory", "trainer=ddp", "trainer.strategy.expert_parallel_size=2"],
        ["recipe 'lory' merges all of a layer's experts", "set trainer.strategy.expert_parallel_size=1"],
    ),
    Case(
        "mod_in_the_lstm_lm",
        "train.py",
        ["experiment=moe_lstm_lm", "mod=interleaved"],
        ["mod=interleaved routes tokens around Transformer blocks", "use mod=none with this model"],
    ),
    Case(
        "mod_capacity_zero",
        "train.py",
        ["experiment=mod_transformer_lm", "mod.capacity=0"],
        ["capacity=0 must be a fraction in (0, 1]", "e.g. 0.125"],
    ),
    Case(
        "mod_capacity_above_one",
        "train.py",
        ["experiment=soft_moe_vit", "mod=interleaved", "mod.capacity=1.5"],
        ["capacity=1.5 must be a fraction in (0, 1]", "1 processes every token"],
    ),
    # -- numbers out of range, refused before torch is imported --
    Case("lr_infinite", "train.py", ["task.optimizer.lr=inf"], ["task.optimizer.lr=inf must be a finite number > 0"]),
    Case("lr_not_a_number", "train.py", ["task.optimizer.lr=fast"], ["task.optimizer.lr='fast'", "e.g. 1e-3"]),
    Case(
        "weight_decay_negative",
        "train.py",
        ["task.optimizer.weight_decay=-0.1"],
        ["task.optimizer.weight_decay=-0.1 must be a finite number >= 0", "0 turns it off"],
    ),
    Case(
        "warmup_negative",
        "train.py",
        ["task.scheduler.warmup_steps=-5"],
        ["task.scheduler.warmup_steps=-5", "or 0 for no warm-up"],
    ),
    Case(
        "gradient_clip_negative",
        "train.py",
        ["trainer.gradient_clip_val=-1"],
        ["trainer.gradient_clip_val=-1", "turns clipping off"],
    ),
    Case(
        "accumulate_zero",
        "train.py",
        ["trainer.accumulate_grad_batches=0"],
        ["trainer.accumulate_grad_batches=0 must be a positive int"],
    ),
    Case(
        "step_checkpoint_negative",
        "train.py",
        ["callbacks.last_checkpoint_steps.every_n_train_steps=-1"],
        ["every_n_train_steps=-1", "0 turns the step checkpoints off"],
    ),
    Case("seed_negative", "train.py", ["seed=-1"], ["seed=-1 must be a whole number in [0, 2**32)", "seed=42"]),
    Case(
        "vit_with_text_data",
        "train.py",
        ["experiment=soft_moe_vit", "data=pydoc_text"],
        ["model=vit (images), data=pydoc_text (text)", "experiment=moe_transformer_lm for text"],
    ),
    Case(
        "language_model_with_the_classification_task",
        "train.py",
        ["experiment=moe_transformer_lm", "task=classification"],
        ["task=classification (images) do not go together", "experiment=soft_moe_vit for images"],
    ),
    Case(
        "strategy_setting_without_a_parallel_trainer",
        "train.py",
        ["experiment=moe_transformer_lm", "+trainer.strategy.expert_parallel_size=2"],
        ["trainer.strategy has settings (expert_parallel_size)", "trainer=ddp or trainer=fsdp"],
    ),
    Case("label_smoothing_one", "train.py", ["task.label_smoothing=1.0"], ["task.label_smoothing=1.0", "[0, 1)"]),
    Case("drop_path_above_one", "train.py", ["+model.drop_path_rate=1.5"], ["model.drop_path_rate=1.5", "[0, 1)"]),
    Case(
        "width_not_divisible_by_heads",
        "train.py",
        ["experiment=moe_transformer_lm", "model.dim=100", "model.num_heads=3"],
        ["model.dim=100 is not divisible by model.num_heads=3", "for 100: 1, 2, 4, 5, 10"],
    ),
    # -- wrong types and values --
    Case(
        "max_epochs_not_int",
        "train.py",
        [*FAST, "data.root={fm}", "trainer.max_epochs=abc"],
        ["trainer.max_epochs='abc' must be a whole number >= 0, -1 for no limit, or null"],
    ),
    Case(
        "max_epochs_negative",
        "train.py",
        [*FAST, "data.root={fm}", "trainer.max_epochs=-3"],
        ["trainer.max_epochs=-3 must be a whole number >= 0, -1 for no limit"],
    ),
    Case(
        "precision_unknown",
        "train.py",
        [*FAST, "data.root={fm}", "trainer.precision=fp8"],
        ["trainer.precision='fp8' must be one of auto, 32-true, bf16-mixed"],
    ),
    Case(
        "kernel_choices_not_name_value",
        "train.py",
        [*FAST, "data.root={fm}", "kernel_choices=[ROW_BLOCK]"],
        ["kernel_choices=['ROW_BLOCK'] must be a list of NAME=VALUE strings", "kernel_choices=['ROW_BLOCK=128']"],
    ),
    Case(
        "kernel_choice_out_of_range",
        "train.py",
        [*FAST, "data.root={fm}", "kernel_choices=['ROW_BLOCK=0']"],
        ["kernel_choices: ROW_BLOCK='0': takes a positive int"],
        cli=False,
    ),
    Case(
        "batch_size_negative",
        "train.py",
        [*FAST, "data.root={fm}", "data.batch_size=-1"],
        ["batch_size=-1", "must be a positive integer"],
    ),
    Case(
        "num_experts_zero",
        "train.py",
        [*FAST, "data.root={fm}", "moe.num_experts=0"],
        ["moe.num_experts=0 must be a positive int"],
    ),
    Case(
        "num_experts_not_int",
        "train.py",
        [*FAST, "data.root={fm}", "moe.num_experts=abc"],
        ["moe.num_experts='abc' must be a positive int"],
    ),
    # -- impossible MoE settings --
    Case(
        "slots_per_expert_zero",
        "train.py",
        [*FAST, "data.root={fm}", "moe.slots_per_expert=0", "moe.capacity_factor=null"],
        ["moe.slots_per_expert=0 must be a positive int or null"],
    ),
    Case(
        "top_k_above_experts",
        "train.py",
        [*FAST, "data.root={fm}", "experiment=tokens_choice_vit", "moe.top_k=9"],
        ["moe.top_k=9 is more than moe.num_experts=8", "use moe.top_k <= 8"],
    ),
    Case(
        "capacity_factor_negative",
        "train.py",
        [*FAST, "data.root={fm}", "moe=switch", "moe.capacity_factor=-1"],
        ["moe.capacity_factor=-1 must be a number > 0 or null", "no capacity limit"],
    ),
    Case(
        "moe_block_out_of_range",
        "train.py",
        [*FAST, "data.root={fm}", "model.moe_blocks=[7]"],
        ["moe_blocks index 7", "allowed: -2 .. 1"],
        cli=False,
    ),
    Case(
        "moe_setting_the_layer_lacks",
        "train.py",
        [*FAST, "data.root={fm}", "+moe.top_k=2"],
        ["recipe 'soft_moe' sets ['top_k'], which SoftMoE does not take", "its settings:"],
        cli=False,
    ),
    # -- missing or corrupt data --
    Case(
        "fashion_gz_truncated",
        "train.py",
        [*FAST, "data.root={fm_truncated}"],
        ["{fm_truncated}/train-images-idx3-ubyte.gz", "fetch it again"],
        keeps=["fm_truncated"],
    ),
    Case(
        "fashion_file_missing",
        "train.py",
        [*FAST, "data.root={fm_missing}"],
        ["t10k-labels-idx1-ubyte", "Put the 4 IDX files there"],
        cli=False,
        keeps=["fm_missing"],
    ),
    Case(
        "image_unreadable_in_worker",
        "train.py",
        [*FAST, *IMAGEFOLDER, "data.batch_size=16", "data.num_workers=1"],
        ["{img}/train/class1/bad.png", "delete, replace or move the file"],
        keeps=["img"],
    ),
    Case(
        "text_corpus_empty",
        "train.py",
        ["experiment=moe_transformer_lm", "data=text_files", "data.paths=[{empty_txt}]"],
        ["{empty_txt}"],
        keeps=["empty_txt"],
    ),
    # -- corrupt, truncated, foreign checkpoints --
    Case(
        "eval_checkpoint_missing",
        "eval.py",
        ["ckpt_path=/nonexistent.ckpt"],
        ["ckpt_path='/nonexistent.ckpt' does not exist", "give the path of a .ckpt file"],
    ),
    Case(
        "eval_checkpoint_random_bytes",
        "eval.py",
        ["ckpt_path={random_ckpt}"],
        ["ckpt_path='{random_ckpt}'", "Pass a .ckpt written by scripts/train.py"],
        keeps=["random_ckpt"],
    ),
    Case(
        "eval_checkpoint_truncated",
        "eval.py",
        ["ckpt_path={truncated_ckpt}"],
        ["ckpt_path='{truncated_ckpt}'", "Pass a .ckpt written by scripts/train.py"],
        cli=False,
        keeps=["truncated_ckpt"],
    ),
    Case(
        "eval_checkpoint_plain_dict",
        "eval.py",
        ["ckpt_path={plain_ckpt}"],
        ["ckpt_path='{plain_ckpt}'", "hyper_parameters", "Pass a .ckpt written by scripts/train.py"],
        cli=False,
        keeps=["plain_ckpt"],
    ),
    Case(
        "eval_on_foreign_data",
        "eval.py",
        ["ckpt_path={ckpt}", *IMAGEFOLDER, "data.num_workers=0"],
        ["num_classes=3", "trained with num_classes=10", "leave data unset"],
    ),
    Case(
        "eval_a_classifier_on_text_data",
        "eval.py",
        ["ckpt_path={ckpt}", "data=pydoc_text"],
        ["data=pydoc_text holds text", "holds a model of images (ImageClassifier)", "leave data unset"],
    ),
    Case(
        "export_checkpoint_truncated",
        "export.py",
        ["ckpt_path={truncated_ckpt}", "output_path={tmp}/out.safetensors"],
        ["ckpt_path='{truncated_ckpt}'", "Pass a .ckpt written by scripts/train.py"],
        keeps=["truncated_ckpt"],
    ),
    Case(
        "sample_from_a_classifier",
        "sample.py",
        ["ckpt_path={ckpt}"],
        ["holds a model of type ImageClassifier", "language-model experiment"],
    ),
    Case(
        "sample_checkpoint_random_bytes",
        "sample.py",
        ["ckpt_path={random_ckpt}"],
        ["ckpt_path='{random_ckpt}'", "Pass a .ckpt written by scripts/train.py"],
        cli=False,
        keeps=["random_ckpt"],
    ),
    Case(
        "resume_checkpoint_truncated",
        "train.py",
        [*FAST, "data.root={fm}", "ckpt_path={truncated_ckpt}"],
        ["ckpt_path='{truncated_ckpt}' could not be read", "resume from another checkpoint"],
        keeps=["truncated_ckpt"],
    ),
    Case(
        "resume_checkpoint_plain_dict",
        "train.py",
        [*FAST, "data.root={fm}", "ckpt_path={plain_ckpt}"],
        ["ckpt_path='{plain_ckpt}' is not a Lightning training checkpoint", "task.init_from"],
        cli=False,
        keeps=["plain_ckpt"],
    ),
    Case(
        "resume_checkpoint_of_another_model",
        "train.py",
        [*FAST, "data.root={fm}", "model.embed_dim=48", "ckpt_path={ckpt}"],
        ["{ckpt}", "model.embed_dim=48 (the checkpoint's: 32)", "Drop these overrides to resume", "task.init_from="],
        cli=False,
    ),
    Case(  # the same shapes, another model: refused as well, not trained on silently
        "resume_with_another_router_setting",
        "train.py",
        [*FAST, "data.root={fm}", "+moe.noise_std=0.5", "ckpt_path={ckpt}"],
        ["whose model was built with other settings", "moe.noise_std=0.5 (the checkpoint's: None)", "task.init_from="],
        cli=False,
    ),
    Case(
        "resume_with_a_setting_the_checkpoint_overrides",
        "train.py",
        [*FAST, "data.root={fm}", "task.optimizer.lr=0.5", "ckpt_path={ckpt}"],
        ["task.optimizer.lr=0.5 (the checkpoint's:", "learning rate", "task.init_from="],
        cli=False,
    ),
    Case(  # the resumed weights would replace the ones init_from loads
        "resume_with_init_from_another_checkpoint",
        "train.py",
        [*FAST, "data.root={fm}", "task.init_from={ckpt}", "ckpt_path={ckpt}"],
        ["task.init_from={ckpt} (the checkpoint's: None)", "replaced by the checkpoint's", "without ckpt_path"],
        cli=False,
    ),
    Case(
        "experts_that_cannot_fit_in_memory",
        "train.py",
        [*FAST, "data.root={fm}", "moe=switch", "moe.num_experts=4000000"],
        ["num_experts=4000000", "GiB for the weights alone", "are available on cpu", "use fewer experts"],
        cli=False,
    ),
    Case(
        "eval_without_a_checkpoint", "eval.py", [], ["ckpt_path must be given", "ckpt_path=<run>/checkpoints/last.ckpt"]
    ),
    Case("export_without_a_checkpoint", "export.py", [], ["ckpt_path must be given"]),
    Case(
        "imagenet_experiment_without_its_folder",
        "train.py",
        ["experiment=soft_moe_vit_s16_imagenet"],
        ["data.root must be given", "add data.root=<value> to the command"],
    ),
    Case(
        "unquoted_non_ascii_path",
        "train.py",
        ["data.root=/tmp/données/fm"],
        ["data.root=/tmp/données/fm: Hydra reads non-ASCII characters", "'data.root=\"/tmp/données/fm\"'"],
    ),
    # -- outputs that cannot be written --
    Case(
        "output_dir_under_a_file",
        "train.py",
        [*FAST, "data.root={fm}", "paths.output_dir={blocker}/sub"],
        ["paths.output_dir='{blocker}/sub'", "set paths.output_dir to a folder you can write to"],
        keeps=["blocker"],
    ),
    Case(
        "output_dir_read_only",
        "train.py",
        [*FAST, "data.root={fm}", "paths.output_dir={read_only}/sub"],
        ["paths.output_dir='{read_only}/sub'", "Permission denied", "folder you can write to"],
        cli=False,
        root_skip="root writes into a chmod 555 folder",
    ),
    Case(
        "log_dir_under_a_file",
        "train.py",
        [*FAST, "data.root={fm}", "paths.log_dir={blocker}/logs"],
        ["{blocker}/logs", "set paths.log_dir to a folder you can write to"],
        keeps=["blocker"],
    ),
    Case(
        "export_output_under_a_file",
        "export.py",
        ["ckpt_path={ckpt}", "output_path={blocker}/model.safetensors"],
        ["'{blocker}'", "folder you can write to"],
        keeps=["blocker"],
    ),
    Case(
        "export_an_unknown_format",
        "export.py",
        ["ckpt_path={ckpt}", "format=onnx"],
        ["format='onnx'", "allowed: safetensors, hf"],
        cli=False,
    ),
    Case(
        "export_a_vit_to_transformers",
        "export.py",
        ["ckpt_path={ckpt}", "format=hf", "output_path={tmp}/hf"],
        ["VisionTransformer has no transformers layout", "only the Transformer LM"],
        cli=False,
    ),
    Case(
        "init_from_a_folder_that_is_no_transformers_model",
        "train.py",
        [*FAST, "data.root={fm}", "task.init_from=hf:{fm}"],
        ["task.init_from=hf:{fm}", "has no config.json", "transformers model folder"],
    ),
    # -- quantization --
    Case(
        "quantize_unsupported_bits",
        "quantize.py",
        ["ckpt_path={ckpt}", "bits=3"],
        ["bits=3", "8, 4, 2 or ternary", "bits=4"],
    ),
    Case(
        "quantize_unknown_method",
        "quantize.py",
        ["ckpt_path={ckpt}", "method=awq"],
        ["method='awq'", "rtn or gptq"],
    ),
    Case(
        "quantize_no_calibration_batches",
        "quantize.py",
        ["ckpt_path={ckpt}", "calibration_batches=0"],
        ["calibration_batches=0", "positive int", "e.g. 32"],
    ),
    Case(
        "quantize_no_calibration_rows",
        "quantize.py",
        ["ckpt_path={ckpt}", "min_rows=0"],
        ["min_rows=0", "a positive int or null", "the matrix's input size"],
    ),
    Case(
        "quantize_too_few_calibration_rows",
        "quantize.py",
        ["ckpt_path={ckpt}", "calibration_batches=1", "min_rows=100000", "output_path={tmp}/q.safetensors"],
        ["calibration_batches=1 is too few", "fewer than the 100000 GPTQ needs", "method=rtn"],
        cli=False,
    ),
    Case(
        "quantize_more_calibration_batches_than_the_split",
        "quantize.py",
        ["ckpt_path={ckpt}", "calibration_batches=1000", "output_path={tmp}/q.safetensors"],
        ["calibration_batches=1000", "has only", "lower calibration_batches"],
        cli=False,
    ),
    Case(
        "quantize_a_dense_checkpoint",
        "quantize.py",
        ["ckpt_path={dense_ckpt}", "output_path={tmp}/q.safetensors"],
        ["ckpt_path='{dense_ckpt}'", "without MoE layers", "checkpoint of an MoE experiment"],
        cli=False,
        keeps=["dense_ckpt"],
    ),
    Case(
        "export_a_quantized_checkpoint",
        "export.py",
        ["ckpt_path={quantized}", "output_path={tmp}/out.safetensors"],
        ["ckpt_path='{quantized}'", "quantized checkpoint", "export the training checkpoint (.ckpt)"],
        cli=False,
        keeps=["quantized"],
    ),
    Case(
        "finetune_from_a_quantized_checkpoint",
        "train.py",
        [*FAST, "data.root={fm}", "task.init_from={quantized}"],
        ["'{quantized}'", "quantized experts", "float training checkpoint"],
        cli=False,
        keeps=["quantized"],
    ),
    Case(
        "eval_safetensors_that_is_not_quantized",
        "eval.py",
        ["ckpt_path={plain_safetensors}"],
        ["ckpt_path='{plain_safetensors}'", "not a quantized moekit checkpoint", "scripts/quantize.py"],
        cli=False,
        keeps=["plain_safetensors"],
    ),
]
CASE_IDS = [case.id for case in CASES]
FUNCTIONS: dict[str, Callable] = {
    "train.py": train,
    "eval.py": evaluate,
    "export.py": export,
    "sample.py": sample,
    "quantize.py": quantize,
}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree_hashes(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``root`` (or of ``root`` itself)."""
    if root.is_file():
        return {root.name: _sha256(root)}
    return {str(p.relative_to(root)): _sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


def _image_folder(root: Path) -> Path:
    """3 classes x 2 good images per split, and one file in train/class1 that is no image."""
    from PIL import Image

    for split in ("train", "val"):
        for label in range(3):
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(2):
                Image.new("RGB", (32, 32), color=(80 * label, 10 * i, 50)).save(folder / f"{i}.png")
    (root / "train" / "class1" / "bad.png").write_bytes(b"\x89PNG but then garbage " * 20)
    return root


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """The bad (and good) inputs the table refers to by name."""
    tmp = tmp_path_factory.mktemp("bad_input")
    fm = write_fake_fashion_mnist(tmp / "fm", n_train=320, n_test=64)
    fm_truncated = Path(shutil.copytree(fm, tmp / "fm_truncated"))
    gz = fm_truncated / "train-images-idx3-ubyte.gz"
    gz.write_bytes(gz.read_bytes()[: gz.stat().st_size // 2])
    fm_missing = Path(shutil.copytree(fm, tmp / "fm_missing"))
    (fm_missing / "t10k-labels-idx1-ubyte.gz").unlink()

    # An earlier, good run: its checkpoints and logs must survive every case.
    good = tmp / "good_run"
    train(compose_config("train", [*SHORT, f"data.root={fm}", "trainer.max_epochs=1"], good))
    ckpt = good / "checkpoints" / "last.ckpt"
    assert ckpt.is_file() and (good / "csv" / "metrics.csv").is_file()

    dense = tmp / "dense_run"
    train(compose_config("train", [*SHORT, f"data.root={fm}", "trainer.max_epochs=1", "moe=none"], dense))
    quantized = tmp / "q8.safetensors"
    quantize(compose_config("quantize", [f"ckpt_path={ckpt}", "bits=8", "method=rtn", f"output_path={quantized}"], tmp))
    plain_safetensors = tmp / "plain.safetensors"
    save_file({"weight": torch.zeros(2)}, str(plain_safetensors))

    random_ckpt = tmp / "random.ckpt"
    random_ckpt.write_bytes(
        torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0)).byte().numpy().tobytes()
    )
    truncated_ckpt = tmp / "truncated.ckpt"
    truncated_ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    plain_ckpt = tmp / "plain.ckpt"
    torch.save({"weights": [1.0, 2.0], "note": "not a training checkpoint"}, plain_ckpt)
    empty_txt = tmp / "empty.txt"
    empty_txt.write_text("")
    blocker = tmp / "blocker"
    blocker.write_text("a regular file where a folder is expected\n")
    read_only = tmp / "read_only"
    read_only.mkdir()
    read_only.chmod(0o555)
    paths = dict(
        tmp=tmp,
        fm=fm,
        fm_truncated=fm_truncated,
        fm_missing=fm_missing,
        img=_image_folder(tmp / "img"),
        good=good,
        ckpt=ckpt,
        dense_ckpt=dense / "checkpoints" / "last.ckpt",
        plain_safetensors=plain_safetensors,
        quantized=quantized,
        random_ckpt=random_ckpt,
        truncated_ckpt=truncated_ckpt,
        plain_ckpt=plain_ckpt,
        empty_txt=empty_txt,
        blocker=blocker,
        read_only=read_only,
    )
    yield paths
    read_only.chmod(0o755)


def _fill(text: str, paths: dict[str, Path]) -> str:
    return text.format(**{k: str(v) for k, v in paths.items()})


def _run_cli(case: Case, paths: dict[str, Path]) -> subprocess.CompletedProcess:
    args = [_fill(a, paths) for a in case.args]
    if not any(a.startswith("paths.log_dir=") for a in args):
        # Its own folder: two runs started in the same second never share a run folder.
        args.append(f"paths.log_dir={paths['tmp'] / 'logs' / case.id}")
    return run_script(case.script, *args, cwd=REPO)


@pytest.fixture(scope="module")
def cli_results(request, inputs) -> Callable[[Case], subprocess.CompletedProcess]:
    """The result of a subprocess case, each run once. Alone, pytest starts every case the session selected,
    ``CLI_WORKERS`` at a time; a pytest-xdist worker collects every test but runs only its share, so there a case
    starts when its test asks (starting them all ran every case on every worker: twice the work on 2 workers)."""
    spread = "PYTEST_XDIST_WORKER" in os.environ
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # one thread a process: no oversubscription
        executor = ThreadPoolExecutor(max_workers=1 if spread else CLI_WORKERS)
        futures: dict[str, Future] = {}
        if not spread:
            selected = {
                item.callspec.params["case"].id
                for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec") and "case" in item.callspec.params
            }
            futures = {c.id: executor.submit(_run_cli, c, inputs) for c in CASES if c.cli and c.id in selected}

        def result(case: Case) -> subprocess.CompletedProcess:
            if case.id not in futures:
                futures[case.id] = executor.submit(_run_cli, case, inputs)
            return futures[case.id].result()

        yield result
        executor.shutdown(cancel_futures=True)


@pytest.fixture(scope="module")
def earlier_run(inputs) -> dict[str, str]:
    """The hashes of the earlier run's checkpoints and logs before any case ran."""
    return _tree_hashes(inputs["good"])


def _assert_intact(case: Case, paths: dict[str, Path], earlier_run: dict[str, str], kept: dict[str, dict]) -> None:
    assert _tree_hashes(paths["good"]) == earlier_run, "the earlier run's checkpoints or logs changed"
    for name, hashes in kept.items():
        assert _tree_hashes(paths[name]) == hashes, f"{case.id} changed its input {name}"


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_bad_input_stops_with_one_clear_paragraph(case, inputs, cli_results, earlier_run, tmp_path):
    if case.root_skip and os.geteuid() == 0:
        pytest.skip(f"running as root: {case.root_skip} (the <file>/sub cases cover root)")
    kept = {name: _tree_hashes(inputs[name]) for name in case.keeps}
    paths = {**inputs, "tmp": tmp_path}
    if case.cli:
        result = cli_results(case)
        output = result.stdout + result.stderr
        assert result.returncode == 1, f"exit status {result.returncode}:\n{output[-3000:]}"
        if not case.hydra:
            errors = [line for line in output.splitlines() if "[moekit][ERROR]" in line or "[HYDRA] cannot" in line]
            assert len(errors) == 1, f"expected one error paragraph:\n{output[-3000:]}"
            message = errors[0]
        else:
            message = output
    else:
        overrides = [_fill(a, paths) for a in case.args]
        config = case.script.removesuffix(".py")
        cfg = compose_config(config, [*overrides, f"paths.log_dir={tmp_path / 'logs'}"], tmp_path / "out")
        with pytest.raises(USER_ERRORS) as info:
            FUNCTIONS[case.script](cfg)
        message = user_message(info.value)
        output = message
        assert "\n\n" not in message.strip(), "one paragraph"
    assert "Traceback" not in output
    for expected in case.expect:
        assert _fill(expected, paths) in message, f"{expected!r} missing from:\n{message}"
    _assert_intact(case, inputs, earlier_run, kept)


def test_the_table_covers_every_script_and_runs_most_cases_through_the_cli():
    assert len(CASES) >= 20 and len(set(CASE_IDS)) == len(CASES)
    assert {case.script for case in CASES} == set(FUNCTIONS)
    assert sum(case.cli for case in CASES) > len(CASES) / 2


def test_a_full_disk_during_a_checkpoint_write_keeps_the_last_checkpoint(inputs, tmp_path):
    """Resume a run whose checkpoint writes all fail like a full disk: exit status 1, one line that
    says what to do, and the run's last.ckpt keeps its bytes and still loads."""
    run_dir = Path(shutil.copytree(inputs["good"], tmp_path / "run"))
    last = run_dir / "checkpoints" / "last.ckpt"
    before = _tree_hashes(run_dir)
    wrapper = tmp_path / "train_on_a_full_disk.py"
    wrapper.write_text(DISK_FULL_WRAPPER.format(script=str(REPO / "scripts" / "train.py")))
    overrides = [*SHORT, f"data.root={inputs['fm']}", "trainer.max_epochs=2", f"paths.output_dir={run_dir}"]
    result = run_script(str(wrapper), *overrides, f"ckpt_path={last}", f"paths.log_dir={tmp_path / 'logs'}", cwd=REPO)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert "Traceback" not in output
    errors = [line for line in output.splitlines() if "[moekit][ERROR]" in line]
    assert len(errors) == 1, output[-3000:]
    assert os.strerror(errno.ENOSPC) in errors[0] and "ENOSPC" in errors[0]
    assert "Free disk space" in errors[0] and "resume with ckpt_path=" in errors[0]
    # The checkpoints written before are untouched and load; no half-written file is left beside them.
    assert {k: v for k, v in _tree_hashes(run_dir).items() if k.startswith("checkpoints/")} == {
        k: v for k, v in before.items() if k.startswith("checkpoints/")
    }
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == sorted(
        Path(k).name for k in before if k.startswith("checkpoints/")
    )
    assert load_task(str(last)).net is not None
    # (Its csv/ logs are not compared: the resumed run adds its rows to metrics.csv before it fails, see
    # moekit.loggers and tests/test_resume_lm.py. The earlier run's own folder is checked by the table's cases.)


def test_the_disk_full_message_is_a_user_error_in_process(inputs, tmp_path, monkeypatch):
    """The same failure as above in-process: ``train`` raises a user error, not the raw OSError."""
    run_dir = Path(shutil.copytree(inputs["good"], tmp_path / "run"))
    last = run_dir / "checkpoints" / "last.ckpt"
    digest = _sha256(last)

    def full_disk_save(obj, f, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f) if isinstance(f, (str, Path)) else None)

    overrides = [*SHORT, f"data.root={inputs['fm']}", "trainer.max_epochs=2", f"ckpt_path={last}"]
    cfg = compose_config("train", [*overrides, f"paths.output_dir={run_dir}"], run_dir)
    monkeypatch.setattr(torch, "save", full_disk_save)
    with pytest.raises(USER_ERRORS, match="No space left on device") as info:
        train(cfg)
    monkeypatch.undo()
    assert isinstance(info.value, OSError) and "paths.output_dir" in str(info.value)
    assert _sha256(last) == digest
    load_task(str(last))


def test_user_message_strips_the_dataloader_worker_traceback():
    try:
        raise ValueError("imagefolder: cannot read the image /x/bad.png (boom); delete or replace the file")
    except ValueError:
        from torch._utils import ExceptionWrapper

        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(ValueError) as info:
        wrapped.reraise()
    assert "Traceback" in str(info.value)
    assert user_message(info.value) == (
        "imagefolder: cannot read the image /x/bad.png (boom); delete or replace the file"
    )


def test_an_unreadable_image_error_names_the_file(tmp_path):
    from moekit.data.imagefolder import UnreadableImageError, read_rgb_image

    bad = _image_folder(tmp_path / "img") / "train" / "class1" / "bad.png"
    with pytest.raises(UnreadableImageError, match=str(bad)):
        read_rgb_image(str(bad))
    good = tmp_path / "img" / "train" / "class1" / "0.png"
    assert read_rgb_image(str(good)).size == (32, 32)
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(good.read_bytes()[:60])
    with pytest.raises(UnreadableImageError, match="truncated.png"):
        read_rgb_image(str(truncated))


def test_a_refused_resume_into_the_runs_own_folder_keeps_the_runs_record(inputs, tmp_path):
    """Hydra rewrites ``<run>/.hydra`` with the command's config before the run starts: a refused command puts
    the run's own record back."""
    run = Path(shutil.copytree(inputs["good"], tmp_path / "run"))
    (run / ".hydra").mkdir()
    record = {name: f"# the run's own {name}\n- seed=42\n" for name in ("config.yaml", "hydra.yaml", "overrides.yaml")}
    for name, text in record.items():
        (run / ".hydra" / name).write_text(text)
    args = [*FAST, f"data.root={inputs['fm']}", f"hydra.run.dir={run}", f"ckpt_path={run}/checkpoints/last.ckpt"]
    result = run_script("train.py", *args, "task.optimizer.lr=0.5", cwd=REPO)
    assert result.returncode == 1 and "task.optimizer.lr=0.5 (the checkpoint's:" in result.stderr + result.stdout
    assert {p.name: p.read_text() for p in (run / ".hydra").glob("*.yaml")} == record


def test_a_class_folder_without_images_names_its_split(tmp_path):
    from moekit.data.imagefolder import open_imagefolder_split

    val = _image_folder(tmp_path / "img") / "val"
    for image in (val / "class2").iterdir():
        image.unlink()
    with pytest.raises(FileNotFoundError, match=rf"imagefolder: {val}: .*class2.*\({val}/<class>/<image>\)"):
        open_imagefolder_split(val, None)
    assert len(open_imagefolder_split(tmp_path / "img" / "train", None)) == 7


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_gpu_trainer_on_a_machine_without_one_names_the_fix(inputs, tmp_path):
    overrides = [*FAST, f"data.root={inputs['fm']}", "trainer.accelerator=gpu"]  # debug= runs on the CPU
    cfg = compose_config("train", overrides, tmp_path)
    with pytest.raises(ValueError, match="trainer.accelerator=gpu but this machine has no CUDA GPU.*use trainer=cpu"):
        train(cfg)


@pytest.mark.parametrize(
    ("device", "expected"),
    [("tpu", "device='tpu' is not a device; use device=cpu"), ("mps", "the scripts run on cpu or cuda")]
    + ([] if torch.cuda.is_available() else [("cuda", "device=cuda but this machine has no CUDA GPU; use device=cpu")]),
)
def test_the_inference_scripts_refuse_a_device_they_cannot_run_on(device, expected):
    from moekit.commands.common import inference_device

    with pytest.raises(ValueError, match=re.escape(expected)):
        inference_device(device)
    assert inference_device("cpu") == torch.device("cpu")


def test_the_linear_probe_refuses_a_language_model(monkeypatch):
    import moekit.commands.probe as probe
    from moekit.tasks import LanguageModel

    monkeypatch.setattr(probe, "load_task", lambda path: LanguageModel.__new__(LanguageModel))
    with pytest.raises(ValueError, match="holds a LanguageModel, not an image classifier.*an image experiment"):
        probe.linear_probe(OmegaConf.create({"ckpt_path": "lm.ckpt", "shots": 10, "seed": 0}))


def test_a_sweep_plugin_that_is_not_installed_names_the_extra(monkeypatch):
    """Optuna's sweeper (chosen by an hparams_search config) and submitit's launchers: without their plugin the
    command stops naming the ``sweeps`` extra (Hydra's own error is a bare "Could not find 'hydra/sweeper/optuna'")."""
    import importlib.util

    from moekit import cli

    configs = REPO / "configs"
    search = ["-m", "hparams_search=soft_moe_optuna", "experiment=soft_moe_vit"]
    assert cli._missing_hydra_plugin(configs, search) is None  # the dev install has both plugins
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name.startswith("hydra_plugins.") else find_spec(name, *a)
    )
    assert cli._missing_hydra_plugin(configs, search) == (
        "hydra/sweeper=optuna (in hparams_search=soft_moe_optuna) needs the hydra-optuna-sweeper package, which is not "
        "installed; install it with pip install -e '.[sweeps]' (or pip install hydra-optuna-sweeper)"
    )
    launcher = cli._missing_hydra_plugin(configs, ["-m", "hydra/launcher=submitit_slurm", "seed=1,2"])
    assert launcher.startswith("hydra/launcher=submitit_slurm (on the command line) needs the hydra-submitit-launcher")
    assert cli._missing_hydra_plugin(configs, ["-m", "seed=1,2", "hparams_search=none_such"]) is None


def test_an_atomic_write_onto_a_folder_is_refused_before_the_work(tmp_path):
    """Any file moekit writes (a results.json, an exported model, a figure's table) whose path is a folder: refused,
    naming the path, before the block computes what os.replace would then throw away; the folder stays as it was."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "kept.txt").write_text("kept")
    ran = []
    with pytest.raises(IsADirectoryError, match="a folder stands where the file is to be written") as err:
        with atomic_write(tmp_path / "out", "w") as file:
            ran.append(file)
    assert err.value.filename == str(tmp_path / "out") and err.value.errno == errno.EISDIR and not ran
    assert isinstance(err.value, USER_ERRORS), "the scripts print it as one paragraph, not a traceback"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["kept.txt", "out"], "no temporary file left behind"


def test_step_checkpoint_built_in_python_refuses_a_bool_step_count(tmp_path):
    """``every_n_train_steps=True`` is an int to Python; taken as 1 it would checkpoint after every step."""
    from moekit.callbacks import StepCheckpoint

    with pytest.raises(ValueError, match=r"every_n_train_steps=True; give a whole number of optimizer steps"):
        StepCheckpoint(str(tmp_path), every_n_train_steps=True)
