"""The language-model side of the training template: every LM experiment's fast_dev_run, learning a
repeated corpus far below the uniform perplexity, train -> eval -> sample from the checkpoint, and
bad input through the real scripts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from conftest import CONFIGS, REPO, compose_config, run_script
from moekit.checkpoint import load_task
from moekit.commands.evaluate import evaluate
from moekit.commands.export import export
from moekit.commands.quantize import quantize
from moekit.commands.sample import sample
from moekit.commands.train import train
from moekit.models import TransformerLM, export_safetensors
from moekit.moe import HashMoE
from moekit.quant import expert_memory
from moekit.tasks import LanguageModel
from resume_helpers import metrics_rows

LM_EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*_lm.yaml"))
PHRASE = "the quick brown fox jumps over the lazy dog. "


@pytest.fixture(scope="module")
def repeated_corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "fox.txt"
    path.write_text(PHRASE * 400)
    return path


def lm_overrides(experiment: str, corpus: Path, *extra: str) -> list[str]:
    """``experiment`` at its tiny size (debug=tiny) on ``corpus``, every batch of it, in float32."""
    return [
        f"experiment={experiment}",
        "debug=tiny",
        "data=text_files",
        f"data.paths=[{corpus}]",
        "data.seq_len=32",
        "data.batch_size=16",
        "trainer.limit_train_batches=null",
        "trainer.limit_val_batches=null",
        "trainer.limit_test_batches=null",
        "trainer.precision=32-true",
        *extra,
    ]


def test_the_lm_experiments_exist():
    assert LM_EXPERIMENTS == [
        "dense_transformer_lm",
        "lory_transformer_lm",
        "mod_transformer_lm",
        "moe_lstm_lm",
        "moe_transformer_lm",
    ]


@pytest.mark.parametrize("experiment", LM_EXPERIMENTS)
@pytest.mark.e2e
def test_fast_dev_run_of_each_lm_experiment_on_the_default_corpus(experiment, tmp_path):
    cfg = compose_config("train", [f"experiment={experiment}", "debug=tiny", "trainer.fast_dev_run=true"], tmp_path)
    assert cfg.data.source == "pydoc", "the default corpus is Python's own documentation (offline)"
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss_step"])
    # bits per byte of a byte-level model is its cross-entropy in bits
    assert metrics["test/bpb"] == pytest.approx(math.log2(metrics["test/ppl"]), rel=1e-5)


@pytest.fixture(scope="module")
def trained_lm(repeated_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("lm_run")
    cfg = compose_config(
        "train",
        lm_overrides(
            "moe_transformer_lm",
            repeated_corpus,
            "trainer.max_epochs=6",
            "task.optimizer.lr=1e-2",
            "model.dropout=0.0",
            "model.norm=rmsnorm",  # Mixtral's, so that the model exports to transformers
            "data.val_fraction=0.1",
            "data.test_fraction=0.1",
        ),
        out,
    )
    return out, train(cfg)


@pytest.mark.e2e
def test_perplexity_of_a_repeated_corpus_drops_far_below_uniform(trained_lm):
    _, metrics = trained_lm
    # uniform over 256 bytes is perplexity 256; the phrase is deterministic after a few characters.
    assert metrics["test/ppl"] < 2.0, metrics
    assert metrics["val/ppl"] < 2.0, metrics


@pytest.mark.e2e
def test_train_then_eval_then_sample_from_the_checkpoint(trained_lm, tmp_path, capsys):
    out, metrics = trained_lm
    ckpt = sorted((out / "checkpoints").glob("epoch_*.ckpt"))[-1]
    assert isinstance(load_task(str(ckpt)), LanguageModel)
    again = evaluate(compose_config("eval", [f"ckpt_path={ckpt}", "logger=csv"], tmp_path / "eval"))
    assert again["test/ppl"] == pytest.approx(metrics["test/ppl"], rel=1e-5)

    cfg = compose_config(
        "sample", [f"ckpt_path={ckpt}", "prompt='the quick '", "max_new_tokens=22", "temperature=0"], tmp_path / "s"
    )
    capsys.readouterr()
    (greedy,) = sample(cfg)
    assert greedy.startswith("the quick ")
    # the model learned the phrase: greedy decoding continues it
    assert greedy == (PHRASE * 2)[: len(greedy)]
    assert capsys.readouterr().out == f"--- sample 0 ---\n{greedy}\n", "streamed: the same text, printed once"
    cfg.use_cache = False
    assert sample(cfg) == [greedy], "the KV cache changes nothing"


@pytest.mark.e2e
def test_sample_refuses_an_empty_prompt_and_slides_past_max_seq_len(trained_lm, tmp_path):
    out, _ = trained_lm
    ckpt = sorted((out / "checkpoints").glob("epoch_*.ckpt"))[-1]
    with pytest.raises(ValueError, match="encodes to no tokens"):
        sample(compose_config("sample", [f"ckpt_path={ckpt}", "prompt=''"], tmp_path))
    too_long = [f"ckpt_path={ckpt}", "prompt='the quick '", "max_new_tokens=24", "temperature=0"]
    with pytest.raises(ValueError, match="lower max_new_tokens to 23"):  # 10 prompt tokens + 22 run: max_seq_len 32
        sample(compose_config("sample", [*too_long, "slide=false"], tmp_path))
    (text,) = sample(compose_config("sample", too_long, tmp_path))  # the default slides past the limit
    assert len(text) == 34 and text.startswith("the quick ")


@pytest.mark.e2e
def test_sample_says_a_prompt_the_tokenizer_drops_whole_is_not_empty(trained_lm, repeated_corpus, tmp_path):
    """A BPE without an unknown token drops the characters it does not know: a prompt of only such characters encodes
    to nothing, and the error says so rather than asking for "at least one character"."""
    from tokenizers import Tokenizer, models

    latin1 = {chr(byte): byte for byte in range(256)}  # 256 tokens, as the checkpoint's byte-level model
    Tokenizer(models.BPE(vocab=latin1, merges=[])).save(str(tmp_path / "tokenizer.json"))
    out, _ = trained_lm
    ckpt = sorted((out / "checkpoints").glob("epoch_*.ckpt"))[-1]
    data = ["data=text_files", f"data.paths=[{repeated_corpus}]", "data.tokenizer.kind=file"]
    data.append(f"data.tokenizer.path={tmp_path / 'tokenizer.json'}")
    with pytest.raises(ValueError, match=r"prompt='東京' encodes to no tokens: tokenizer .* drops every character"):
        sample(compose_config("sample", [f"ckpt_path={ckpt}", 'prompt="東京"', *data], tmp_path))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["moe=soft_moe"], "so the Transformer LM \\(causal\\) would see the future; use a per-token router"),
        (["+moe.capacity_factor=1.0"], r"set \+moe\.capacity_scope=position"),
        (["model.max_seq_len=16"], "max_seq_len"),
        (["data.paths=[/nonexistent/corpus.txt]"], "/nonexistent/corpus.txt"),
        (["data.vocab_size=300"], "vocab_size"),
    ],
)
@pytest.mark.e2e
def test_bad_lm_input_raises_a_clear_error(overrides, match, repeated_corpus, tmp_path):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        train(compose_config("train", lm_overrides("moe_transformer_lm", repeated_corpus, *overrides), tmp_path))


@pytest.mark.e2e
def test_cli_sample_prints_the_continuation(trained_lm, tmp_path):
    out, _ = trained_lm
    ckpt = sorted((out / "checkpoints").glob("epoch_*.ckpt"))[-1]
    result = run_script(
        "sample.py",
        f"ckpt_path={ckpt}",
        "prompt='the lazy '",
        "max_new_tokens=12",
        "temperature=0",
        f"paths.log_dir={tmp_path}",
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert "the lazy dog. the" in result.stdout


# The empty-corpus command-line case is in test_bad_input.py (text_corpus_empty).


@pytest.mark.e2e
def test_mode_lm_learns_logs_its_routing_and_samples_the_same_with_the_cache(repeated_corpus, tmp_path):
    """MoDE: the MoE LM with Mixture-of-Depths in every other block (half the tokens): it learns the phrase,
    the routing monitor logs each routed block's processed fraction and the causal decision's agreement with
    top-C, and cached sampling (per-token decisions, processed-key masks) equals the full forward's."""
    cfg = compose_config(
        "train",
        lm_overrides(
            "moe_transformer_lm",
            repeated_corpus,
            "mod=interleaved",
            "mod.capacity=0.5",
            "trainer.max_epochs=6",
            "trainer.log_every_n_steps=5",
            "task.optimizer.lr=1e-2",
            "model.dropout=0.0",
            "logger=csv",
        ),
        tmp_path,
    )
    metrics = train(cfg)
    assert metrics["test/ppl"] < 2.5, metrics
    logged = (tmp_path / "csv" / "metrics.csv").read_text().splitlines()[0].split(",")
    for name in ("processed_fraction", "topc_agreement"):
        assert f"moe/blocks.1.depth_router/{name}" in logged and f"val_moe/blocks.1.depth_router/{name}" in logged
    assert "train/aux/mod_bce_step" in logged
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    prompt = ["prompt='the quick '", "max_new_tokens=22", "temperature=0"]
    cfg = compose_config("sample", [f"ckpt_path={ckpt}", *prompt], tmp_path / "s")
    (greedy,) = sample(cfg)
    cfg.use_cache = False
    assert sample(cfg) == [greedy]


