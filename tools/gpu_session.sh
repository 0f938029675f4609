#!/usr/bin/env bash
# Issue 37's GPU checks as one prepared script for a short lease of a CUDA machine: the
# CUDA tests first (the timings of a wrong kernel mean nothing), then the benchmark suites
# of the GPU path: linear (hidden states -> DAPO loss at the issue's shapes, beside naive,
# cut-cross-entropy, Liger and the trainers' own fused heads), padding (issue 39:
# skip_padding at 0/50/75 % padding), rows (the row kernels' bytes / time against the copy
# bandwidth), logprobs, distill; then, time left, the kernel table of the 7B-scale step.
# (The tensor_parallel suite needs two GPUs: not run here.) Run from the repository root:
#
#   OUT=out bash tools/gpu_session.sh          # logs, results and the page under $OUT
#
# Needs torch with CUDA, triton, jaxtyping, einops, beartype, pytest and hypothesis. The
# peers' rows need their wheels, which an offline GPU machine cannot download: fetch them
# first and carry build/gpu-wheels along (they are installed under build/gpu-peers, on
# PYTHONPATH, with --no-deps; TRL's and verl's heads load without their training stacks,
# benchmarks/suites/_peer_modules.py):
#
#   pip download --no-deps -d build/gpu-wheels liger-kernel==0.8.5 \
#     cut-cross-entropy==25.1.1 trl==1.16.0 verl==0.9.1
#
# dapo_ops is imported from src/ (no install). The whole script keeps within TOTAL_S
# seconds (default 540: one device command may run 600); each step has its own limit
# (seconds, overridable; 0 skips it) and gets at most what is left, so a step that hangs
# or fails leaves the others' results: every suite is its own process and writes its
# record into $OUT/benchmarks.json (a copy of docs/benchmarks.json) as it ends. Copy that
# file to docs/, re-render with `python -m benchmarks.run --from-json docs/benchmarks.json`
# and `python -m benchmarks.summary`, and remove from benchmarks/pending.py what is now
# measured (tests/test_benchmarks_docs.py names it).
#
# A dry run on a CPU machine (syntax, the steps' plumbing, the suites at small shapes):
#   DEVICE=cpu QUICK=1 TESTS_S=0 PROFILE_S=0 OUT=build/gpu-dry bash tools/gpu_session.sh
set -uo pipefail
OUT=${OUT:-out}
TOTAL_S=${TOTAL_S:-540}
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:+--quick}
mkdir -p "$OUT"
PEERS=build/gpu-peers
export PYTHONPATH="$PWD/src:$PWD:$PWD/$PEERS${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

if compgen -G "build/gpu-wheels/*.whl" >/dev/null; then
  $py -m pip install -q --no-deps --no-index --upgrade --target "$PEERS" build/gpu-wheels/*.whl \
    2>&1 | tail -2
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
    --format=csv 2>&1
  $py -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, \
'| cuda', torch.version.cuda, '|', torch.cuda.get_device_name(0) if torch.cuda.is_available() \
else 'no CUDA device')"
  $py -c "from benchmarks.environment import peers; print('peers', peers())"
  git log -1 --format='commit %H %s' 2>/dev/null
  git status --short 2>/dev/null | head -20
} | tee "$OUT/env.txt"

skipped=""
step() {  # step NAME SECONDS COMMAND...: run it within its limit and what is left, log under $OUT
  local name=$1 limit=$2 left=$((TOTAL_S - SECONDS - 5))
  shift 2
  [ "$limit" = 0 ] && return 0
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    echo "== $name: skipped (a limit of $limit s; $left s left of TOTAL_S)"
    skipped="$skipped $name"
    return 0
  fi
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc in $((SECONDS - t0)) s (limit $limit s)"
  grep -E "passed|failed|error|FAILED|ERROR|Error" "$OUT/$name.log" | tail -12
}

# correctness first: every CUDA and Triton test of the GPU path, from the files present
# now (tests/test_devices.py runs each device test on cpu and, here, on cuda; the
# interpreter's `triton` cases of test_two_pass.py run on CPU tensors: TESTS_K=cuda skips
# them where the device time is short)
tests=()
for f in tests/test_devices.py tests/test_cuda.py tests/test_host_syncs.py \
  tests/test_two_pass.py tests/test_row_kernels.py tests/test_logprobs.py tests/test_compiled.py; do
  [ -f "$f" ] && tests+=("$f")
done
step tests "${TESTS_S:-120}" $py -m pytest -q -p no:cacheprovider -rs -k "${TESTS_K:-cuda or triton}" \
  "${tests[@]}"

cp docs/benchmarks.json "$OUT/benchmarks.json"
for suite in linear padding rows logprobs distill loss; do
  var="$(echo "$suite" | tr a-z A-Z)_S"
  case $suite in
    linear) limit=${!var:-200} ;; padding) limit=${!var:-60} ;; rows) limit=${!var:-100} ;;
    logprobs) limit=${!var:-90} ;; distill) limit=${!var:-60} ;;
    *) limit=${!var:-0} ;;  # loss: unchanged by issues 37 and 39
  esac
  # shellcheck disable=SC2086  # $QUICK: empty or one flag
  step "$suite" "$limit" $py -m benchmarks.run "$suite" --device "$DEVICE" $QUICK \
    --json "$OUT/benchmarks.json" --out-md "$OUT/benchmarks.md"
  grep -E "^\[.*\]     " "$OUT/$suite.log" 2>/dev/null | cut -c12-132 | tail -40
done

# where the 7B-scale step spends its time on the GPU, both memory settings (evidence for
# a missed target's reason; nothing is written to the docs)
for keep in true false; do
  step "profile_keep_$keep" "${PROFILE_S:-40}" $py -m benchmarks.profile_linear \
    --sizes 8192x4096x151936 --dtypes bf16 --backend triton --keep-logits "$keep"
  head -30 "$OUT/profile_keep_$keep.log" 2>/dev/null
done
if [ -n "$skipped" ]; then  # what a second device command would run (the others set to 0)
  echo "== not run for lack of time:$skipped; e.g. TESTS_S=0 LINEAR_S=0 OUT=out2 bash $0"
fi
