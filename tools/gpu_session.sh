#!/usr/bin/env bash
# The GPU checks, as one prepared script for a short lease of a CUDA machine: the CUDA
# tests, then the CUDA sections of the benchmark page. Run from the repository root:
#
#   OUT=out bash tools/gpu_session.sh          # logs, results and the page under $OUT
#
# Needs torch with CUDA, triton, jaxtyping, einops, beartype, pytest and hypothesis;
# Liger-Kernel (pip install --no-deps liger-kernel) for its rows. dapo_ops is imported
# from src/ (no install). Each step has its own time limit (seconds, overridable), so a
# step that hangs or fails leaves the others' results: every suite is its own process
# and writes its record into $OUT/benchmarks.json (a copy of docs/benchmarks.json) as it
# ends (a limit of 0 skips the suite). Copy that file to docs/ and re-render the page with
# `python -m benchmarks.run --from-json docs/benchmarks.json`.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
    --format=csv 2>&1
  $py -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, \
'| cuda', torch.version.cuda, '|', torch.cuda.get_device_name(0))"
} | tee "$OUT/env.txt"

step() {  # step NAME SECONDS COMMAND...: run it under a time limit, log under $OUT
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc in $((SECONDS - t0)) s (limit $limit s)"
  grep -E "passed|failed|error|FAILED|ERROR|Error" "$OUT/$name.log" | tail -12
}

[ "${TESTS_S:-150}" = 0 ] || step tests "${TESTS_S:-150}" $py -m pytest -q -p no:cacheprovider -rs -k cuda \
  tests/test_cuda.py tests/test_logprobs.py tests/test_compiled.py

# The linear kernels' spill-free tiles timed side by side (bf16, 2048x896x32000): the
# next choice of GPU_BLOCKS (benchmarks/tile_sweep.py; TILES_S=0 skips it).
[ "${TILES_S:-90}" = 0 ] || { step tiles "${TILES_S:-90}" $py -m benchmarks.tile_sweep; \
  grep -E "^[0-9]|ms" "$OUT/tiles.log" | head -30; }

cp docs/benchmarks.json "$OUT/benchmarks.json"
for suite in linear loss logprobs; do
  var="$(echo "$suite" | tr a-z A-Z)_S"
  [ "${!var:-200}" = 0 ] && continue  # LOGPROBS_S=0: skip that suite
  step "$suite" "${!var:-200}" $py -m benchmarks.run "$suite" --device cuda \
    --json "$OUT/benchmarks.json" --out-md "$OUT/benchmarks.md"
  grep -E "^\[.*\]     " "$OUT/$suite.log" | cut -c12-112 | tail -30
done
