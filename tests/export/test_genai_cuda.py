"""The builder's CUDA fp16 models, calibrated on the GPU and generated with on the GPU (issue 32).

tests/genai_models.py's tiny random-weight Llama is built offline by onnxruntime-genai's model
builder for CUDA at fp16 (GroupQueryAttention over fp16 past tensors), quantized by graphcal with
``--device cuda`` from token ids alone, and generated with by onnxruntime-genai-cuda's own greedy
loop on CUDA. The reference is the fp16 build in that same loop on CUDA: the first token and the
first step's logits. Skipped without a GPU, onnxruntime-gpu's CUDA provider and
onnxruntime-genai-cuda.
"""

from __future__ import annotations

import json

import onnxruntime as ort
import pytest
import torch

from tests.genai_models import STEPS, generate, sqnr
from tests.helpers import run_cli

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or "CUDAExecutionProvider" not in ort.get_available_providers(),
        reason="needs a CUDA GPU, a CUDA torch and onnxruntime-gpu",
    ),
]
og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai-cuda is not installed (the test extra)")


@pytest.fixture(scope="module")
def cuda_build(builder_model, tmp_path_factory):
    """(the builder's CUDA fp16 folder, token-only calibration data) and its own greedy generation on CUDA."""
    folder, calib = builder_model
    build = tmp_path_factory.mktemp("genai_cuda") / "cuda16"
    result = run_cli("export", str(folder.parent / "hf"), "--genai", "fp16", "--genai-provider",
                     "cuda", "-o", str(build))
    assert result.exit_code == 0, result.output
    return build, calib, generate(build, "cuda")


@pytest.mark.parametrize("args", [
    ["--scheme", "W4A16", "--group-size", "32"],
    ["--scheme", "W4A16", "--group-size", "32", "--algorithm", "gptq"],
    ["--scheme", "W4A16_ASYM", "--group-size", "32", "--algorithm", "awq", "--matmulnbits"],
    ["--scheme", "W4A16", "--group-size", "32", "--lm-head", "--scheme-for", "Embedding=W4A16", "--matmulnbits"],
    ["--scheme", "W8A8"],
    ["--scheme", "W8A8_STATIC", "--smoothquant"],
    ["--scheme", "FP8"],
], ids=["rtn", "gptq", "awq-asym", "whole-int4", "w8a8", "w8a8-static-smoothquant", "fp8"])
def test_a_cuda_build_quantized_on_the_gpu_generates_on_the_gpu(cuda_build, tmp_path, args):
    build, calib, (ref_tokens, ref_logits) = cuda_build
    out = tmp_path / "out"
    result = run_cli("run", str(build / "model.onnx"), "--data", str(calib), "-o", str(out),
                     "--device", "cuda", *args)
    assert result.exit_code == 0, result.output
    config = json.loads((out / "genai_config.json").read_text())
    assert config == json.loads((build / "genai_config.json").read_text())  # the CUDA provider options kept
    tokens, logits = generate(out, "cuda")
    measured = sqnr(ref_logits, logits)
    print(f"{'-'.join(args)}: first token {tokens[0]} (fp16 {ref_tokens[0]}), logits {measured:.1f} dB")
    # random weights give near-uniform logits, so only the first token is sure to survive int4 noise
    assert tokens[0] == ref_tokens[0] and len(tokens) == STEPS
    assert measured > 12  # fp32 CPU builds measure 19-28 dB (tests/export/test_genai.py); a broken layer gives ~0
