#!/usr/bin/env bash
# Everything a GPU machine is for, in two commands of at most 8 and 3 minutes (a device lease is
# 15 minutes, its start included):
#
#   bash benchmarks/gpu_run.sh                 # part 1, issues 37 and 38 (8 minutes):
#     1. install bf16opt (no network: pip install --no-deps --no-build-isolation -e .; where
#        that fails, the checkout's cuda_src/ and cpu_src/ are linked where the install maps them);
#     2. the GPU test modules, one pytest each, timed (a new kernel sample each run: the seed
#        is BF16OPT_GPU_SAMPLE_SEED, the epoch seconds unless set, and is printed);
#     3. benchmarks/gpu_step.py: every preset on one tensor, 64 tensors and GPT-2 small's 148,
#        beside torch's fused step and the memory-limit kernel, tracked and untracked;
#     4. benchmarks/offload_model.py: issue 38's model (the table, its trace, then the host
#        threads: every core, one and two fewer).
#   GPU_RUN_PART=2 bash benchmarks/gpu_run.sh  # part 2, issues 39 and 40 (3 minutes):
#     5. benchmarks/release_model.py: update in backward on issue 38's model (peak GPU memory,
#        exposed step), normal vs release, state on the device and offloaded;
#     6. benchmarks/q8_step.py on the host's cores: fp32-remainder-q8's host update against
#        bf16-states' (issue 40).
#
# Figures go to files under ${OUT:-runs/gpu} (the device run brings back at most 8):
#   part 1: summary.txt, tests.txt, gpu_step.md, gpu_step.json, offload.txt, offload_trace.json;
#   part 2: summary2.txt, release.txt, q8_host.txt.
# Each stage has a time limit so the whole part stays within its budget; a stage that runs out
# is reported as such (and keeps what it printed: Python's output is unbuffered).
#
#   GPU_RUN_DRY=1 bash benchmarks/gpu_run.sh   # no GPU: no install, small sizes, --dry-run
#   GPU_RUN_FULL_SUITE=1 ...                   # part 1, then the whole suite too (beyond the 8 minutes)
set -u

cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-runs/gpu}"
PYTHON="${PYTHON:-python3}"  # (the device image's interpreter that holds torch)
DRY="${GPU_RUN_DRY:-0}"
PART="${GPU_RUN_PART:-1}"
export PYTHONUNBUFFERED=1  # a stage stopped by its time limit keeps what it printed
mkdir -p "$OUT_DIR"
if [[ "$PART" == 2 ]]; then
  SUMMARY="$OUT_DIR/summary2.txt"
  TOTAL_BUDGET=180
else
  SUMMARY="$OUT_DIR/summary.txt"
  TOTAL_BUDGET=480
  : > "$OUT_DIR/tests.txt"
fi
: > "$SUMMARY"

START=$(date +%s)
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

say "bf16opt GPU run, part $PART, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
say "kernel sample seed: BF16OPT_GPU_SAMPLE_SEED=$BF16OPT_GPU_SAMPLE_SEED"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
    || echo "nvidia-smi: not available"; } | sed 's/^/gpu: /' | tee -a "$SUMMARY"
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" \
  2>&1 | tee -a "$SUMMARY"
"$PYTHON" -c "import cupy; print('cupy', cupy.__version__)" 2>&1 | tail -1 | tee -a "$SUMMARY"
"$PYTHON" -c "import numba, numpy; print('numba', numba.__version__, 'numpy', numpy.__version__)" 2>&1 | tail -1 \
  | tee -a "$SUMMARY"

# 1. install (the machine has no network)
if [[ "$DRY" == 1 ]]; then
  say "install: skipped (GPU_RUN_DRY=1)"
else
  stage "install" 60 "$SUMMARY" "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . \
    || say "install failed (its output above)"
  if ! "$PYTHON" -c "import bf16opt._cuda, bf16opt._cpu" 2>/dev/null; then
    ln -sfn ../cuda_src bf16opt/_cuda && ln -sfn ../cpu_src bf16opt/_cpu  # (what the install maps)
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"                   # (benchmarks/ scripts)
    say "bf16opt not installed: cuda_src/ and cpu_src/ linked from the checkout"
  fi
