"""Benchmark of the MoE layers: forward + backward time against dense MLPs and reference implementations.

A benchmark, not a test: it prints tables of times and of ratios measured in the same run. The
candidates of a table are timed in interleaved rounds (each candidate once per round, the median over
rounds), so a slow phase of the machine hits all of them alike. Beside each time: the achieved GFLOP/s and its
share of the machine's matmul peak, measured at start-up (one large square matmul in the tables' precision; on a
CPU in float32 the faster of torch's and oneDNN's: the physical limit of a layer made of matmuls). A layer's FLOPs
are those of its forward + backward as ``torch.utils.flop_counter`` counts them on moekit's implementation; a
reference implementation of the same layer is credited with the same FLOPs, so its GFLOP/s compare as speeds of one
computation.

    python scripts/bench_moe.py                  # every table (about 15 minutes on a 2-core CPU)
    python scripts/bench_moe.py --tables soft topk recipes --rounds 5
    python scripts/bench_moe.py --quick          # small shapes, a smoke run
    python scripts/bench_moe.py --device cuda --dtype bf16 --batch-scale 8   # a GPU: bf16 autocast, 8x the batch
    python scripts/bench_moe.py --tables topk --profile   # and where moekit's layers spend their time
    python scripts/bench_moe.py --tables dropout         # moekit's CPU dropout against torch's (no FLOPs columns)
    python scripts/bench_moe.py --tables products        # the expert products alone: what bounds them here
    python scripts/bench_moe.py --tables topk --choice 'AUTO_KERNELS[cpu,ragged]=grouped_mm'   # another kernel choice

``--choice`` sets entries of :mod:`moekit.moe.kernel_choices` for the run; the header names every entry that differs
from the table as shipped.

Optional references (``pip install -e .[bench]``): ``soft-moe-pytorch`` for Soft MoE and Hugging
Face ``transformers``' ``MixtralSparseMoeBlock`` (every experts implementation it offers) for top-2.
A missing reference is reported and skipped.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch
import torch.nn.functional as F
from timm.layers import Mlp, SwiGLU
from torch import nn

from moekit.analysis.bench_products import SOFT_SHAPES, TOPK_SHAPES, table_products
from moekit.analysis.layer_timing import Backend, Candidate, time_candidates, timed_step
from moekit.analysis.op_profile import print_top_operators
from moekit.analysis.peak import matmul_peak
from moekit.models.attention import attention_with_dropout
from moekit.models.flops import flop_counter
from moekit.moe import ExpertsChoiceMoE, SoftMoE, TopKMoE, build_moe_layer, kernel_choices
from moekit.moe.cpu_matmul import adopt_linears, float32_library
from moekit.moe.dropout import Dropout
from moekit.recipes import list_recipes, load_recipe, needs_token_ids, recipe_citation
from moekit.utils.allocator import active_allocator, add_allocator_argument, apply_allocator
from moekit.utils.machine import machine_info


def count_flops(candidate: Candidate, x: torch.Tensor, backend: Backend) -> int:
    """The forward + backward FLOPs of one step of ``candidate`` (``torch.utils.flop_counter``)."""
    with flop_counter() as counter:
        with backend.precision():
            y = candidate.forward(candidate.module, x)
        y.backward(torch.ones_like(y))
    for p in candidate.module.parameters():
        p.grad = None
    x.grad = None
    return counter.get_total_flops()


def table_flops(cands: list[Candidate], x: torch.Tensor, backend: Backend, same_as: dict[str, str]) -> dict[str, int]:
    """FLOPs of each candidate; those named in ``same_as`` (reference implementations) get the count of the
    candidate it maps them to."""
    flops = {c.name: count_flops(c, x, backend) for c in cands if c.name not in same_as}
    flops.update({name: flops[source] for name, source in same_as.items()})
    return flops


def print_table(title: str, rows: list[tuple[str, float]], baseline: str, flops: dict[str, int], peak: float) -> None:
    base = dict(rows)[baseline]
    print(f"\n### {title}\n")
    print(f"| layer | fwd+bwd ms | GFLOP/s | of peak | vs {baseline} |")
    print("|---|---:|---:|---:|---:|")
    for name, t in rows:
        rate = flops[name] / t
        print(f"| {name} | {t * 1e3:.1f} | {rate / 1e9:.1f} | {rate / peak:.0%} | {t / base:.2f}x |")
    sys.stdout.flush()


def profile_moekit(cands: list[Candidate], x: torch.Tensor, args, title: str) -> None:
    """With ``--profile``: where each moekit candidate's forward + backward spends its time."""
    if not args.profile:
        return
    for c in cands:
        if c.name.startswith("moekit"):
            with torch.no_grad(), args.backend.precision():
                grad = torch.randn_like(c.forward(c.module, x))
            print_top_operators(f"{c.name}, {title}", lambda c=c, g=grad: timed_step(c, x, g, args.backend), x.device)


