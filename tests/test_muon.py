"""Muon for the hidden matrices, AdamW for the rest (moekit.tasks.muon): the updates equal torch's own Muon and
AdamW, an expert bank's experts and an LSTM's gates are orthogonalised one by one, the split of a model's
parameters, resume from the state dict, and FSDP2's sharded matrices."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import spawn
from moekit.config_checks import check_settings
from moekit.models import LSTMMoELM, TransformerLM, create_model
from moekit.moe import ExpertBank
from moekit.tasks.muon import MuonAdamW, hidden_matrices, muon_param_groups, orthogonalize
from moekit.tasks.optim import build_optimizer


def _torch_muon(params, lr=0.02, weight_decay=0.1, momentum=0.95):
    return torch.optim.Muon(params, lr=lr, weight_decay=weight_decay, momentum=momentum, adjust_lr_fn="match_rms_adamw")


def _steps(model: nn.Module, optimizers, inputs) -> None:
    for x in inputs:
        for optimizer in optimizers:
            optimizer.zero_grad()
        model(x).square().mean().backward()
        for optimizer in optimizers:
            optimizer.step()


def test_newton_schulz_brings_every_singular_value_near_one():
    u = torch.randn(3, 40, 24) @ torch.diag(torch.logspace(-1, 0, 24))  # condition number about 30
    for matrix in (u, u.mT):  # tall and wide
        o = orthogonalize(matrix.double())
        s = torch.linalg.svdvals(o)
        assert s.min() > 0.6 and s.max() < 1.25, (s.min(), s.max())
        # an odd polynomial of U: O = P f(S) Q^T for U = P S Q^T, diagonal in U's singular vectors
        p, _, qh = torch.linalg.svd(matrix.double(), full_matrices=False)
        inner = p.mT @ o @ qh.mT
        torch.testing.assert_close(inner, torch.diag_embed(inner.diagonal(dim1=-2, dim2=-1)), atol=1e-9, rtol=0)


def test_linear_weights_step_as_torch_muon():
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Linear(24, 40, bias=False), nn.Linear(40, 16, bias=False))
    theirs = nn.Sequential(nn.Linear(24, 40, bias=False), nn.Linear(40, 16, bias=False))
    theirs.load_state_dict(ours.state_dict())
    inputs = [torch.randn(8, 24) for _ in range(3)]
    _steps(ours, [MuonAdamW(muon_param_groups(ours, 0.1), lr=0.02, ns_dtype="bfloat16")], inputs)
    _steps(theirs, [_torch_muon(theirs.parameters())], inputs)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_each_expert_of_a_bank_steps_as_its_own_matrix():
    """An expert bank ``[E, in, out]`` is E matrices: each steps as torch's Muon steps that expert's matrix alone
    (its own norm, its own 0.2 sqrt(max(in, out)) scale), not as one [E * in, out] matrix."""
    torch.manual_seed(0)
    bank = ExpertBank(3, 12, 20, 12, act_layer="relu", bias=False)
    with torch.no_grad():
        bank.fc1_weight.mul_(torch.tensor([1.0, 10.0, 0.1])[:, None, None])  # experts of different scales
    experts = [nn.ParameterList([nn.Parameter(bank.fc1_weight[e].clone()), nn.Parameter(bank.fc2_weight[e].clone())])
               for e in range(3)]  # fmt: skip
    ours = MuonAdamW(muon_param_groups(bank, 0.1), lr=0.02, ns_dtype="bfloat16")
    assert [g["layout"] for g in ours.param_groups] == ["experts"]
    theirs = _torch_muon([p for expert in experts for p in expert])
    for _ in range(2):
        grads = torch.randn_like(bank.fc1_weight), torch.randn_like(bank.fc2_weight)
        bank.fc1_weight.grad, bank.fc2_weight.grad = grads
        for e, (w1, w2) in enumerate(experts):
            w1.grad, w2.grad = grads[0][e].clone(), grads[1][e].clone()
        ours.step()
        theirs.step()
    for e, (w1, w2) in enumerate(experts):
        torch.testing.assert_close(bank.fc1_weight[e], w1, atol=1e-6, rtol=0)
        torch.testing.assert_close(bank.fc2_weight[e], w2, atol=1e-6, rtol=0)


def test_convolutions_flatten_and_lstm_gates_step_apart():
    torch.manual_seed(0)
    conv, lstm = nn.Conv2d(3, 8, 3, bias=False), nn.LSTM(6, 5, bias=False)
    model = nn.ModuleDict({"conv": conv, "lstm": lstm})
    assert hidden_matrices(model) == {"conv.weight": "matrix", "lstm.weight_ih_l0": "lstm", "lstm.weight_hh_l0": "lstm"}
    flat = nn.Parameter(conv.weight.detach().reshape(8, 27).clone())
    gates = [nn.Parameter(w.detach().reshape(4, 5, -1)[g].clone()) for w in lstm.all_weights[0] for g in range(4)]
    ours, theirs = MuonAdamW(muon_param_groups(model, 0.1), lr=0.02, ns_dtype="bfloat16"), _torch_muon([flat, *gates])
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        flat.grad = conv.weight.grad.reshape(8, 27).clone()
        for i, w in enumerate(lstm.all_weights[0]):
            for g in range(4):
                gates[4 * i + g].grad = w.grad.reshape(4, 5, -1)[g].clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(conv.weight.reshape(8, 27), flat, atol=1e-6, rtol=0)
    for i, w in enumerate(lstm.all_weights[0]):
        torch.testing.assert_close(w.reshape(4, 5, -1), torch.stack(gates[4 * i : 4 * i + 4]), atol=1e-6, rtol=0)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.norm, self.head = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.norm(self.body(x)))


@pytest.mark.parametrize("fused", [True, False])
def test_the_other_parameters_step_as_torch_adamw(fused):
    torch.manual_seed(0)
    ours, theirs = _Net(), _Net()
    theirs.load_state_dict(ours.state_dict())
    groups = muon_param_groups(ours, 0.05)
    assert [(g["algorithm"], [p.shape for p in g["params"]]) for g in groups][:2] == [
        ("muon", [(16, 8)]), ("adamw", [(4, 16)])  # the head: AdamW, decayed
    ]  # fmt: skip
    optimizer = MuonAdamW(groups, lr=1e-2, betas=(0.9, 0.95), fused=fused, ns_dtype="bfloat16")
    rest = [p for name, p in theirs.named_parameters() if name not in ("body.weight", "head.weight")]
    muon = _torch_muon([theirs.body.weight], lr=1e-2, weight_decay=0.05)
    reference = torch.optim.AdamW(
        [{"params": [theirs.head.weight], "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-2, betas=(0.9, 0.95),
    )  # fmt: skip
    for _ in range(3):
        x = torch.randn(4, 8)
        _steps(ours, [optimizer], [x])
        _steps(theirs, [muon, reference], [x])
        for (name, p), q in zip(theirs.named_parameters(), ours.parameters()):
            torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-6, msg=name)


def test_the_split_of_a_soft_moe_vit():
    net = create_model("soft_moe_vit_tiny_patch4_28", embed_dim=32, depth=2, num_heads=2, moe={"num_experts": 4})
    chosen = hidden_matrices(net)
    assert chosen["blocks.1.mlp.experts.fc1_weight"] == "experts" and chosen["blocks.0.attn.qkv.weight"] == "matrix"
    assert chosen["patch_embed.proj.weight"] == "matrix"  # a patchify convolution: a linear map of pixels
    for name in ("head.weight", "pos_embed", "blocks.1.mlp.phi", "blocks.0.norm1.weight", "blocks.0.attn.qkv.bias"):
        assert name in dict(net.named_parameters()) and name not in chosen, name


def test_routers_embeddings_and_a_tied_head_train_with_adamw():
    moe = {"recipe": "switch", "num_experts": 4, "capacity_factor": None, "eval_capacity_factor": None}
    lm = TransformerLM(vocab_size=50, dim=32, depth=2, num_heads=2, max_seq_len=16, moe=moe, moe_blocks="all")
    chosen = hidden_matrices(lm)
    names = dict(lm.named_parameters())
    routers = [n for n in names if "router" in n]
    assert routers and not set(routers) & set(chosen)
    assert "token_embedding.weight" in names and "token_embedding.weight" not in chosen  # tied to the head
    assert {"blocks.0.attn.qkv.weight", "blocks.0.mlp.experts.fc1_weight"} <= set(chosen)
    moe = {"recipe": "noisy_top_k", "num_experts": 4}
    lstm_lm = LSTMMoELM(vocab_size=50, dim=16, expert_hidden=32, moe=moe, tie_embeddings=False)
    chosen = hidden_matrices(lstm_lm)
    assert chosen["lstm_before.0.weight_hh_l0"] == "lstm" and "head.weight" not in chosen
    assert not {n for n, _ in lstm_lm.named_parameters() if "router" in n} & set(chosen)


class _Routed(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.experts = nn.Linear(8, 16), ExpertBank(2, 16, 8, 4, act_layer="relu")

    def forward(self, x):
        return self.experts(self.body(x), 2)  # rows 0-1 to expert 0, 2-3 to expert 1


def test_a_run_resumed_from_the_state_dict_steps_as_one_that_never_stopped():
    torch.manual_seed(0)
    whole, resumed = _Routed(), _Routed()
    resumed.load_state_dict(whole.state_dict())
    inputs = [torch.randn(4, 8) for _ in range(4)]
    whole_opt = build_optimizer(muon_param_groups(whole, 0.1), name="muon", lr=0.01)
    _steps(whole, [whole_opt], inputs)
    first = build_optimizer(muon_param_groups(resumed, 0.1), name="muon", lr=0.01)
    _steps(resumed, [first], inputs[:2])
    state = first.state_dict()
    assert {"momentum_buffer"} in [set(s) for s in state["state"].values()]
    second = build_optimizer(muon_param_groups(resumed, 0.1), name="muon", lr=0.01)
    second.load_state_dict(state)
    _steps(resumed, [second], inputs[2:])
    for a, b in zip(whole.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def _sharded_step(rank: int, world: int) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 12), nn.GELU(), nn.Linear(12, 4))  # noqa: E731
    net, reference = make(), make()
    reference.load_state_dict(net.state_dict())
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(net)
    settings = dict(name="muon", lr=0.02, ns_dtype="float32")
    sharded = build_optimizer(muon_param_groups(net, 0.1), **settings)
    whole = build_optimizer(muon_param_groups(reference, 0.1), **settings)
    inputs = [torch.randn(6, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]  # the same on each rank
    _steps(net, [sharded], inputs)
    _steps(reference, [whole], inputs)
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, atol=1e-6, rtol=1e-5, msg=name)


def test_fsdp2_sharded_matrices_step_as_the_whole_ones():
    spawn(_sharded_step, 2)


def test_bad_settings_are_refused_before_torch_runs():
    with pytest.raises(ValueError, match="task.optimizer.name='adam' must be one of adamw, sgd, muon"):
        check_settings({"task": {"optimizer": {"name": "adam"}}})
    with pytest.raises(ValueError, match="ns_dtype"):
        check_settings({"task": {"optimizer": {"name": "muon", "ns_dtype": "float16"}}})
    with pytest.raises(ValueError, match="build them with moekit.tasks.muon.muon_param_groups"):
        build_optimizer(nn.Linear(4, 4).parameters(), name="muon")


def test_a_model_without_trainable_hidden_matrices_trains_with_adamw_alone():
    """A frozen backbone (``task.freeze_backbone``) leaves the head: Muon has nothing to do, AdamW steps it."""
    model = _Net()
    model.body.requires_grad_(False)
    optimizer = build_optimizer(muon_param_groups(model, 0.05), name="muon", lr=1e-2)
    assert {g["algorithm"] for g in optimizer.param_groups} == {"adamw"}
    before = model.head.weight.detach().clone()
    _steps(model, [optimizer], [torch.randn(4, 8)])
    assert not torch.equal(before, model.head.weight)


def test_task_optimizer_name_muon_trains_under_lightning_with_norm_clipping():
    from lightning import Callback, Trainer

    from conftest import TINY_NET
    from moekit.tasks import ImageClassifier

    norms = []

    class Norms(Callback):
        def on_before_zero_grad(self, trainer, module, optimizer):  # after the step: the gradients it used
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            if grads:
                norms.append(torch.nn.utils.get_total_norm(grads).item())

    task = ImageClassifier(net=TINY_NET, num_classes=10, optimizer={"name": "muon", "lr": 1e-3})
    before = {name: p.detach().clone() for name, p in task.net.named_parameters()}
    trainer = Trainer(
        accelerator="cpu", max_steps=2, gradient_clip_val=0.05, callbacks=[Norms()], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = torch.utils.data.TensorDataset(torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,)))
    trainer.fit(task, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=16))
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, MuonAdamW)
    grouped = [p for group in optimizer.param_groups for p in group["params"]]
    assert len(grouped) == len({id(p) for p in grouped}) == len(before)  # every parameter, once
    muon = {id(p) for g in optimizer.param_groups if g["algorithm"] == "muon" for p in g["params"]}
    assert {n for n, p in task.net.named_parameters() if id(p) in muon} == set(hidden_matrices(task.net))
    assert all(not torch.equal(before[n], p) for n, p in task.net.named_parameters() if id(p) in muon)
    assert norms[-1] == pytest.approx(0.05, rel=1e-4)


def test_the_summary_counts_each_algorithms_tensors_and_names_the_newton_schulz_dtype():
    model = _Net()
    optimizer = MuonAdamW(muon_param_groups(model, 0.05), ns_dtype="float32")
    assert optimizer.summary() == (
        "Muon for 1 hidden matrices (128 weights), AdamW for 5 other tensors (116); Newton-Schulz steps in "
        "float32 on cpu (ns_dtype=float32)"
    )


@pytest.mark.parametrize(
    ("flags", "run_precision", "expected"),
    [
        ({"avx512_bf16", "amx_bf16"}, None, torch.bfloat16),  # AMX: bf16 matmuls pay in any run
        ({"avx512_bf16", "amx_bf16"}, "32-true", torch.bfloat16),
        ({"avx512_bf16"}, "bf16-mixed", torch.bfloat16),  # measured faster in bf16 by trainer.precision=auto
        ({"avx512_bf16"}, "32-true", torch.float32),  # measured slower, or a float32 run
        ({"avx512_bf16"}, None, torch.float32),  # not known
        ({"avx2", "fma"}, "bf16-mixed", torch.float32),  # no bf16 dot products: bf16 matmuls emulated
    ],
)
def test_auto_runs_newton_schulz_in_bf16_on_cpus_where_bf16_matmuls_pay(monkeypatch, flags, run_precision, expected):
    from moekit.utils import machine

    monkeypatch.setattr(machine, "cpu_flags", lambda: flags)
    optimizer = build_optimizer(muon_param_groups(_Net(), 0.05), name="muon", run_precision=run_precision)
    assert optimizer._ns_dtype(torch.device("cpu")) == expected


@pytest.mark.parametrize("native_bf16, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_runs_newton_schulz_in_bf16_only_on_gpus_with_bf16_in_hardware(monkeypatch, native_bf16, expected):
    """A V100 or T4 emulates bf16 matmuls (is_bf16_supported() alone accepts the emulation): float32 there."""
    asked = []

    def is_bf16_supported(including_emulation=True):
        asked.append(including_emulation)
        return native_bf16

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    optimizer = MuonAdamW(muon_param_groups(_Net(), 0.05))
    assert optimizer._ns_dtype(torch.device("cuda")) == expected and asked == [False]