@pytest.mark.e2e
def test_frequency_hash_tables_are_fitted_on_the_training_split(tmp_path):
    corpus = tmp_path / "corpus.txt"  # the held-out tail (val, test: the last 10%) is made of other bytes
    corpus.write_text(PHRASE * 360 + "QXZ" * (len(PHRASE) * 20))
    overrides = lm_overrides("moe_transformer_lm", corpus, "moe=hash", "moe.num_experts=4", "moe.hash_method=frequency")
    cfg = compose_config("train", [*overrides, "trainer.max_epochs=1"], tmp_path)
    train(cfg)
    task = load_task(tmp_path / "checkpoints" / "last.ckpt")
    datamodule = instantiate(cfg.data)
    datamodule.setup()

    def fitted(tokens):
        router = HashMoE(8, 16, num_experts=4, vocab_size=task.net.vocab_size, hash_method="frequency").router
        router.fit_frequency(torch.bincount(tokens, minlength=task.net.vocab_size))
        return router.expert_of_token

    expected = fitted(datamodule.split_tokens["train"])
    assert not torch.equal(expected, fitted(datamodule.tokens)), "a fit on the whole corpus must differ"
    routers = [m.router for m in task.net.modules() if isinstance(m, HashMoE)]
    assert routers
    for router in routers:
        assert not router.needs_fit and torch.equal(router.expert_of_token, expected)