fi
"$PYTHON" -c "from bf16opt.backends import numba; print('bf16opt numba backend available:', numba.available())" \
  2>&1 | tail -1 | tee -a "$SUMMARY"

if [[ "$PART" == 2 ]]; then
  # 5. update in backward on the offload model (issue 39): peak GPU memory and exposed step
  stage "release_model.py" "$(( $(left 60) < 110 ? $(left 60) : 110 ))" "$OUT_DIR/release.txt" \
    "$PYTHON" benchmarks/release_model.py --presets bf16 --repeats 3 --warmup 1 \
    $([[ "$DRY" == 1 ]] && echo --layers 2 --dim 256 --repeats 1 --no-clipping)
  # 6. the host update of fp32-remainder-q8 against bf16-states on every core (issue 40)
  stage "q8_step.py" "$(left 0)" "$OUT_DIR/q8_host.txt" \
    "$PYTHON" benchmarks/q8_step.py --presets bf16-states,fp32-remainder-q8 --steps-only --repeats 7 \
    --log2-params "$([[ "$DRY" == 1 ]] && echo 14 || echo 27)"
  say "total: $(( $(date +%s) - START )) s (budget ${TOTAL_BUDGET} s); files in $OUT_DIR"
  exit 0
fi

# 2. the GPU test modules, each timed; 200 s for all of them, whatever is left of it
GPU_TESTS=(
  "tests/test_cupy_gpu.py"
  "tests/test_distributed.py::test_one_process_fully_shard_equals_the_unsharded_run"
  "tests/test_offload_copies.py"
  "tests/test_backend_fallback.py"
)
TESTS_END=$(( $(date +%s) + 200 ))
for module in "${GPU_TESTS[@]}"; do
  limit=$(( TESTS_END - $(date +%s) ))
  echo "===== $module" >> "$OUT_DIR/tests.txt"
  stage "pytest $module" "$limit" "$OUT_DIR/tests.txt" \
    "$PYTHON" -m pytest -q -p no:xdist -p no:cacheprovider -rs --durations=10 "$module"
  say "  time $module ${LAST_SECONDS:-0} s: $(tail -n 1 "$OUT_DIR/tests.txt")"
done

# 3. the step benchmark (issue 37), at most 110 s, keeping 110 s for the offload model
if [[ "$DRY" == 1 ]]; then
  STEP_ARGS=(--dry-run --log2-params 12 --shapes one,64 --rows "AdamW bf16,Lion" --repeats 2 --warmup 1)
else
  STEP_ARGS=()
fi
stage "gpu_step.py" "$(( $(left 110) < 110 ? $(left 110) : 110 ))" "$SUMMARY" \
  "$PYTHON" benchmarks/gpu_step.py "${STEP_ARGS[@]}" --out "$OUT_DIR"

# 4. issue 38's model: the table and its trace, then the host threads
if [[ "$DRY" == 1 ]]; then
  MODEL_ARGS=(--layers 2 --dim 256 --presets bf16 --repeats 1)
else
  MODEL_ARGS=(--repeats 3 --warmup 1)
fi
stage "offload_model.py" "$(left 0)" "$OUT_DIR/offload.txt" "$PYTHON" benchmarks/offload_model.py \
  --profile-steps 1 --trace "$OUT_DIR/offload_trace.json" --thread-sweep "${MODEL_ARGS[@]}"

say "total: $(( $(date +%s) - START )) s (budget ${TOTAL_BUDGET} s); files in $OUT_DIR"

if [[ "${GPU_RUN_FULL_SUITE:-0}" == 1 ]]; then
  say "whole suite (GPU_RUN_FULL_SUITE=1, beyond the budget):"
  "$PYTHON" -m pytest -q -n auto -rs tests > "$OUT_DIR/suite.txt" 2>&1
  say "  exit $? -- $(tail -n 1 "$OUT_DIR/suite.txt")"
fi
