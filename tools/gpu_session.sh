#!/usr/bin/env bash
# The GPU checks, as one prepared script for a short lease of a CUDA machine: the CUDA
# tests, then the CUDA sections of the benchmark page, then the linear kernels' tile sweep.
# Run from the repository root:
#
#   OUT=out bash tools/gpu_session.sh          # logs, results and the page under $OUT
#
# Needs torch with CUDA, triton, jaxtyping, einops, beartype, pytest and hypothesis.
# The peers' rows need their wheels, which an offline GPU machine cannot download: fetch
# them here first and carry build/gpu-wheels along (the script installs whatever is there):
#
#   pip download --no-deps -d build/gpu-wheels liger-kernel==0.8.5 cut-cross-entropy==25.1.1
#
# dapo_ops is imported from src/ (no install). The whole script keeps within TOTAL_S
# seconds (default 540: a device command may run 600); each step has its own limit too
# (seconds, overridable; 0 skips it) and gets at most what is left, so a step that hangs
# or fails leaves the others' results: every suite is its own process and writes its
# record into $OUT/benchmarks.json (a copy of docs/benchmarks.json) as it ends. Copy that
# file to docs/ and re-render the page with
# `python -m benchmarks.run --from-json docs/benchmarks.json`.
set -uo pipefail
OUT=${OUT:-out}
TOTAL_S=${TOTAL_S:-540}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

if compgen -G "build/gpu-wheels/*.whl" >/dev/null; then
  $py -m pip install -q --no-deps --no-index build/gpu-wheels/*.whl 2>&1 | tail -2
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
    --format=csv 2>&1
  $py -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, \
'| cuda', torch.version.cuda, '|', torch.cuda.get_device_name(0))"
  $py -c "from benchmarks.environment import peers; print('peers', peers())"
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

# correctness first: the timings of a wrong kernel mean nothing
step tests "${TESTS_S:-150}" $py -m pytest -q -p no:cacheprovider -rs -k cuda \
  tests/test_cuda.py tests/test_logprobs.py tests/test_compiled.py

cp docs/benchmarks.json "$OUT/benchmarks.json"
for suite in linear loss logprobs; do
  var="$(echo "$suite" | tr a-z A-Z)_S"
  case $suite in linear) limit=${!var:-200} ;; *) limit=${!var:-120} ;; esac
  step "$suite" "$limit" $py -m benchmarks.run "$suite" --device cuda \
    --json "$OUT/benchmarks.json" --out-md "$OUT/benchmarks.md"
  grep -E "^\[.*\]     " "$OUT/$suite.log" 2>/dev/null | cut -c12-112 | tail -40
done

# The linear kernels' spill-free tiles timed kernel by kernel (bf16; 2048x896x32000, then
# the 7B-scale shape): the next choice of GPU_TILES (benchmarks/tile_sweep.py).
step tiles "${TILES_S:-60}" $py -m benchmarks.tile_sweep
cat "$OUT/tiles.log" 2>/dev/null | tail -16
step tiles_7b "${TILES_7B_S:-60}" $py -m benchmarks.tile_sweep --shape 8192x4096x151936 --repeats 5
cat "$OUT/tiles_7b.log" 2>/dev/null | tail -16
if [ -n "$skipped" ]; then  # what a second device command would run (the others set to 0)
  echo "== not run for lack of time:$skipped; e.g. TESTS_S=0 LINEAR_S=0 OUT=out2 bash $0"
fi
