#!/usr/bin/env bash
# Issue 49's measurements on a lent GPU machine (torch there; no onnxruntime-gpu, no compressed-tensors), in two
# back-to-back calls after the pieces (a warm machine is given back ~30 s after a call ends).
#
# Here, once (everything below is git-ignored through .git/info/exclude, never committed):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d /tmp/ortdl onnxruntime-gpu==1.31.1 \
#     compressed-tensors pydantic pydantic-core==<the pydantic's> annotated-types typing-inspection loguru
#   unzip every wheel into one folder; tar it | xz > site.tar.xz; split -b 54M into .devpieces/part*
#   cp -r ../shared/reference .devshared/      (the tests read ../shared; it does not travel)
# There:
#   one call per piece but the last (carry .devpieces/partXX):  mkdir -p /tmp/pieces && cp .devpieces/part* /tmp/pieces/
#   call A (carry the last piece and .devshared):  cp .devpieces/part* /tmp/pieces/; bash tools/gpu_bench.sh tests
#   call B:                                         bash tools/gpu_bench.sh bench
# Logs and tables land in $OUT (at most 8 files come back).
set -uo pipefail
step=${1:?usage: tools/gpu_bench.sh tests|bench}
out=${OUT:-/tmp/gpu-bench}
mkdir -p "$out"
if [ ! -d /tmp/site/onnxruntime ]; then
  mkdir -p /tmp/site && cat $(ls /tmp/pieces/part* | sort) | xz -dc -T0 | tar -x -C /tmp/site || exit 1
fi
[ -e ../shared ] || ln -s "$PWD/.devshared" ../shared
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

if [ "$step" = tests ]; then
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc
    python3 -c "import onnxruntime as o, torch; print('onnxruntime', o.__version__, o.get_available_providers(), '| torch', torch.__version__, torch.cuda.is_available())"
  } 2>&1 | tee "$out/gpu.txt"
  # the gpu-marked tests: every CUDA path against the CPU or the eager path
  timeout "${GPU_TESTS_S:-170}" python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 tests \
    --ignore=tests/export/test_genai_cuda.py 2>&1 | tee "$out/pytest-gpu.log" | tail -15
  # GPTQ's sweep: the baseline's eager loop against this checkout's eager and captured loops
  timeout "${SWEEP_S:-60}" python3 tools/gptq_sweep_speed.py --device cuda --repeat 5 --baseline .devbase/gptq_math_7cb8953.py 2>&1 | tee "$out/gptq-sweep-cuda.txt" | tail -8
  # startup: process start to the first batch, against onnxruntime's and torch's own imports
  [ -f tools/startup.py ] && timeout "${STARTUP_S:-90}" python3 tools/startup.py --device cuda --repeats 1 \
    --markdown "$out/startup-cuda.md" 2>&1 | tail -14
  # the activation pass's overhead per batch, against the floor and the tapped graph's bare runs
  [ -f tools/pass_overhead.py ] && timeout "${PASS_S:-90}" python3 tools/pass_overhead.py --device cuda \
    2>&1 | tee "$out/pass-overhead-cuda.txt" | tail -14
  exit 0
fi

# bench: the bench decoder at 512 samples (made by torch's exporter), then the 1.5B-shaped decoder (made without torch)
timeout "${BENCH_S:-330}" python3 tools/bench.py --device cuda --models bench-decoder --samples 512 --weight-schemes \
  --configs "onnxruntime inference (floor)" "graphcal minmax" "graphcal mse" "graphcal histogram_mse" \
  "graphcal percentile" "graphcal entropy" "graphcal GPTQ (W4A16)" "graphcal AWQ (W4A16)" \
  "onnxruntime inference of both models (eval floor)" "graphcal eval (W8A8_STATIC output)" \
  --markdown "$out/bench-cuda.md" 2>&1 | tee "$out/bench-cuda.log" | grep -E "^\|" | tail -14
if [ -f tools/make_decoder.py ]; then
  timeout 90 python3 tools/make_decoder.py --preset 1.5b --out /tmp/graphcal-large-decoder 2>&1 | tail -2
  timeout "${LARGE_S:-200}" python3 tools/bench.py --device cuda --models large-decoder --samples 64 --weight-schemes \
    --configs "onnxruntime inference (floor)" "graphcal minmax" "graphcal GPTQ (W4A16)" \
    --markdown "$out/bench-large-cuda.md" 2>&1 | tee "$out/bench-large-cuda.log" | grep -E "^\|" | tail -6
fi