# ---------------------------------------------------------------------------------------------
def table_soft(args) -> None:
    """Soft MoE at the ViT-S/16 shape, 128 slots in total, vs soft-moe-pytorch and the dense MLP."""
    (batch, tokens, dim, hidden, slots), expert_counts = SOFT_SHAPES[args.quick]
    batch *= args.batch_scale
    x = torch.randn(batch, tokens, dim, device=args.backend.device, requires_grad=True)
    try:
        from soft_moe_pytorch import SoftMoE as LucidSoftMoE
    except ImportError:
        LucidSoftMoE = None
        print("\n(soft-moe-pytorch not installed: pip install -e .[bench])")
    for experts in expert_counts:
        per = slots // experts
        ours = SoftMoE(dim, hidden, num_experts=experts, slots_per_expert=per)
        dense_same_flops = adopt_linears(Mlp(dim, round(hidden * slots / tokens)))
        cands = [
            Candidate("dense Mlp (same hidden)", adopt_linears(Mlp(dim, hidden))),
            Candidate(f"dense Mlp (same expert FLOPs, h={round(hidden * slots / tokens)})", dense_same_flops),
            Candidate("moekit SoftMoE", ours),
        ]
        ref = None
        if LucidSoftMoE is not None:
            ref = LucidSoftMoE(dim, num_experts=experts, num_slots=per, expert_mult=hidden // dim)
            cands.append(Candidate("soft-moe-pytorch SoftMoE", ref))
        t = time_candidates(cands, x, args.rounds, args.backend)
        flops = table_flops(cands, x, args.backend, {"soft-moe-pytorch SoftMoE": "moekit SoftMoE"} if ref else {})
        print_table(
            f"Soft MoE, {experts} experts x {per} slots, batch {batch} x {tokens} tokens, d={dim}, mlp {hidden}",
            [(c.name, t[c.name]) for c in cands if c.name in t],
            "moekit SoftMoE",
            flops,
            args.peak,
        )
        if "soft-moe-pytorch SoftMoE" in t:
            print(f"\nsoft-moe-pytorch / moekit: {t['soft-moe-pytorch SoftMoE'] / t['moekit SoftMoE']:.2f}x")
        profile_moekit(cands, x, args, f"{experts} experts x {per} slots")


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _mixtral_blocks(dim: int, hidden: int, experts: int, top_k: int, tokens: int, device: torch.device):
    try:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except ImportError:
        print("\n(transformers not installed: pip install -e .[bench])")
        return []
    blocks = []
    for impl in ("eager", "batched_mm", "grouped_mm"):
        # batched_mm gathers the 3 SwiGLU matrices of its expert for every routed token (float32), and
        # backward holds about twice that again: skip it where that cannot fit (the OOM killer would
        # end the whole benchmark, not raise).
        gathered = tokens * top_k * 3 * dim * hidden * 4
        if impl == "batched_mm" and 3 * gathered > _available_bytes(device):
            print(f"(Mixtral block, experts=batched_mm: skipped, needs ~{3 * gathered / 2**30:.0f} GiB)")
            continue
        config = MixtralConfig(
            hidden_size=dim,
            intermediate_size=hidden,
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            hidden_act="silu",
        )
        try:
            config._experts_implementation = impl
            block = MixtralSparseMoeBlock(config)
        except Exception as err:  # an implementation this transformers version lacks
            print(f"(MixtralSparseMoeBlock experts={impl}: {err})")
            continue
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, 0.02)
        blocks.append((impl, block))
    return blocks


