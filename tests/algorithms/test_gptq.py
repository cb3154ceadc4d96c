"""GPTQ (llm-compressor 0.14's GPTQModifier math), checked against llm-compressor's own numbers.

* every ``gptq`` case of ``shared/reference/algorithm_vectors.pt`` (algorithms.md §8.1): graphcal's
  memoryless_minmax observer gives the case's grid, and :func:`quantize_weight` on the case's Hessian
  gives its codes, its on-grid weight, its activation order, its loss and its RTN-fallback flag,
  all bit for bit (torch single-threaded, as the vectors were made: with more threads LAPACK/BLAS
  move the loss by ~1e-5 relative while the codes stayed equal here);
* the Hessian accumulated from the case's activations equals the case's Hessian bit for bit, and the
  Gram-matrix path (``X^T X`` per batch) agrees to 1e-6 relative (a different summation order);
* ``gptq_errors``: the GPTQ path's message for ``actorder="group"``;
* strategies without vectors (tensor, tensor_group nvfp4, block, fp8 channel): with a diagonal
  Hessian GPTQ makes no cross-column updates, so the result must be compressed-tensors' own
  ``fake_quantize`` of the weight, exactly;
* validation messages.
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize

from graphcal.algorithms.gptq.math import ACTORDERS, GPTQResult, Hessian, check_actorder, quantize_weight
from graphcal.observers import Observer
from tests.helpers import ALGORITHM_VECTORS

VECTORS = ALGORITHM_VECTORS
CASES = [
    "w4a16_g128_sym_actorder_None",
    "w4a16_g128_sym_actorder_static",
    "w4a16_g128_asym_actorder_None",
    "w4a16_g128_asym_actorder_static",
    "w4_channel_sym_actorder_None",
    "w4_channel_sym_actorder_static",
    "w8a8_channel_sym_actorder_None",
    "w8a8_channel_sym_actorder_static",
    "w4a16_g128_asym_actorder_static_bs32_damp0.1",
    "w4a16_g128_sym_actorder_static_dead_columns",
    "w4a16_g128_sym_actorder_static_fp16_weight",
    "w4a16_g128_sym_actorder_None_rtn_fallback_indefinite_hessian",
]
GAUSS_TOLERANCE = 1e-6  # add_gram vs add_activations, relative to max|H| (seen: <= 8e-8)


@pytest.fixture(scope="module")
def vectors():
    if not VECTORS.is_file():
        pytest.skip(f"llm-compressor reference vectors not found at {VECTORS}")
    return torch.load(VECTORS, weights_only=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the vectors were made with one torch thread


def _case(vectors, name):
    return next(c for c in vectors["gptq"] if c["name"] == name)


def _grid(case):
    args = QuantizationArgs(**case["args"]["quant_args"])
    observer = Observer.load_from_registry(case["args"]["observer"], base_name="weight", args=args)
    observer(case["inputs"]["weight"])
    return args, observer.get_qparams()


def _group_of_column(args, cols):
    """Original column j -> its qparam column (GROUP: j // group_size; CHANNEL: 0)."""
    group_size = args.group_size if args.group_size and args.group_size > 0 else cols
    return torch.arange(cols) // group_size


def _run(case):
    args, qp = _grid(case)
    result = quantize_weight(case["inputs"]["weight"], case["inputs"]["hessian"], qp["scale"], qp["zero_point"],
                             qp["global_scale"], args, block_size=case["args"]["blocksize"],
                             dampening_frac=case["args"]["percdamp"])
    return args, qp, result


def test_all_cases_listed(vectors):
    assert sorted(c["name"] for c in vectors["gptq"]) == sorted(CASES)


@pytest.mark.parametrize("name", CASES)
def test_grid_is_the_observers(vectors, name):
    case = _case(vectors, name)
    _, qp = _grid(case)
    out = case["outputs"]
    assert qp["scale"].dtype == out["scale"].dtype and torch.equal(qp["scale"], out["scale"])
    assert torch.equal(qp["zero_point"], out["zero_point"])
    assert qp["global_scale"] is None and out["global_scale"] is None


@pytest.mark.parametrize("name", CASES)
def test_quantize_weight_matches_llm_compressor(vectors, name):
    case = _case(vectors, name)
    out = case["outputs"]
    args, qp, result = _run(case)
    weight = case["inputs"]["weight"]
    assert isinstance(result, GPTQResult)
    assert result.weight.dtype == weight.dtype and result.weight.shape == weight.shape

    # the on-grid weight is exactly (q_int - zp) * scale in the scale dtype (out["dequant_of_q_int_is_exact"])
    assert out["dequant_of_q_int_is_exact"] and out["quantized_weight"] is None
    scale, zp = out["scale"], out["zero_point"]
    g = _group_of_column(args, weight.shape[1])
    expected = (out["q_int"].to(scale.dtype) - zp[:, g].to(scale.dtype)) * scale[:, g]
    assert torch.equal(result.weight, expected.to(weight.dtype))

    # the codes themselves
    codes = torch.round(result.weight.float() / scale[:, g].float() + zp[:, g].float()).to(torch.int8)
    assert torch.equal(codes, out["q_int"])

    if out["perm"] is None:
        assert result.perm is None
    else:
        assert torch.equal(result.perm, out["perm"])
    # bit-exact on the vectors' CPU (one thread; fp32 sum as llm-compressor's); torch's vectorized sum
    # adds in another order on another instruction set (AVX2 against AVX-512: 5e-6 apart)
    assert result.loss == pytest.approx(out["loss"], rel=1e-5, abs=0)
    assert result.rtn_fallback is out["rtn_fallback"]


def test_dead_columns_come_out_zero(vectors):
    case = _case(vectors, "w4a16_g128_sym_actorder_static_dead_columns")
    dead = case["args"]["dead_columns"]
    assert torch.equal(torch.diag(case["inputs"]["hessian"])[dead], torch.zeros(len(dead)))
    assert case["inputs"]["weight"][:, dead].abs().min() > 0  # the weight itself is not zero there
    _, _, result = _run(case)
    assert torch.equal(result.weight[:, dead], torch.zeros(result.weight.shape[0], len(dead)))


def test_rtn_fallback_is_round_to_nearest(vectors):
    case = _case(vectors, "w4a16_g128_sym_actorder_None_rtn_fallback_indefinite_hessian")
    args, qp, result = _run(case)
    assert result.rtn_fallback
    assert torch.equal(result.weight, fake_quantize(case["inputs"]["weight"], qp["scale"], qp["zero_point"], args))


def test_actorder_argument_overrides_args(vectors):
    case = _case(vectors, "w4a16_g128_sym_actorder_None")
    static = _case(vectors, "w4a16_g128_sym_actorder_static")
    assert torch.equal(case["inputs"]["hessian"], static["inputs"]["hessian"])
    args, qp = _grid(case)
    result = quantize_weight(case["inputs"]["weight"], case["inputs"]["hessian"], qp["scale"], qp["zero_point"], None,
                             args, actorder="static")
    assert torch.equal(result.perm, static["outputs"]["perm"])
    assert result.loss == pytest.approx(static["outputs"]["loss"], rel=1e-5, abs=0)


@pytest.mark.parametrize("name", [n for n in CASES if "indefinite" not in n])
def test_hessian_from_activations(vectors, name):
    case = _case(vectors, name)
    batches = case["inputs"]["activations"]
    expected = case["inputs"]["hessian"]

    hook = Hessian()
    for x in batches:
        hook.add_activations(x)
    assert hook.count == case["inputs"]["num_samples"]
    assert hook.value().dtype == torch.float32
    assert torch.equal(hook.value(), expected)

    gram = Hessian()
    for x in batches:
        flat = x.reshape(-1, x.shape[-1]).float()
        gram.add_gram(flat.T @ flat, x.shape[0])
    assert gram.count == hook.count
    assert (gram.value() - expected).abs().max() <= GAUSS_TOLERANCE * expected.abs().max()

    # ranks: split the batches, merge the accumulators
    first, rest = Hessian(), Hessian()
    first.add_activations(batches[0])
    for x in batches[1:]:
        rest.add_activations(x)
    merged = first.merge(rest)
    assert merged.count == hook.count
    assert (merged.value() - expected).abs().max() <= GAUSS_TOLERANCE * expected.abs().max()


def test_hessian_shapes():
    torch.manual_seed(0)
    h = Hessian()
    h.add_activations(torch.randn(5, 4))  # 2-D: one sample of 5 tokens
    assert h.count == 1 and h.columns == 4
    h.add_activations(torch.randn(2, 3, 2, 4))  # >3-D: (B, -1, H), B = 2
    assert h.count == 3
    x = torch.randn(7, 4, dtype=torch.float64)
    single = Hessian()
    single.add_activations(x)
    assert torch.allclose(single.value().double(), 2 * x.T @ x, rtol=1e-6)
    with pytest.raises(ValueError, match="4 columns"):
        h.add_activations(torch.randn(1, 2, 5))
    with pytest.raises(ValueError, match="no samples"):
        Hessian().value()
    with pytest.raises(ValueError, match="square"):
        Hessian().add_gram(torch.zeros(3, 4), 1)
    with pytest.raises(ValueError, match="sequences"):
        Hessian().add_gram(torch.zeros(3, 3), -1)


def test_check_actorder(vectors):
    assert ACTORDERS == ("weight", "static")
    assert check_actorder(None) is None
    assert check_actorder("static") == "weight"
    assert check_actorder("weight") == "weight"
    assert check_actorder(QuantizationArgs(actorder="static").actorder) == "weight"
    error = next(e for e in vectors["gptq_errors"] if e["name"] == "gptq_modifier_actorder_group")["error"]
    kind, message = error.split(": ", 1)
    assert kind == "ValueError"
    with pytest.raises(ValueError) as raised:
        check_actorder("group")
    assert str(raised.value) == message
    with pytest.raises(ValueError, match="Invalid activation ordering dynamic"):
        check_actorder("dynamic")
    with pytest.raises(ValueError, match="Invalid activation ordering True"):
        check_actorder(True)


def _rtn_case(args: QuantizationArgs, rows=12, cols=64, dtype=torch.float32):
    torch.manual_seed(1)
    weight = (torch.randn(rows, cols) * 0.1).to(dtype)
    observer = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)
    observer(weight)
    qp = observer.get_qparams()
    hessian = torch.diag(torch.rand(cols) + 0.5)  # diagonal: GPTQ makes no cross-column updates
    return weight, hessian, qp