@pytest.mark.e2e
def test_lm_checkpoint_resumes_at_the_saved_step(trained_lm, repeated_corpus, tmp_path):
    out, _ = trained_lm
    last = out / "checkpoints" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=False)
    cfg = compose_config(
        "train",
        lm_overrides(
            "moe_transformer_lm",
            repeated_corpus,
            "trainer.max_epochs=7",
            "task.optimizer.lr=1e-2",  # the trained run's: a resume takes the checkpoint's optimizer
            "model.norm=rmsnorm",  # and its model
            f"ckpt_path={last}",
            "data.val_fraction=0.1",
            "data.test_fraction=0.1",
            "model.dropout=0.0",
            "test=false",
        ),
        tmp_path,
    )
    train(cfg)
    resumed = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert resumed["epoch"] == saved["epoch"] + 1
    assert resumed["global_step"] > saved["global_step"]
    logged = {int(float(row["epoch"])) for row in metrics_rows(tmp_path) if "epoch" in row}
    assert logged == {saved["epoch"] + 1}, "a resumed run trains the one epoch left, not all of them from the start"


@pytest.mark.e2e
def test_quantized_lm_experts_serve_eval_and_sample(trained_lm, tmp_path):
    """scripts/quantize.py on the MoE Transformer LM (top-2 of 8 experts: ragged groups): int8 GPTQ keeps the
    perplexity and the greedy continuation; ternary experts are stored in under 2 bits per weight and still load."""
    out, metrics = trained_lm
    ckpt = sorted((out / "checkpoints").glob("epoch_*.ckpt"))[-1]
    float_ppl = evaluate(compose_config("eval", [f"ckpt_path={ckpt}", "logger=csv"], tmp_path / "float"))["test/ppl"]
    paths = {}
    for bits, method in (("8", "gptq"), ("ternary", "rtn")):
        cfg = compose_config(
            "quantize",
            [
                f"ckpt_path={ckpt}",
                f"bits={bits}",
                f"method={method}",
                "calibration_batches=8",
                "group_size=32",
                f"output_path={tmp_path}/q{bits}.safetensors",
            ],
            tmp_path / f"q{bits}",
        )
        paths[bits] = quantize(cfg)
    int8 = evaluate(compose_config("eval", [f"ckpt_path={paths['8']}", "logger=csv"], tmp_path / "int8"))
    assert int8["test/ppl"] == pytest.approx(float_ppl, rel=0.01)
    cfg = compose_config(
        "sample",
        [f"ckpt_path={paths['8']}", "prompt='the quick '", "max_new_tokens=22", "temperature=0"],
        tmp_path / "s",
    )
    (greedy,) = sample(cfg)
    assert greedy == (PHRASE * 2)[: len(greedy)]

    ternary = load_task(str(paths["ternary"]))
    memory = expert_memory(ternary.net)
    code_bits = memory.ternary["code_bits_per_weight"]
    assert code_bits < 1.6, "below the 2 bits of packed ternary codes"
    assert memory.bits_per_weight < code_bits + 16 / 32 + 0.1, "plus a float16 scale per 32 rows and chunk offsets"
    assert math.isfinite(
        evaluate(compose_config("eval", [f"ckpt_path={paths['ternary']}"], tmp_path / "t"))["test/ppl"]
    )


