#!/usr/bin/env bash
# The GPU check on a machine lent for a few minutes, from a copy of this checkout:
#
#     bash bench/gpu_check.sh OUT_DIR [BUDGET_S] [PARTS]
#
# Installs nothing: logitlab runs from this checkout (PYTHONPATH) with the machine's own python3,
# torch and triton, whatever their versions (never install another torch there). Writes to OUT_DIR:
# environment.txt (nvidia-smi, versions), gpu_check.log (the console and each part's output),
# gpu_check.json and gpu_check.md (the results). BUDGET_S (default 420) bounds the parts; the whole
# script ends within BUDGET_S + 100 s. PARTS: comma-separated (default all; see
# `python3 -m bench.gpu_check --help`). Back on a development machine,
# `python3 -m bench.gpu_check --publish OUT_DIR/gpu_check.json` writes the tables into
# docs/benchmarks.md.
set -u
out=${1:?usage: bash bench/gpu_check.sh OUT_DIR [BUDGET_S] [PARTS]}
budget=${2:-420}
parts=${3:-device,kernels,dist,attention,train,decode}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
cd "$root" || exit 2
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
    date -u
    nvidia-smi || echo "nvidia-smi: not available"
    python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
    python3 -c 'import triton; print("triton", triton.__version__)' || echo "triton: not installed"
} > "$out/environment.txt" 2>&1
# the parts log into gpu_check.log themselves; the console goes beside it
timeout --kill-after 10 $((${budget%.*} + 90)) \
    python3 -m bench.gpu_check --out "$out" --budget-s "$budget" --parts "$parts" 2>&1 | tee "$out/console.txt"
exit "${PIPESTATUS[0]}"