@pytest.mark.parametrize("args", [
    QuantizationArgs(num_bits=4, strategy="tensor"),
    QuantizationArgs(num_bits=8, symmetric=False, strategy="tensor"),
    QuantizationArgs(num_bits=8, type="float", strategy="channel"),
    QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, scale_dtype=torch.float8_e4m3fn),
    QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=[8, 16]),  # 12 rows: a partial block
    QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=16, actorder="static"),
], ids=["int4_tensor", "int8_tensor_asym", "fp8_channel", "nvfp4", "fp8_block", "int4_group_asym_actorder"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_diagonal_hessian_is_compressed_tensors_fake_quantize(args, dtype):
    weight, hessian, qp = _rtn_case(args, dtype=dtype)
    result = quantize_weight(weight, hessian, qp["scale"], qp["zero_point"], qp["global_scale"], args, block_size=24)
    assert not result.rtn_fallback and result.weight.dtype == dtype
    # GPTQ sweeps an fp32 copy of the weight: w / s in fp32, (q - zp) * s in the scale dtype
    expected = fake_quantize(weight.float(), qp["scale"], qp["zero_point"], args, global_scale=qp["global_scale"])
    assert torch.equal(result.weight, expected.to(dtype))
    assert result.loss > 0


def test_validation():
    args = QuantizationArgs(num_bits=4, strategy="group", group_size=16)
    weight, hessian, qp = _rtn_case(args)

    def call(**overrides):
        kwargs = dict(weight=weight, hessian=hessian, scale=qp["scale"], zero_point=qp["zero_point"], global_scale=None,
                      args=args)
        kwargs.update(overrides)
        return quantize_weight(**kwargs)

    with pytest.raises(ValueError, match="block_size must be an integer >= 1, got 0"):
        call(block_size=0)
    with pytest.raises(ValueError, match="dampening_frac must be a finite number >= 0, got -0.1"):
        call(dampening_frac=-0.1)
    with pytest.raises(ValueError, match="dampening_frac"):
        call(dampening_frac=None)
    with pytest.raises(ValueError, match=r"hessian must be \[64, 64\]"):
        call(hessian=hessian[:32, :32])
    with pytest.raises(ValueError, match="weight must be a 2-D"):
        call(weight=weight[0])
    with pytest.raises(ValueError, match=r"group strategy needs a \[12, 4\] scale"):
        call(scale=qp["scale"][:, :2])
    with pytest.raises(ValueError, match="Invalid activation ordering group"):
        call(actorder="group")
    with pytest.raises(ValueError, match="strategy 'token'"):
        call(args=QuantizationArgs(num_bits=8, strategy="token", dynamic=True))
    assert call(dampening_frac=0).weight.shape == weight.shape
