#!/usr/bin/env bash
# GPU checks on a lent GPU machine that has torch but neither onnxruntime-gpu nor compressed-tensors.
#
# Here, once (the pieces and wheels are git-ignored):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d .ortgpu onnxruntime-gpu==1.31.1
#   for each 55 MB piece k of `split -b 55M` the wheel: .ortgpuk/part (a call carries at most 64 MiB with the tree)
#   pip download --no-deps ... -d .whl compressed-tensors pydantic pydantic-core annotated-types \
#     typing-inspection loguru          (the same --python-version/--platform flags)
#   pip download --no-deps ... -d .genaiwhl onnxruntime-genai-cuda==0.18.0 onnx-ir==1.1.0
# There, one call per piece (carry .ortgpuk): mkdir -p /tmp/ortgpu && cp .ortgpuk/part /tmp/ortgpu/partk
# and the last call (carry .whl, .genaiwhl and the last piece):
#   bash tools/gpu_check.sh onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
# A warm machine is given back ~30 s after a call ends: make the calls back to back.
#
# It installs the wheels into /tmp/site (first on PYTHONPATH, so onnxruntime-gpu shadows the image's CPU
# onnxruntime), runs the gpu-marked tests (tests/export/test_genai_cuda.py among them: the builder's CUDA fp16
# model quantized on the GPU, generated with by onnxruntime-genai-cuda on CUDA) and tools/genai_speed.py
# (decode speed in onnxruntime-genai's loop on CUDA, graphcal's int4 against the builder's), and leaves
# logs and tables in $OUT. Each step has its own time limit (GENAI_TESTS_S, GENAI_SPEED_S, GPU_TESTS_S).
set -uo pipefail
wheel_name=${1:?usage: tools/gpu_check.sh ONNXRUNTIME_GPU_WHEEL_FILE_NAME}
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
if [ ! -d /tmp/site/onnxruntime ]; then
  cat $(ls /tmp/ortgpu/part* | sort) > "/tmp/$wheel_name" || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "/tmp/$wheel_name" \
    .whl/*.whl $(ls .genaiwhl/*.whl 2>/dev/null) || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 - <<'PY' 2>&1 | tee -a "$out/gpu.txt"
import onnxruntime as ort, torch
print("onnxruntime", ort.__version__, ort.get_available_providers(), "| torch", torch.__version__, torch.cuda.is_available())
try:
    import onnx_ir, onnxruntime_genai as og, transformers
    print("onnxruntime-genai", og.__version__, "| onnx_ir", onnx_ir.__version__, "| transformers", transformers.__version__)
except ImportError as e:
    print("onnxruntime-genai:", e)
PY
# the builder's CUDA model, quantized on the GPU and generated with on CUDA; then its speed; then the other GPU tests
timeout "${GENAI_TESTS_S:-150}" python3 -m pytest -q -s -p no:cacheprovider tests/export/test_genai_cuda.py 2>&1 \
  | tee "$out/pytest-genai-cuda.log" | grep -E " dB|passed|failed|rror" | tail -20
# decode speed in onnxruntime-genai's loop on CUDA: graphcal's int4 against the builder's int4
timeout "${GENAI_SPEED_S:-200}" python3 -m tools.genai_speed --provider cuda --work /tmp/genai-speed \
  --markdown "$out/genai-speed-cuda.md" --json "$out/genai-speed-cuda.json" 2>&1 | tee "$out/genai-speed.log" | tail -12
timeout "${GPU_TESTS_S:-180}" python3 -m pytest -q -m gpu -p no:cacheprovider tests --ignore=tests/export/test_genai_cuda.py \
  2>&1 | tee "$out/pytest-gpu.log" | tail -15
# each scheme's form against fp32 on CUDA at onnxruntime's default settings (docs/speed-cuda.md; a call of its own):
#   timeout 480 python3 tools/speed_table.py --device cuda --models tiny-llama tiny-bert bench-decoder --rounds 20 \
#     --work /tmp/graphcal-speed --markdown "$out/speed-cuda.md" --json "$out/speed-cuda.json"
