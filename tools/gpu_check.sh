#!/usr/bin/env bash
# GPU checks on a lent GPU machine that has torch but neither onnxruntime-gpu nor compressed-tensors.
#
# Here, once (the pieces and wheels are git-ignored):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d .ortgpu onnxruntime-gpu==1.31.1
#   for each 50 MB piece k of `split -b 50M` the wheel: .ortgpuk/part (a call carries at most 64 MiB with the tree)
#   pip download --no-deps ... -d .whl compressed-tensors pydantic pydantic-core annotated-types \
#     typing-inspection loguru          (the same --python-version/--platform flags)
# There, one call per piece (carry .ortgpuk): mkdir -p /tmp/ortgpu && cp .ortgpuk/part /tmp/ortgpu/partk
# and the last call (carry .whl and the last piece):
#   bash tools/gpu_check.sh onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
# A warm machine is given back ~30 s after a call ends: make the calls back to back.
#
# It installs the wheels into /tmp/site (first on PYTHONPATH, so onnxruntime-gpu shadows the image's CPU
# onnxruntime), runs the gpu-marked tests and tools/speed_table.py on CUDA (every scheme's form against
# fp32 at onnxruntime's default settings), and leaves logs and tables in $OUT.
set -uo pipefail
wheel_name=${1:?usage: tools/gpu_check.sh ONNXRUNTIME_GPU_WHEEL_FILE_NAME}
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
cat $(ls /tmp/ortgpu/part* | sort) > "/tmp/$wheel_name" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "/tmp/$wheel_name" .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 - <<'EOF' 2>&1 | tee -a "$out/gpu.txt"
import onnxruntime as ort, torch
print("onnxruntime", ort.__version__, ort.get_available_providers(), "| torch", torch.__version__, torch.cuda.is_available())
EOF
python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$out/pytest-gpu.log" | tail -30
# onnxruntime on CUDA at its default settings: each scheme's form against fp32 (graphcal bench)
timeout 480 python3 tools/speed_table.py --device cuda --models tiny-llama tiny-bert bench-decoder --rounds 20 \
  --work /tmp/graphcal-speed --markdown "$out/speed-cuda.md" --json "$out/speed-cuda.json" 2>&1 | tail -40
# calibration cost on CUDA (a call of its own: it does not fit beside the above in one 10-minute call):
#   python3 tools/bench.py --device cuda --models tiny-llama --samples 64 512 --markdown "$out/bench-cuda.md"
