#!/usr/bin/env bash
# GPU check for pijax, for a machine with an NVIDIA GPU, jax (CUDA), flax, numba, orbax and
# no network; nothing is installed. Runs from a copy of the working tree:
#
#   bash scripts/gpu_check.sh                       # on the GPU machine (<= 5 minutes)
#   GPU_CHECK_CPU=1 bash scripts/gpu_check.sh       # CPU smoke test (or --cpu-smoke), ~1 min
#
# Steps (each under `timeout`, a failure does not stop the next one):
#   1. environment: python, jax, devices, package versions, nvidia-smi -L;
#   2. scripts/gpu_check_kernels.py: the Pallas sparse-FFN kernel vs its jnp reference at
#      SmolLM2 and LLaMA-7B FFN shapes, f32 and bf16, with timings (CPU smoke: --interpret on
#      the smallest shape);
#   3. scripts/gpu_check_hybrid.py: pijax's hybrid step (Pallas hot part + numba cold part)
#      vs the dense step, oracle mode at threshold 0 and with real thresholds, hot_ratio 0.3
#      and 1.0, then decode tok/s for dense / oracle / predictor (pijax.bench, -n 32 -r 2).
#      Model: PIJAX_BUNDLE, else PIJAX_GGUF, else pijax.formats.gguf.default_model_path(), else a
#      random llama built in-process (the table's "hybrid model" row says which).
# The last thing printed is a table (step | result | key number); exit 1 if any step failed.
#
# Environment: PYTHON (interpreter; default python3, or .venv/bin/python in CPU smoke mode),
# GPU_CHECK_TOTAL_S (overall budget, default 290), GPU_CHECK_OUT (folder for logs, default a
# temporary one), GPU_CHECK_MODEL=tiny|auto (tiny: skip the real-model search; the CPU smoke
# test defaults to tiny), GPU_CHECK_TINY_LAYERS (default 4), GPU_CHECK_EXTRA_PYTHONPATH
# (appended to PYTHONPATH, e.g. a folder holding the gguf package, which reading any GGUF needs).
set -u

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CPU="${GPU_CHECK_CPU:-0}"
for arg in "$@"; do
  case "$arg" in
    --cpu-smoke) CPU=1 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg (use --cpu-smoke or -h)" >&2; exit 2 ;;
  esac
done

TOTAL="${GPU_CHECK_TOTAL_S:-290}"
START=$SECONDS
OUT="${GPU_CHECK_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}"
mkdir -p "$OUT"
RESULTS="$OUT/results.tsv"
: > "$RESULTS"

if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"
elif [ "$CPU" = 1 ] && [ -x "$REPO_ROOT/.venv/bin/python" ]; then
  PY="$REPO_ROOT/.venv/bin/python"
elif command -v python3 >/dev/null 2>&1; then
  PY=python3
else
  PY=python
fi
export PYTHONPATH="$REPO_ROOT${GPU_CHECK_EXTRA_PYTHONPATH:+:$GPU_CHECK_EXTRA_PYTHONPATH}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [ "$CPU" = 1 ]; then
  export JAX_PLATFORMS=cpu
  # The real SmolLM2 (30 layers) takes ~3 min here on 2 cores; GPU_CHECK_MODEL=auto for it.
  export GPU_CHECK_MODEL="${GPU_CHECK_MODEL:-tiny}"
  MODE="CPU smoke"
else
  MODE="GPU"
fi
cd "$REPO_ROOT" || exit 1

row() {  # row STEP RESULT KEY: one line of the closing table
  printf '%s\t%s\t%s\t\n' "$1" "$2" "$3" >> "$RESULTS"
}

# Seconds a step may run: min(cap, what is left of the budget minus a reserve for the table).
budget() {
  local cap=$1 left=$((TOTAL - (SECONDS - START) - 5))
  if [ "$left" -lt "$cap" ]; then echo "$left"; else echo "$cap"; fi
}

banner() { printf '\n======== %s (%ds elapsed) ========\n' "$1" $((SECONDS - START)); }