def table_topk(args) -> None:
    """Tokens-choice top-2 SwiGLU experts vs Mixtral's block and the dense SwiGLU of equal active FLOPs."""
    (tokens, dim), shapes = TOPK_SHAPES[args.quick]
    tokens *= args.batch_scale
    x = torch.randn(1, tokens, dim, device=args.backend.device, requires_grad=True)
    for experts, hidden in shapes:
        cands = [
            Candidate(
                f"dense SwiGLU (h={2 * hidden}, same active FLOPs)", adopt_linears(SwiGLU(dim, 2 * hidden, bias=False))
            ),
            Candidate(
                "moekit TopKMoE",
                TopKMoE(
                    dim,
                    hidden,
                    num_experts=experts,
                    top_k=2,
                    normalize_gates=True,
                    gated=True,
                    act_layer=nn.SiLU,
                    bias=False,
                ),
            ),
        ]
        for impl, block in _mixtral_blocks(dim, hidden, experts, 2, tokens, args.backend.device):
            cands.append(Candidate(f"Mixtral block, experts={impl}", block))
        t = time_candidates(cands, x, args.rounds, args.backend)
        dense = cands[0].name
        cands = [c for c in cands if c.name in t]
        same = {c.name: "moekit TopKMoE" for c in cands if c.name.startswith("Mixtral")}
        print_table(
            f"Tokens-choice top-2, {experts} SwiGLU experts of hidden {hidden}, {tokens} tokens, d={dim} (dropless)",
            [(c.name, t[c.name]) for c in cands],
            dense,
            table_flops(cands, x, args.backend, same),
            args.peak,
        )
        mixtral = [t[c.name] for c in cands if c.name.startswith("Mixtral")]
        if mixtral:
            print(f"\nbest Mixtral block / moekit: {min(mixtral) / t['moekit TopKMoE']:.2f}x")
        print(f"moekit / dense: {t['moekit TopKMoE'] / t[dense]:.2f}x")
        profile_moekit(cands, x, args, f"{experts} experts of hidden {hidden}")


def table_recipes(args) -> None:
    """Every MoE recipe (:mod:`moekit.recipes`) as shipped, at one ViT-like shape, against the dense MLP it
    replaces; each row names the recipe's expert compute relative to that MLP (its comment line)."""
    batch, tokens, dim, hidden = (8, 196, 384, 1536) if not args.quick else (2, 49, 64, 256)
    batch *= args.batch_scale
    x = torch.randn(batch, tokens, dim, device=args.backend.device, requires_grad=True)
    ids = torch.randint(0, 1000, (batch, tokens), device=args.backend.device)
    cands = [Candidate("dense Mlp", adopt_linears(Mlp(dim, hidden)))]
    for name in list_recipes():
        spec = load_recipe(name)
        layer = build_moe_layer(
            name, in_features=dim, hidden_features=hidden, model_settings={"num_tokens": tokens, "vocab_size": 1000}
        )
        compute = re.search(r"expert compute ([0-9.]+x)", recipe_citation(name))
        label = f"{name} ({layer.experts.num_experts} experts, compute {compute.group(1) if compute else '?'})"
        forward = (lambda m, x: m(x, token_ids=ids)) if needs_token_ids(spec) else (lambda m, x: m(x))
        cands.append(Candidate(label, layer, forward))
    t = time_candidates(cands, x, args.rounds, args.backend)
    print_table(
        f"Every recipe as shipped, batch {batch} x {tokens} tokens, d={dim}, mlp {hidden}",
        [(c.name, t[c.name]) for c in cands],
        "dense Mlp",
        table_flops(cands, x, args.backend, {}),
        args.peak,
    )


