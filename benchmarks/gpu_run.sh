#!/usr/bin/env bash
# Everything a GPU machine is for, in one command of at most 8 minutes:
#   1. install bf16opt (no network: pip install --no-deps --no-build-isolation -e .);
#   2. the GPU test modules, one pytest each, timed (a new kernel sample each run: the seed
#      is BF16OPT_GPU_SAMPLE_SEED, the epoch seconds unless set, and is printed);
#   3. benchmarks/gpu_step.py: every preset on one tensor, 64 tensors and GPT-2 small's 148,
#      beside torch's fused step and the memory-limit kernel, tracked and untracked;
#   4. benchmarks/offload_step.py (its last table is the real pipeline on CUDA).
# Before 3: benchmarks/offload_model.py (issue 38's model: the table, its trace) and its thread sweep.
# Figures go to files under ${OUT:-runs/gpu}: summary.txt, tests.txt, test_times.tsv,
# gpu_step.md, gpu_step.json, offload_step.txt, offload_model.txt (+ _trace.json) and
# offload_threads.txt.  Each stage has a time limit so the whole run stays within 8 minutes; a
# stage that runs out is reported as such.
#
#   bash benchmarks/gpu_run.sh
#   GPU_RUN_DRY=1 bash benchmarks/gpu_run.sh   # no GPU: no install, benchmarks as --dry-run
#   GPU_RUN_FULL_SUITE=1 ...                   # then the whole suite too (beyond the 8 minutes)
set -u

cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-runs/gpu}"
PYTHON="${PYTHON:-python}"
DRY="${GPU_RUN_DRY:-0}"
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
: > "$OUT_DIR/tests.txt"
printf 'module\tseconds\texit\n' > "$OUT_DIR/test_times.tsv"

START=$(date +%s)
TOTAL_BUDGET=480  # seconds for the whole run
export BF16OPT_GPU_SAMPLE_SEED="${BF16OPT_GPU_SAMPLE_SEED:-$START}"

say() { echo "$*" | tee -a "$SUMMARY"; }

# seconds left of the run's budget, less what later stages keep for themselves
left() { echo $(( TOTAL_BUDGET - ($(date +%s) - START) - $1 )); }

# run a stage under a time limit: stage NAME LIMIT LOGFILE COMMAND...
stage() {
  local name=$1 limit=$2 log=$3
  shift 3
  if (( limit < 5 )); then
    say "$name: skipped, the run's ${TOTAL_BUDGET} s are spent"
    return 124
  fi
  local t0 t1 rc
  t0=$(date +%s.%N)
  timeout --signal=TERM --kill-after=5 "$limit" "$@" >> "$log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  local seconds
  seconds=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  if (( rc == 124 || rc == 137 )); then
    say "$name: TIMED OUT after ${seconds} s (limit ${limit} s)"
  else
    say "$name: exit ${rc} in ${seconds} s"
  fi
  LAST_SECONDS=$seconds
  return $rc
}

say "bf16opt GPU run, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
say "kernel sample seed: BF16OPT_GPU_SAMPLE_SEED=$BF16OPT_GPU_SAMPLE_SEED"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
    || echo "nvidia-smi: not available"; } | sed 's/^/gpu: /' | tee -a "$SUMMARY"
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" \
  2>&1 | tee -a "$SUMMARY"
"$PYTHON" -c "import cupy; print('cupy', cupy.__version__)" 2>&1 | tail -1 | tee -a "$SUMMARY"

# 1. install (the machine has no network)
if [[ "$DRY" == 1 ]]; then
  say "install: skipped (GPU_RUN_DRY=1)"
else
  stage "install" 60 "$OUT_DIR/tests.txt" "$PYTHON" -m pip install --no-deps --no-build-isolation -e . \
    || say "install failed: see tests.txt"
fi

# 2. the GPU test modules, each timed; 240 s for all of them, whatever is left of it
GPU_TESTS=(
  "tests/test_cupy_gpu.py"
  "tests/test_distributed.py::test_one_process_fully_shard_equals_the_unsharded_run"
  "tests/test_offload_copies.py"
  "tests/test_backend_fallback.py"
)
TESTS_END=$(( $(date +%s) + 240 ))
for module in "${GPU_TESTS[@]}"; do
  limit=$(( TESTS_END - $(date +%s) ))
  echo "===== $module" >> "$OUT_DIR/tests.txt"
  stage "pytest $module" "$limit" "$OUT_DIR/tests.txt" \
    "$PYTHON" -m pytest -q -p no:xdist -p no:cacheprovider -rs --durations=10 "$module"
  rc=$?
  printf '%s\t%s\t%s\n' "$module" "${LAST_SECONDS:-0}" "$rc" >> "$OUT_DIR/test_times.tsv"
  tail -n 1 "$OUT_DIR/tests.txt" | sed 's/^/  /' | tee -a "$SUMMARY"
done

stage "offload_model.py" "$(( $(left 50) < 100 ? $(left 50) : 100 ))" "$OUT_DIR/offload_model.txt" "$PYTHON" benchmarks/offload_model.py --repeats 3 --warmup 1 --profile-steps 2 --trace "$OUT_DIR/offload_model_trace.json" $([[ "$DRY" == 1 ]] && echo --layers 2 --dim 256 --presets bf16 --repeats 1)
# issue 38: host threads for the offloaded update, every core vs one and two fewer (bf16)
stage "offload_model.py --thread-sweep" "$(( $(left 50) < 60 ? $(left 50) : 60 ))" "$OUT_DIR/offload_threads.txt" "$PYTHON" benchmarks/offload_model.py --presets bf16 --repeats 3 --warmup 1 --profile-steps 1 --no-torchao --thread-sweep $([[ "$DRY" == 1 ]] && echo --layers 2 --dim 256 --repeats 1)
# 3. the step benchmark (offload keeps 50 s for itself)
if [[ "$DRY" == 1 ]]; then
  STEP_ARGS=(--dry-run --log2-params 12 --shapes one,64 --rows "AdamW bf16,Lion" --repeats 2 --warmup 1)
else
  STEP_ARGS=()
fi
stage "gpu_step.py" "$(left 50)" "$OUT_DIR/summary.txt" \
  "$PYTHON" benchmarks/gpu_step.py "${STEP_ARGS[@]}" --out "$OUT_DIR"

# 4. the offload benchmark, small enough for what is left
if [[ "$DRY" == 1 ]]; then
  OFFLOAD_ARGS=(--log2-params 14 --repeats 1)
else
  OFFLOAD_ARGS=(--log2-params 23 --repeats 3)
fi
stage "offload_step.py" "$(left 0)" "$OUT_DIR/offload_step.txt" \
  "$PYTHON" benchmarks/offload_step.py "${OFFLOAD_ARGS[@]}"

say "total: $(( $(date +%s) - START )) s (budget ${TOTAL_BUDGET} s); files in $OUT_DIR"

if [[ "${GPU_RUN_FULL_SUITE:-0}" == 1 ]]; then
  say "whole suite (GPU_RUN_FULL_SUITE=1, beyond the budget):"
  "$PYTHON" -m pytest -q -n auto -rs tests > "$OUT_DIR/suite.txt" 2>&1
  say "  exit $? -- $(tail -n 1 "$OUT_DIR/suite.txt")"
fi
