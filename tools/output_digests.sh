#!/usr/bin/env bash
# sha256 of every file graphcal writes (model.onnx, quantization_config.json, qparams.safetensors)
# for a fixed set of runs on the shipped models: every preset for onnxruntime (fp4 for --target qdq,
# onnxruntime has no fp4) and as literal Q/DQ, MatMulNBits, the TensorRT forms, a kv-cache scheme,
# MSE and imatrix observers, SmoothQuant, GPTQ and AWQ. Run it before and after a refactor and diff the two lists:
#   tools/output_digests.sh > before.txt; (change); tools/output_digests.sh > after.txt; diff before.txt after.txt
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
run() { local name=$1; shift; python -m graphcal run "$@" -o "$out/$name" -q 2>/dev/null || echo "FAILED $name"; }
for m in tiny-llama tiny-bert; do
  data=(models/$m/model.onnx --data models/$m/calib.npz)
  for s in W8A8 W8A8_STATIC W8A16 W4A16 W4A16_ASYM W4A8 FP8 FP8_DYNAMIC FP8_BLOCK; do
    run "$m-$s" "${data[@]}" --scheme "$s"
  done
  for s in W8A8 W8A8_STATIC W8A16 W4A16 W4A16_ASYM W4A8 FP8 FP8_DYNAMIC FP8_BLOCK NVFP4A16 NVFP4 MXFP4A16; do
    run "$m-qdq-$s" "${data[@]}" --scheme "$s" --target qdq
  done
  run "$m-nbits-W4A16" "${data[@]}" --scheme W4A16 --matmulnbits
  for s in W8A8_STATIC FP8 W4A16 NVFP4; do
    run "$m-trt-$s" "${data[@]}" --scheme "$s" --target tensorrt
  done
done
llama=(models/tiny-llama/model.onnx --data models/tiny-llama/calib.npz)
run kv "${llama[@]}" --scheme W8A8_STATIC --kv-cache-scheme FP8
run mse "${llama[@]}" --scheme W8A8_STATIC --observer mse
run imatrix "${llama[@]}" --observer imatrix_mse \
  --scheme '{"weights":{"num_bits":4,"strategy":"group","group_size":64},"input_activations":{"num_bits":8,"strategy":"tensor","dynamic":false}}'
# the algorithms: SmoothQuant (a fold, explicit Muls), GPTQ in both orders, AWQ, sequential GPTQ after each, and rotation
run sq "${llama[@]}" --scheme W8A8_STATIC --smoothquant all
run sq-mul-gptq "${llama[@]}" --scheme W8A8_STATIC --smoothquant mul --algorithm gptq
run gptq "${llama[@]}" --scheme W4A16 --algorithm gptq
run gptq-one-pass "${llama[@]}" --scheme W4A16 --algorithm gptq --gptq-order one-pass
run awq-gptq "${llama[@]}" --scheme W4A16 --algorithm awq+gptq
run rot "${llama[@]}" --scheme W4A16 --rotate R1
run rot-gptq "${llama[@]}" --scheme W4A16 --algorithm gptq --rotate R1,R2
run bert-gptq models/tiny-bert/model.onnx --data models/tiny-bert/calib.npz --scheme W4A16 --algorithm gptq
(cd "$out" && sha256sum */model.onnx */quantization_config.json */qparams.safetensors | sort -k2)