def table_scaling(args) -> None:
    """Step time as experts grow at a fixed number of slots (Soft MoE) or fixed capacity (sparse)."""
    batch, tokens, dim, hidden = (8, 196, 384, 1536) if not args.quick else (2, 49, 64, 128)
    batch *= args.batch_scale
    slots = 128 if not args.quick else 16
    expert_counts = (8, 16, 32, 64, 128, 256) if not args.quick else (4, 8, 16)
    x = torch.randn(batch, tokens, dim, device=args.backend.device, requires_grad=True)
    print(f"\n### Scaling experts, batch {batch} x {tokens} tokens, d={dim}, expert mlp {hidden}\n")
    per_expert = {experts: max(1, slots // experts) for experts in expert_counts}  # at least one slot an expert
    more = [f"{experts * per} at {experts} experts" for experts, per in per_expert.items() if experts * per != slots]
    print(
        f"Soft MoE: {slots} slots in total, {slots} / experts for each expert"
        + (f" (at least one: {', '.join(more)})" if more else "")
        + "; tokens-choice top-1 and experts-choice: capacity factor 1.0 (total expert work fixed). Times are fwd+bwd "
        "ms; ratios are against the dense Mlp of the same run.\n"
    )
    print("| experts | dense Mlp | SoftMoE | TopKMoE top-1 cf1 | ExpertsChoice cf1 |")
    print("|---:|---:|---:|---:|---:|")
    for experts, per in per_expert.items():
        cands = [
            Candidate("dense", adopt_linears(Mlp(dim, hidden))),
            Candidate("soft", SoftMoE(dim, hidden, num_experts=experts, slots_per_expert=per)),
            Candidate("top1", TopKMoE(dim, hidden, num_experts=experts, top_k=1, capacity_factor=1.0)),
            Candidate("ec", ExpertsChoiceMoE(dim, hidden, num_experts=experts, capacity_factor=1.0)),
        ]
        t = time_candidates(cands, x, args.rounds, args.backend)
        d = t["dense"]
        cells = [f"{t[k] * 1e3:.1f} ({t[k] / d:.2f}x)" for k in ("soft", "top1", "ec")]
        print(f"| {experts} | {d * 1e3:.1f} | " + " | ".join(cells) + " |")
        sys.stdout.flush()
        del cands


def table_dropout(args) -> None:
    """moekit's dropout (:mod:`moekit.moe.dropout`) against torch's, on an activation and on attention probabilities
    (:func:`moekit.models.attention.attention_with_dropout` against ``F.scaled_dot_product_attention``)."""
    rows, width = (8192, 1024) if not args.quick else (256, 64)
    batch, heads, tokens, head_dim = (32, 4, 256, 64) if not args.quick else (2, 2, 32, 16)
    act = torch.randn(rows * args.batch_scale, width, device=args.backend.device, requires_grad=True)
    qkv = torch.randn(batch * args.batch_scale, heads, tokens, head_dim, device=args.backend.device, requires_grad=True)
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=qkv.device).tril()
    sdpa = F.scaled_dot_product_attention
    tables = [
        (
            f"Dropout 0.1 of a [{act.shape[0]}, {width}] activation",
            act,
            [
                Candidate("torch nn.Dropout", nn.Dropout(0.1)),
                Candidate("moekit Dropout", Dropout(0.1)),
            ],
        ),
        (
            f"Causal attention with dropout 0.1 on the probabilities, [{qkv.shape[0]}, {heads}, {tokens}, {head_dim}]",
            qkv,
            [
                Candidate(
                    "torch sdpa, dropout", nn.Identity(), lambda m, x: sdpa(x, x, x, is_causal=True, dropout_p=0.1)
                ),
                Candidate(
                    "moekit attention_with_dropout",
                    nn.Identity(),
                    lambda m, x: attention_with_dropout(x, x, x, causal, 0.1),
                ),
                Candidate("torch sdpa, no dropout", nn.Identity(), lambda m, x: sdpa(x, x, x, is_causal=True)),
            ],
        ),
    ]
    for title, x, cands in tables:
        t = time_candidates(cands, x, args.rounds, args.backend)
        base = t[cands[0].name]
        print(f"\n### {title}\n\n| kernel | fwd+bwd ms | vs {cands[0].name} |\n|---|---:|---:|")
        for c in cands:
            print(f"| {c.name} | {t[c.name] * 1e3:.1f} | {t[c.name] / base:.2f}x |")
    sys.stdout.flush()


TABLES = {
    "soft": table_soft,
    "topk": table_topk,
    "recipes": table_recipes,
    "scaling": table_scaling,
    "dropout": table_dropout,
    "products": table_products,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", nargs="+", choices=sorted(TABLES), default=list(TABLES))
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per table (median reported)")
    parser.add_argument("--quick", action="store_true", help="small shapes: a smoke run of the script")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: the forward under bf16 autocast"
    )
    parser.add_argument(
        "--batch-scale", type=int, default=1, help="multiply every table's batch (or token count) by this"
    )
    parser.add_argument(
        "--profile", action="store_true", help="after the soft and topk tables: where moekit's layers spend their time"
    )
    add_allocator_argument(parser)
    kernel_choices.add_choice_argument(parser)
    args = parser.parse_args(argv)
    kernel_choices.apply_choice_argument(parser, args)
    if args.batch_scale < 1:
        parser.error(f"--batch-scale must be a positive integer, got {args.batch_scale}")
    if args.rounds < 1:
        parser.error(f"--rounds must be a positive integer, got {args.rounds}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available (use --device cpu)")
    apply_allocator(args)
    torch.manual_seed(args.seed)
    args.backend = Backend(torch.device(args.device), torch.bfloat16 if args.dtype == "bf16" else None)
    machine = machine_info()
    where = f"GPU {machine['gpu']}" if args.device == "cuda" else f"{machine['cpu']} x{machine['cpu_cores']}"
    args.peak, peak_what = matmul_peak(args.backend.device, args.backend.autocast or torch.float32)
    print(
        f"# moekit layer benchmark: torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{where}, {'bf16 autocast' if args.dtype == 'bf16' else 'fp32'}, forward + backward, "
        f"batch x{args.batch_scale}, allocator: {active_allocator()}, OpenMP {machine['openmp_spin']}, kernel "
        f"choices: {kernel_choices.describe()}; matmul peak {args.peak / 1e9:.1f} GFLOP/s ({peak_what})"
    )
    if args.device == "cpu" and args.dtype == "fp32":
        library, why = float32_library()  # the peak above gives both libraries' rates here
        print(f"# moekit's and the dense layers' float32 products: {library} ({why}); the references': torch's")
    for name in args.tables:
        TABLES[name](args)


if __name__ == "__main__":
    main()