# ---------------------------------------------------------------------------- 1. environment
banner "1. environment ($MODE, python: $PY)"
ENV_LOG="$OUT/env.log"
t=$(budget 60)
timeout "$t" "$PY" - "$CPU" 2>&1 <<'EOF' | tee "$ENV_LOG"
import importlib.metadata as md, platform, sys
cpu = sys.argv[1] == "1"
print("python", sys.version.split()[0], sys.executable, platform.platform())
for name in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "numpy",
             "numba", "orbax-checkpoint", "optax", "triton", "gguf", "sentencepiece",
             "tokenizers", "scipy", "ml_dtypes"):
  try:
    print(f"  {name} {md.version(name)}")
  except md.PackageNotFoundError:
    print(f"  {name} (not installed)")
import jax
print("jax", jax.__version__, "backend", jax.default_backend())
for d in jax.devices():
  print("  device", d.id, d.platform, d.device_kind)
kinds = sorted({d.device_kind for d in jax.devices()})
ok = cpu or jax.default_backend() == "gpu"
print("ENV_KEY", f"jax {jax.__version__}, {jax.default_backend()}: {', '.join(kinds)}")
sys.exit(0 if ok else 3)
EOF
rc=${PIPESTATUS[0]}
if command -v nvidia-smi >/dev/null 2>&1; then
  timeout 20 nvidia-smi -L 2>&1 | tee -a "$ENV_LOG"
  timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used \
    --format=csv 2>&1 | tee -a "$ENV_LOG"
else
  echo "nvidia-smi: not found" | tee -a "$ENV_LOG"
fi
key=$(sed -n 's/^ENV_KEY //p' "$ENV_LOG" | tail -n 1)
case $rc in
  0) row "environment" PASS "$key" ;;
  3) row "environment" FAIL "no GPU backend: $key" ;;
  124|137) row "environment" FAIL "timeout after ${t}s" ;;
  *) row "environment" FAIL "python/jax failed (rc=$rc)" ;;
esac

# ---------------------------------------------------------------------------- 2. kernels
banner "2. Pallas kernel check (scripts/gpu_check_kernels.py)"
KERNEL_LOG="$OUT/kernels.log"
if [ "$CPU" = 1 ]; then
  KARGS=(--interpret --shapes=tiny)
else
  KARGS=()
fi
t=$(budget 150)
if [ "$t" -lt 10 ]; then
  row "kernels" SKIP "out of time"
else
  timeout "$t" "$PY" scripts/gpu_check_kernels.py ${KARGS[@]+"${KARGS[@]}"} 2>&1 | tee "$KERNEL_LOG"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) row "kernels" PASS "" ;;
    124|137) row "kernels" FAIL "timeout after ${t}s" ;;
    *) row "kernels" FAIL "rc=$rc" ;;
  esac
fi

# ---------------------------------------------------------------------------- 3. hybrid step
banner "3. hybrid step (scripts/gpu_check_hybrid.py)"
HYBRID_LOG="$OUT/hybrid.log"
HARGS=(--results "$RESULTS" -n 32 -r 2)
[ "$CPU" = 1 ] && HARGS+=(--cpu-smoke)
t=$(budget 240)
if [ "$t" -lt 20 ]; then
  row "hybrid" SKIP "out of time"
else
  # The script skips its own later checks 15 s before the hard timeout.
  timeout "$t" "$PY" scripts/gpu_check_hybrid.py "${HARGS[@]}" --deadline $((t - 15)) \
    2>&1 | tee "$HYBRID_LOG"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) ;;
    1) grep -q $'\tFAIL\t' "$RESULTS" || row "hybrid" FAIL "rc=1" ;;
    124|137) row "hybrid" FAIL "timeout after ${t}s (rows above finished)" ;;
    *) row "hybrid" FAIL "crashed, rc=$rc (see $HYBRID_LOG)" ;;
  esac
fi

# ---------------------------------------------------------------------------- table
banner "done; logs in $OUT"
"$PY" scripts/gpu_check_report.py "$RESULTS" --kernel-log "$KERNEL_LOG"
rc=$?
if [ "$rc" -gt 1 ]; then  # The report itself failed: print the raw rows.
  printf '\n| step | result | key number |\n'
  cut -f1-3 "$RESULTS" | sed 's/\t/ | /g; s/^/| /; s/$/ |/'
  exit 1
fi
exit "$rc"