@pytest.mark.e2e
def test_a_trained_lm_exports_to_transformers_and_fine_tunes_from_the_folder(trained_lm, repeated_corpus, tmp_path):
    """scripts/export.py format=hf writes a folder transformers loads with moekit's logits and the run's tokenizer;
    task.init_from=hf:<folder> starts a run from it, with the folder's architecture in place of the experiment's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = trained_lm
    ckpt = sorted((out / "checkpoints").glob("epoch_*.ckpt"))[-1]
    folder = export(compose_config("export", [f"ckpt_path={ckpt}", "format=hf"], tmp_path / "export"))
    assert folder == ckpt.with_name(f"{ckpt.stem}-hf")
    ids = torch.tensor([list(PHRASE.encode())[:30]])
    with torch.no_grad():
        ours = load_task(ckpt).net.eval()(ids)
        theirs = AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
    tokenizer = AutoTokenizer.from_pretrained(folder)  # the run's byte tokenizer: byte b is id b
    assert tokenizer.encode(PHRASE + "é") == list((PHRASE + "é").encode()) and tokenizer.decode(ids[0]) == PHRASE[:30]

    overrides = ["trainer.max_epochs=1", "task.optimizer.lr=1e-7", f"task.init_from=hf:{folder}", "model.dim=48"]
    metrics = train(compose_config("train", lm_overrides("moe_transformer_lm", repeated_corpus, *overrides), tmp_path))
    assert metrics["test/ppl"] < 2.0, "a random start at this learning rate stays near the uniform 256"
    width = json.loads((folder / "config.json").read_text())["hidden_size"]
    assert width != 48 and load_task(tmp_path / "checkpoints" / "last.ckpt").net.dim == width, "the folder's width"


@pytest.mark.e2e
def test_unpacked_documents_train_with_the_padding_mask(tmp_path):
    """data.pack=false: one document per padded sequence; the task passes the mask and scores real targets only."""
    corpus = tmp_path / "docs"
    corpus.mkdir()
    for index, repeats in enumerate((3, 9, 1, 14, 5)):  # documents of different lengths
        (corpus / f"doc{index}.txt").write_text(PHRASE * repeats)
    # evaluation one sequence at a time over larger splits: batches of different padding, weighed by real targets
    extra = ["data.pack=false", "trainer.max_epochs=1", "data.eval_batch_size=1"]
    extra += ["data.val_fraction=0.3", "data.test_fraction=0.3"]
    cfg = compose_config("train", lm_overrides("moe_transformer_lm", corpus, *extra), tmp_path)
    datamodule = instantiate(cfg.data)
    inputs, targets, mask = next(iter(datamodule.train_dataloader()))
    assert bool((~mask).any()) and torch.equal(mask, targets != -100)
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss_step"]) and math.isfinite(metrics["test/ppl"])
    assert metrics["test/bpb"] == pytest.approx(math.log2(metrics["test/ppl"]), rel=1e-5)
    for split in ("val", "test"):  # ce and ppl both weigh batches by real targets
        assert metrics[f"{split}/ppl"] == pytest.approx(math.exp(metrics[f"{split}/ce"]), rel=1e-5)


def test_init_mode_upcycle_starts_the_moe_lm_from_its_dense_twin(tmp_path):
    """task.init_mode=upcycle: experts copy the dense checkpoint's MLPs; with Mixtral's renormalised gates and no
    capacity limit the MoE LM computes the dense LM."""
    common = {"vocab_size": 64, "max_seq_len": 16, "dim": 32, "depth": 2, "num_heads": 2, "gated": True}
    torch.manual_seed(0)
    dense = TransformerLM(**common, moe=None).eval()
    path = export_safetensors(dense, tmp_path / "dense.safetensors")
    net = {"_target_": "moekit.models.TransformerLM", **common, "moe": {"recipe": "mixtral", "num_experts": 4}}
    task = LanguageModel(net=net, vocab_size=64, init_from=str(path), init_mode="upcycle").eval()
    ids = torch.randint(64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(task.net(ids), dense(ids), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="init_mode='grow'; allowed: 'finetune', 'upcycle'"):
        LanguageModel(net=net, vocab_size=64, init_from=str(path), init_mode="grow")
