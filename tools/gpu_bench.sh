#!/usr/bin/env bash
# Issue 49's measurements on a lent GPU machine (torch there; no onnxruntime-gpu, no compressed-tensors), in five
# back-to-back calls: a warm machine is given back ~30 s after a call ends, and /tmp survives between calls.
#
# Here, once (everything below is git-ignored through .git/info/exclude, never committed):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d /tmp/ortdl onnxruntime-gpu==1.31.1 \
#     compressed-tensors pydantic pydantic-core==<pydantic's> annotated-types typing-inspection loguru
#   unzip every wheel into one folder; tar it | xz > site.tar.xz; split -b 52000000 -d into .devpieces/partNN
#   (four pieces: a call carries at most 64 MiB with the tree)
#   cp -r ../shared/reference .devshared/        (the tests read ../shared, which does not travel)
#   git show 7cb8953:graphcal/algorithms/gptq/math.py > .devbase/gptq_math_7cb8953.py   (no git history there)
# There, each call carrying what it names:
#   1. (.devpieces/part00)  bash tools/gpu_bench.sh piece; bash tools/gpu_bench.sh make-bench
#   2. (.devpieces/part01)  bash tools/gpu_bench.sh piece; bash tools/gpu_bench.sh make-large
#   3. (.devpieces/part02)  bash tools/gpu_bench.sh piece
#   4. (.devpieces/part03 .devshared .devbase)  bash tools/gpu_bench.sh piece; bash tools/gpu_bench.sh tests
#   5. bash tools/gpu_bench.sh bench
# Logs and tables land in $OUT (at most 8 files come back).
set -uo pipefail
step=${1:?usage: tools/gpu_bench.sh piece|make-bench|make-large|tests|bench}
out=${OUT:-/tmp/gpu-bench}
mkdir -p "$out"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
case "$step" in
  piece)  # this call's piece of the site folder
    mkdir -p /tmp/pieces && cp .devpieces/part* /tmp/pieces/ && ls -la /tmp/pieces | tail -4
    exit 0 ;;
  make-bench)  # the bench decoder, made by torch's exporter as before (bench.py would make it too)
    time timeout "${MAKE_S:-120}" python3 tools/make_models.py --bench-decoder /tmp/graphcal-bench-decoder 2>&1 | tail -2
    exit 0 ;;
  make-large)  # the 1.5B-shaped decoder, made without torch (tools/make_decoder.py)
    time timeout "${MAKE_S:-120}" python3 tools/make_decoder.py --preset 1.5b --out /tmp/graphcal-large-decoder 2>&1 | tail -2
    exit 0 ;;
esac
if [ ! -d /tmp/site/onnxruntime ]; then
  mkdir -p /tmp/site && cat $(ls /tmp/pieces/part* | sort) | xz -dc -T0 | tar -x -C /tmp/site || exit 1
fi
[ -e ../shared ] || ln -s "$PWD/.devshared" ../shared

if [ "$step" = tests ]; then
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc
    python3 -c "import onnxruntime as o, torch; print('onnxruntime', o.__version__, o.get_available_providers(), '| torch', torch.__version__, torch.cuda.is_available())"
  } 2>&1 | tee "$out/gpu.txt"
  # the gpu-marked tests of the CUDA paths (issues 47-49): each CUDA path against the CPU or the eager path
  timeout "${GPU_TESTS_S:-120}" python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 \
    tests/algorithms/test_gptq_sweep.py tests/algorithms/test_awq_device.py tests/evaluation/test_eval_device.py \
    tests/calibration/test_pass_syncs.py tests/calibration/test_cuda.py tests/output/test_bf16_models.py \
    tests/evaluation/test_next_token_loss.py tests/evaluation/test_mix_by_kl.py tests/calibration/test_rotation_streamed.py \
    tests/calibration/test_streamed_pass.py 2>&1 | tee "$out/pytest-gpu.log" | tail -15
  # GPTQ's sweep: the baseline's eager loop against this checkout's eager and captured loops
  timeout "${SWEEP_S:-40}" python3 tools/gptq_sweep_speed.py --device cuda --repeat 3 \
    --baseline .devbase/gptq_math_7cb8953.py 2>&1 | tee "$out/gptq-sweep-cuda.txt" | tail -6
  # startup: process start to the first batch, against onnxruntime's and torch's own imports
  timeout "${STARTUP_S:-70}" python3 tools/startup.py --device cuda --repeats 1 \
    --markdown "$out/startup-cuda.md" 2>&1 | tail -12
  exit 0
fi

# bench: the bench decoder at 512 samples, the pass's overhead per batch, then the 1.5B-shaped decoder
timeout "${BENCH_S:-270}" python3 tools/bench.py --device cuda --models bench-decoder --samples 512 --weight-schemes \
  --configs "onnxruntime inference (floor)" "graphcal minmax" "graphcal mse" "graphcal histogram_mse" \
  "graphcal percentile" "graphcal GPTQ (W4A16)" "graphcal AWQ (W4A16)" \
  "onnxruntime inference of both models (eval floor)" "graphcal eval (W8A8_STATIC output)" \
  --markdown "$out/bench-cuda.md" 2>&1 | tee "$out/bench-cuda.log" | grep -E "^\|" | tail -10
timeout "${PASS_S:-45}" python3 tools/pass_overhead.py --model bench-decoder --samples 512 --device cuda \
  2>&1 | tee "$out/pass-overhead-cuda.txt" | tail -8
timeout "${LARGE_S:-110}" python3 tools/bench.py --device cuda --models large-decoder --samples 64 --weight-schemes \
  --configs "onnxruntime inference (floor)" "graphcal minmax" "graphcal GPTQ (W4A16)" \
  --markdown "$out/bench-large-cuda.md" 2>&1 | tee "$out/bench-large-cuda.log" | grep -E "^\|" | tail -4
