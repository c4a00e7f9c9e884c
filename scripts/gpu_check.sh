#!/usr/bin/env bash
# The GPU check (`make gpu-check`), for a CUDA machine without network: the GPU test tier, then the layer and model
# benchmarks on the GPU (with --profile: where each step spends its time), all written to one markdown report (default
# docs/gpu_report.md; GPU_REPORT=<path>).
# It runs the machine's own python3 and PyTorch; what that image lacks comes from `make gpu-bundle`, made beforehand
# on a machine with network: wheels in .whl/ (installed to a private folder) and Fashion-MNIST in data/fashion-mnist/.
# GPU_CHECK_SECTION_TIMEOUT=<seconds> bounds each of the four sections (0, the default: no bound), so that a lease
# of fixed length still brings back the report of every section.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# GPU_CHECK_SECTIONS="compiled layers" runs some of the sections (default: all four), e.g. to split the check over
# two leases; the report then holds those alone.
SECTIONS="tier models compiled layers"
for name in ${GPU_CHECK_SECTIONS:-$SECTIONS}; do
    [[ " $SECTIONS " == *" $name "* ]] || { echo "GPU_CHECK_SECTIONS: no section '$name'; choose from: $SECTIONS" >&2; exit 2; }
done
wants() { [[ " ${GPU_CHECK_SECTIONS:-$SECTIONS} " == *" $1 "* ]]; }
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/moekit-site .whl/*.whl
    export PYTHONPATH=/tmp/moekit-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
"$PY" - <<'PYEOF'
try:
    import torch
except ImportError:
    raise SystemExit("make gpu-check runs python3 with its own PyTorch, and this one has none; PYTHON=<a python "
                     "with torch> make gpu-check") from None
if not torch.cuda.is_available():
    raise SystemExit("make gpu-check needs a CUDA device (torch.cuda.is_available() is False); on a CPU run make test")
PYEOF
report=${GPU_REPORT:-docs/gpu_report.md}
# The tier's tests in 4 processes where pytest-xdist is installed: most of their time is imports and compilation.
workers=$("$PY" -c 'import xdist' 2>/dev/null && echo "-n 4 --dist worksteal" || true)
section() {  # one section, bounded; says how long it took (to size the bound for a lease)
    local start=$SECONDS rc=0
    timeout --kill-after=10 "${GPU_CHECK_SECTION_TIMEOUT:-0}" "$@" || rc=$?
    echo "(this section: $((SECONDS - start)) s$([ "$rc" -eq 124 ] && echo ', stopped at its bound' || true))"
    return "$rc"
}
mkdir -p "$(dirname "$report")"
set +e  # a failed section fails the check, after the report is written
(
    status=0
    echo "# GPU check"
    echo
    echo "\`make gpu-check\` on $("$PY" -c 'import torch; print(torch.cuda.get_device_name())'), torch" \
        "$("$PY" -c 'import torch; print(torch.__version__)'), $(date -u +%Y-%m-%d)."
    echo
    if wants tier; then
        echo "## Test tier (tests/test_gpu.py)"
        echo
        echo '```'
        section "$PY" -m pytest -q -m gpu $workers -p no:cacheprovider -p no:warnings -p no:benchmark --tb=short \
            --durations=10 tests/test_gpu.py 2>&1 | tail -n 80 || status=1
        echo '```'
        echo
    fi
    if wants models; then
        echo "## Models: one training step against the dense twin (Soft MoE S/16 against ViT-S/16 first)"
        echo
        section "$PY" scripts/bench_models.py --device cuda --groups s16 vit lm --rounds 3 --profile 2>&1 || status=1
        echo
    fi
    if wants compiled; then
        # Batch 512: Soft MoE S/16's update of 923M parameters bounds its MFU at 128 (docs/performance.md#gpu)
        echo "## Compiled: Soft MoE S/16 and ViT-S/16 at batch 512, eager and task.compile=true in the same rounds"
        echo
        section "$PY" scripts/bench_models.py --device cuda --groups s16 --batch-size 512 \
            --sweep task.compile=false,true --rounds 3 2>&1 || status=1
        echo
    fi
    if wants layers; then
        echo "## Layers: bf16 autocast, forward + backward, batches x8"
        echo
        section "$PY" scripts/bench_moe.py --device cuda --dtype bf16 --batch-scale 8 --rounds 3 --profile 2>&1 || status=1
        echo
    fi
    exit $status
) | tee "$report"
status=${PIPESTATUS[0]}
set -e
echo "wrote $report"
exit "$status"
