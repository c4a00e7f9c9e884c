"""The language-model commands on a small checkpoint written here (no training): output paths of the wrong kind and a
tokenizer gone since training are refused before anything is written; sample's advice for a prompt too long."""

from __future__ import annotations

import pytest
import torch

from conftest import compose_config
from moekit.checkpoint import TASK_KEY
from moekit.commands.export import export
from moekit.commands.quantize import quantize
from moekit.commands.sample import sample
from moekit.data.tokenizers import ByteTokenizer
from moekit.errors import OutputError
from moekit.tasks import LanguageModel

NET = {
    "_target_": "moekit.models.TransformerLM",
    "vocab_size": 256,
    "max_seq_len": 16,
    "dim": 16,
    "depth": 1,
    "num_heads": 2,
    "gated": True,
    "norm": "rmsnorm",
    "moe": {"recipe": "mixtral", "num_experts": 2},
}


def write_ckpt(path, run_config=None):
    """A Transformer LM checkpoint as scripts/train.py writes it (the entries load_task reads)."""
    module = LanguageModel(net=NET, vocab_size=256, run_config=run_config)
    checkpoint = {
        "state_dict": module.state_dict(),
        "hyper_parameters": dict(module.hparams),
        TASK_KEY: "moekit.tasks.language_model:LanguageModel",
    }
    torch.save(checkpoint, path)
    return path


@pytest.fixture
def lm_ckpt(tmp_path):
    return write_ckpt(tmp_path / "last.ckpt")


def test_export_refuses_an_output_path_of_the_wrong_kind(lm_ckpt, tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    cfg = compose_config("export", [f"ckpt_path={lm_ckpt}", f"output_path={folder}"], tmp_path / "run")
    with pytest.raises(
        OutputError, match=rf"output_path='{folder}' is a folder; .* output_path={folder}/last.safetensors"
    ):
        export(cfg)  # was an IsADirectoryError from os.replace
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"mine")
    cfg = compose_config("export", [f"ckpt_path={lm_ckpt}", "format=hf", f"output_path={a_file}"], tmp_path / "run")
    with pytest.raises(OutputError, match=rf"output_path='{a_file}' is a file; format=hf writes a folder"):
        export(cfg)  # was a FileExistsError from mkdir
    assert a_file.read_bytes() == b"mine" and not any(folder.iterdir())


def test_quantize_refuses_a_folder_as_output_path_before_quantizing(lm_ckpt, tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    overrides = [f"ckpt_path={lm_ckpt}", "method=rtn", f"output_path={folder}"]
    with pytest.raises(OutputError, match=rf"is a folder; .* output_path={folder}/last.int4-rtn.safetensors"):
        quantize(compose_config("quantize", overrides, tmp_path / "run"))
    assert not any(folder.iterdir())


def test_hf_export_with_the_runs_tokenizer_gone_writes_nothing(tmp_path):
    tokenizer = tmp_path / "tokenizer.json"
    ByteTokenizer().hf_backend().save(str(tokenizer))
    ckpt = write_ckpt(tmp_path / "last.ckpt", {"data": {"tokenizer": {"kind": "file", "path": str(tokenizer)}}})
    tokenizer.unlink()  # moved since training
    folder = tmp_path / "hf"
    cfg = compose_config("export", [f"ckpt_path={ckpt}", "format=hf", f"output_path={folder}"], tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="tokenizer path=.* does not exist"):
        export(cfg)
    assert not folder.exists(), "was a config and weights without their tokenizer"


def test_sample_does_not_suggest_a_max_new_tokens_that_cannot_fit_a_long_prompt(tmp_path):
    data = {"_target_": "moekit.data.TextDataModule", "tokenizer": {"kind": "byte"}, "seq_len": 16}
    ckpt = write_ckpt(tmp_path / "last.ckpt", {"data": data})
    overrides = [f"ckpt_path={ckpt}", "slide=false"]
    with pytest.raises(ValueError, match=r"\(20 tokens\) .* max_seq_len=16; shorten the prompt, or set slide=true"):
        sample(compose_config("sample", [*overrides, "max_new_tokens=3", f"prompt='{'a' * 20}'"], tmp_path / "run"))
    with pytest.raises(ValueError, match=r"\(10 tokens\) .* max_seq_len=16; lower max_new_tokens to 7, shorten"):
        sample(compose_config("sample", [*overrides, "max_new_tokens=8", f"prompt='{'a' * 10}'"], tmp_path / "run"))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("prompt=1984", r"prompt=1984 is not text \(Hydra read it as int\); quote it: 'prompt=\"1984\"'"),
        ("prompt=null", r"prompt=null; give the text to continue"),
        ("num_samples=2.5", r"num_samples=2.5 must be an int >= 1"),  # was a TypeError from list * float
        ("use_cache=maybe", r"use_cache='maybe' must be true or false"),  # was taken as true
        ("top_k=0", r"top_k=0 must be an int >= 1"),
    ],
)
def test_sample_refuses_settings_of_the_wrong_type_before_loading(lm_ckpt, tmp_path, override, message):
    cfg = compose_config("sample", [f"ckpt_path={lm_ckpt}", override], tmp_path / "run")
    with pytest.raises(ValueError, match=message):  # prompt=1984 was an AttributeError: 'int' has no 'encode'
        sample(cfg)
