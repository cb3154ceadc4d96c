"""SmoothQuant (llm-compressor's SmoothQuantModifier) on ONNX graphs, checked against llm-compressor's own numbers.

* the scale formula on the reference's statistics (``shared/reference/algorithm_vectors.pt``,
  algorithms.md §8.2) gives its scales bit for bit;
* each reference case rebuilt as an ONNX graph in the legacy exporter's naming: the ranges onnxruntime
  collects, the scales, and the folded norm / linear / balance parameters equal llm-compressor's, and
  the folded float model computes what the original does;
* end to end on the reference's tiny random Llama (§8.4, SmoothQuant α 0.8, default mappings);
* which mappings each scope finds on the shipped models, and that every one of them is exact;
* ``calibrate`` with SmoothQuant writes the static input scale an independent computation gives;
* recipes with a SmoothQuantModifier, ``inspect``, and a bad ``--smoothing-strength``.

The reference values are llm-compressor's (or computed here from algorithms.md and compressed-tensors'
``calculate_qparams``), never graphcal's own smoothing output; the one exception is llm-compressor's
"does nothing" on a BERT, checked as "the same files as a run without SmoothQuant".
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from graphcal.calibration.plan import load, plan
from graphcal.calibration.transforms.smoothquant import collect, smoothing_scales
from graphcal.config import Options, Smoothing, build_config, resolve
from graphcal.data import graph_inputs, load_data
from graphcal.graph.scaling import TAP_PREFIX
from tests.helpers import ALGORITHM_VECTORS, EXPORTER_CHATTER, INT8_SATURATES, assert_within_ulps, reference_llama, run_cli

VECTORS = ALGORITHM_VECTORS
CASES = [
    "rmsnorm_to_qkv_alpha0.5",
    "layernorm_bias_to_fc_alpha0.8_edge_channels",
    "linear_smooth_to_linear_alpha0.5",
    "rmsnorm_to_qkv_log_equalization",
]
SMOOTH_NODE = "/layers.0/smooth"  # the legacy exporter's node path of module layers.0.smooth
F32 = np.float32

pytestmark = EXPORTER_CHATTER  # known, harmless exporter warnings


@pytest.fixture(scope="module")
def vectors():
    if not VECTORS.is_file():
        pytest.skip(f"llm-compressor reference vectors not found at {VECTORS}")
    return torch.load(VECTORS, weights_only=True)


def _case(vectors, name):
    return next(c for c in vectors["smoothquant"] if c["name"] == name)


def _mappings(case) -> tuple:
    """The case's llm-compressor mapping (one ``[[balance regexes], smooth regex]``) as graphcal's
    Smoothing takes mappings."""
    from graphcal.types import NamedMapping

    balance, smooth = case["args"]["mappings"]
    return (NamedMapping(smooth, tuple(balance)),)


#: the level whose numbers the written int8 models are checked at: onnxruntime's default, except where
#: its u8 x s8 kernels saturate (x86 without AVX-VNNI; tests/test_saturation.py): there the Q/DQ spec's
INT8_LEVEL = "basic" if INT8_SATURATES else "all"


def _session(model, level="basic"):
    import onnxruntime as ort

    so = ort.SessionOptions()
    if level == "basic":
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def _close(got, ref, rtol, what=""):
    """|got - ref| <= rtol * max|ref| everywhere (relative to the tensor's magnitude: values near 0
    carry the absolute rounding error of their larger neighbours)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    scale = max(float(np.abs(ref).max()), 1e-30)
    err = float(np.abs(got - ref).max())
    assert err <= rtol * scale, f"{what}: max |diff| {err:.3g} > {rtol:g} * {scale:.3g}"


def _node(model, name):
    return next(n for n in model.graph.node if n.name == name)


def _const(model, name) -> np.ndarray:
    """An initializer's value, or a Constant node's (what a node input names)."""
    for t in model.graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t).copy()
    for n in model.graph.node:
        if n.op_type == "Constant" and n.output[0] == name:
            return numpy_helper.to_array(n.attribute[0].t)
    raise KeyError(name)


# ------------------------------------------------------------------------------------------
# 1. The scale formula on the reference's own statistics
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_scales_from_reference_statistics_are_bit_exact(vectors, name):
    case = _case(vectors, name)
    inp, out = case["inputs"], case["outputs"]
    weights = [inp["params"][f"{b}.weight"] for b in inp["balance_names"]]
    scales, unclamped = smoothing_scales(out["min_channel_vals"], out["max_channel_vals"], weights,
                                         case["args"]["smoothing_strength"], case["args"]["algorithm"])
    # same torch ops in the same dtype as llm-compressor: bit for bit on the CPU the vectors were made
    # on; torch's vectorized pow differs by an ulp between instruction sets (AVX2 / AVX-512), so within one
    assert unclamped.dtype == scales.dtype == torch.float32
    assert_within_ulps(unclamped, out["scales_unclamped"], 1)
    assert_within_ulps(scales, out["scales"], 1)
    if name.startswith("layernorm"):  # the edge channels are really exercised
        assert (out["scales_unclamped"] == 0).any() and (out["scales"] == 1e-5).any()
        assert (out["weight_max_abs"] == 0).any()


# ------------------------------------------------------------------------------------------
# 2. Each reference case as an ONNX graph: statistics, scales and folded parameters
# ------------------------------------------------------------------------------------------


def _case_model(case) -> onnx.ModelProto:
    """The case's smooth layer and balance Linears as the legacy exporter writes them: nodes named
    ``/layers.0/smooth/...`` and ``/layers.0/balance/<name>/MatMul``, Linear weights as [in, out]
    ``onnx::MatMul_N`` initializers, biases as Adds; graph input ``x`` [batch, seq, H]."""
    inp = case["inputs"]
    params = {k: v.numpy().astype(F32) for k, v in inp["params"].items()}
    hidden = inp["activations"][0].shape[-1]
    nodes, inits, outputs = [], [], []
    counter = iter(range(100, 1000))

    def init(name, value):
        inits.append(numpy_helper.from_array(np.ascontiguousarray(np.asarray(value, F32)), name))
        return name

    def linear(path, x, prefix):
        """MatMul (+ bias Add) of module ``prefix`` at node path ``path``; returns the output name."""
        w = init(f"onnx::MatMul_{next(counter)}", params[f"{prefix}.weight"].T)
        y = f"{path}/MatMul_output_0"
        nodes.append(helper.make_node("MatMul", [x, w], [y], name=f"{path}/MatMul"))
        if f"{prefix}.bias" in params:
            b = init(f"{prefix}.bias", params[f"{prefix}.bias"])
            nodes.append(helper.make_node("Add", [b, y], [f"{path}/Add_output_0"], name=f"{path}/Add"))
            y = f"{path}/Add_output_0"
        return y

    kind, s = inp["smooth_kind"], SMOOTH_NODE
    if kind == "rms":  # w * x * rsqrt(mean(x^2) + 1e-6), decomposed as LlamaRMSNorm exports
        init(f"{s}/two", 2.0)
        init(f"{s}/eps", 1e-6)
        init(f"{s}/one", 1.0)
        w = init("layers.0.smooth.weight", params["layers.0.smooth.weight"])
        nodes += [
            helper.make_node("Pow", ["x", f"{s}/two"], [f"{s}/Pow_output_0"], name=f"{s}/Pow"),
            helper.make_node("ReduceMean", [f"{s}/Pow_output_0"], [f"{s}/ReduceMean_output_0"], name=f"{s}/ReduceMean",
                             axes=[-1], keepdims=1),
            helper.make_node("Add", [f"{s}/ReduceMean_output_0", f"{s}/eps"], [f"{s}/Add_output_0"], name=f"{s}/Add"),
            helper.make_node("Sqrt", [f"{s}/Add_output_0"], [f"{s}/Sqrt_output_0"], name=f"{s}/Sqrt"),
            helper.make_node("Div", [f"{s}/one", f"{s}/Sqrt_output_0"], [f"{s}/Div_output_0"], name=f"{s}/Div"),
            helper.make_node("Mul", ["x", f"{s}/Div_output_0"], [f"{s}/Mul_output_0"], name=f"{s}/Mul"),
            helper.make_node("Mul", [w, f"{s}/Mul_output_0"], [f"{s}/Mul_1_output_0"], name=f"{s}/Mul_1"),
        ]
        h = f"{s}/Mul_1_output_0"
    elif kind == "ln":
        w = init("layers.0.smooth.weight", params["layers.0.smooth.weight"])
        b = init("layers.0.smooth.bias", params["layers.0.smooth.bias"])
        h = f"{s}/LayerNormalization_output_0"
        nodes.append(helper.make_node("LayerNormalization", ["x", w, b], [h], name=f"{s}/LayerNormalization",
                                      axis=-1, epsilon=1e-5))
    elif kind == "linear":
        h = linear(s, "x", "layers.0.smooth")
    else:
        raise AssertionError(kind)
    for name in inp["balance_names"]:
        short = name.rpartition(".")[2]
        y = linear(f"/layers.0/balance/{short}", h, name)
        out_features = params[f"{name}.weight"].shape[0]
        outputs.append(helper.make_tensor_value_info(y, TensorProto.FLOAT, ["batch", "seq", out_features]))
    graph = helper.make_graph(nodes, "smoothquant_case",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", hidden])],
                              outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _folded_params(model, case) -> dict[str, np.ndarray]:
    """The case's parameters as the (folded) ONNX model holds them, in torch's layout, found through
    the nodes (a fold points a node at a new initializer)."""
    inp = case["inputs"]
    out = {}

    def linear(path, prefix):
        out[f"{prefix}.weight"] = _const(model, _node(model, f"{path}/MatMul").input[1]).T
        if f"{prefix}.bias" in inp["params"]:
            add = _node(model, f"{path}/Add")
            out[f"{prefix}.bias"] = _const(model, add.input[0])

    kind = inp["smooth_kind"]
    if kind == "rms":
        out["layers.0.smooth.weight"] = _const(model, _node(model, f"{SMOOTH_NODE}/Mul_1").input[0])
    elif kind == "ln":
        ln = _node(model, f"{SMOOTH_NODE}/LayerNormalization")
        out["layers.0.smooth.weight"] = _const(model, ln.input[1])
        out["layers.0.smooth.bias"] = _const(model, ln.input[2])
    else:
        linear(SMOOTH_NODE, "layers.0.smooth")
    for name in inp["balance_names"]:
        linear(f"/layers.0/balance/{name.rpartition('.')[2]}", name)
    return out


@pytest.mark.parametrize("name", CASES)
def test_reference_case_as_onnx_graph(vectors, tmp_path, name):
    from graphcal.graph.targets import torch_weight

    case = _case(vectors, name)
    inp, args, ref = case["inputs"], case["args"], case["outputs"]
    model = _case_model(case)
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    config = build_config("W8A8")
    config.smoothing = Smoothing(strength=args["smoothing_strength"], mappings=_mappings(case),
                                 algorithm=args["algorithm"])
    run, loaded = _planned(path, config)

    # the mapping resolves by module name to exactly the case's smooth layer and balance layers
    assert run.warnings == ()
    assert [(m.smooth, m.balance, m.explicit) for m in run.decision(Smoothing).mappings] == [
        (inp["smooth_name"], tuple(inp["balance_names"]), False)]
    mapping = run.decision(Smoothing).mappings[0]
    assert mapping.candidate.kind == ("linear" if inp["smooth_kind"] == "linear" else "norm")

    # graphcal reads the balance weights in torch's layout: their pooled column max is llm-compressor's
    if ref["weight_max_abs"] is not None:
        by_name = {t.name: t for t in run.found}
        pooled = np.concatenate([np.abs(torch_weight(loaded.model, by_name[b])) for b in inp["balance_names"]]).max(0)
        np.testing.assert_array_equal(pooled, ref["weight_max_abs"].numpy())

    x = torch.cat(list(inp["activations"])).numpy()
    calib = load_data({"x": x}, graph_inputs(loaded.model), batch_size=inp["activations"][0].shape[0])
    smoothed = collect(run, loaded, calib, device="cpu")

    # Tolerances: onnxruntime computes the smooth layer where llm-compressor used torch, so the
    # statistics differ by rounding (seen: <= 1.3e-7 of the tensor's magnitude), and the scales and
    # parameters derived from them likewise (seen: <= 2.6e-7 relative, element by element); a wrong
    # formula or fold is off by O(1).
    lo, hi = smoothed.ranges[mapping.candidate.tensor]
    _close(lo, ref["min_channel_vals"], 1e-6, "min")
    _close(hi, ref["max_channel_vals"], 1e-6, "max")
    # scales and parameters are products and quotients of them: compared element by element (the LN
    # case's bias holds a value 1e5 times the others, which a tolerance by magnitude would hide)
    s = smoothed.scales[mapping.candidate.activation]
    np.testing.assert_allclose(smoothed.unclamped[mapping.candidate.activation], ref["scales_unclamped"], rtol=2e-6,
                               atol=0, err_msg="unclamped scales")
    np.testing.assert_allclose(s, ref["scales"], rtol=2e-6, atol=0, err_msg="scales")
    if name.startswith("layernorm"):  # the constant channel: range exactly 0, so the clamp, exactly
        constant = ref["scales_unclamped"] == 0
        assert torch.equal(s[constant], ref["scales"][constant])

    # the complete smoothed float model: every parameter as llm-compressor leaves it
    original = onnx.ModelProto()
    original.CopyFrom(loaded.model)
    types = dict(loaded.types)
    smoothed.fold(loaded.model, run, set(), types)
    onnx.checker.check_model(loaded.model, full_check=True)
    got = _folded_params(loaded.model, case)
    assert set(got) == set(ref["params"])
    for key, value in ref["params"].items():
        assert got[key].shape == tuple(value.shape), key
        np.testing.assert_allclose(got[key], value.numpy(), rtol=5e-6, atol=0, err_msg=key)
    # ... and it computes what the original does
    feeds = {"x": x}
    before = _session(original).run(None, feeds)
    after = _session(loaded.model).run(None, feeds)
    assert len(before) == len(inp["balance_names"])
    for b, a in zip(before, after):
        _close(a, b, 1e-5, "output")


# ------------------------------------------------------------------------------------------
# 3. End to end on the reference's tiny random Llama (oneshot: SmoothQuant α 0.8, then GPTQ)
# ------------------------------------------------------------------------------------------

SQ_RECIPE = """
sq_stage:
  sq_modifiers:
    SmoothQuantModifier:
      smoothing_strength: 0.8
    QuantizationModifier:
      targets: [Linear]
      ignore: [lm_head]
      scheme: W8A8
"""


@pytest.mark.slow
def test_e2e_llama_smoothing_matches_llm_compressor(vectors, tmp_path):
    """The smoothing of the case (its GPTQ weights: tests/algorithms/test_gptq_awq_run.py)."""
    from graphcal.config.recipe import parse_recipe, recipe_config

    case = next(c for c in vectors["e2e"] if c["name"] == "sq_gptq_w8a8")
    inp, ref = case["inputs"], case["outputs"]
    path, arrays, expected = reference_llama(case, tmp_path)  # the torch model's logits, padded row included
    _close(_session(path).run(None, arrays)[0], expected, 1e-5, "exported logits")

    run, loaded = _planned(path, recipe_config(parse_recipe(SQ_RECIPE)))
    assert run.config.smoothing.strength == 0.8
    assert run.warnings == ()  # both default mappings resolve, exactly
    layers = range(inp["llama_config"]["num_hidden_layers"])
    assert {m.smooth: m.balance for m in run.decision(Smoothing).mappings} == {
        **{f"model.layers.{i}.input_layernorm": tuple(f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv")
           for i in layers},
        **{f"model.layers.{i}.post_attention_layernorm": (f"model.layers.{i}.mlp.gate_proj",
                                                          f"model.layers.{i}.mlp.up_proj") for i in layers},
    }
    assert set(ref["sq_activation_minmax"]) == {m.smooth for m in run.decision(Smoothing).mappings}
    calib = load_data(arrays, graph_inputs(loaded.model), batch_size=inp["batch_size"])
    smoothed = collect(run, loaded, calib, device="cpu")
    # llm-compressor smooths layer by layer (layer 1's statistics come from the smoothed layer 0) in
    # torch; graphcal takes every statistic in one onnxruntime pass over the unsmoothed model. Equal up
    # to rounding (algorithms.md §5.2; seen: <= 2.3e-7 of each tensor's magnitude, allowed 5e-6).
    for m in run.decision(Smoothing).mappings:
        lo, hi = smoothed.ranges[m.candidate.tensor]
        ref_lo, ref_hi = ref["sq_activation_minmax"][m.smooth]
        _close(lo, ref_lo, 5e-6, f"{m.smooth} min")
        _close(hi, ref_hi, 5e-6, f"{m.smooth} max")
        np.testing.assert_allclose(smoothed.unclamped[m.candidate.activation], ref["sq_scales_unclamped"][m.smooth],
                                   rtol=5e-6, atol=0, err_msg=f"{m.smooth} scales")
    smoothed.fold(loaded.model, run, set(), dict(loaded.types))
    for m in run.decision(Smoothing).mappings:
        mul = next(n for n in loaded.model.graph.node if n.op_type == "Mul" and n.output[0] == m.candidate.tensor)
        inits = {t.name for t in loaded.model.graph.initializer}
        (weight,) = [_const(loaded.model, i) for i in mul.input if i in inits]  # the norm's scale, divided by s
        np.testing.assert_allclose(weight, ref["changed_params"][f"{m.smooth}.weight"], rtol=5e-6, atol=0,
                                   err_msg=f"{m.smooth}.weight")


# ------------------------------------------------------------------------------------------
# 4. The shipped models: what each scope smooths, and that every fold is exact
# ------------------------------------------------------------------------------------------

SCOPES = ("norms", "all", "mul")


def _expected_llama(scope) -> dict:
    """balance layers -> (smooth layer or None, kind, explicit)."""
    out = {}
    for i in range(2):
        layer = f"model.layers.{i}"
        out[tuple(f"{layer}.self_attn.{p}_proj" for p in "qkv")] = (f"{layer}.input_layernorm", "norm", False)
        out[(f"{layer}.mlp.gate_proj", f"{layer}.mlp.up_proj")] = (f"{layer}.post_attention_layernorm", "norm", False)
        if scope in ("all", "mul"):
            out[(f"{layer}.mlp.down_proj",)] = (f"{layer}.mlp.up_proj", "linear", False)
        if scope == "mul":
            out[(f"{layer}.self_attn.o_proj",)] = (None, "mul", True)
    return out


def _expected_bert(scope) -> dict:
    out = {}
    for i in range(2):
        layer = f"encoder.layer.{i}"
        out[(f"{layer}.output.dense",)] = (f"{layer}.intermediate.intermediate_act_fn", "norm", False)
        if scope in ("all", "mul"):  # through the attention, into value's output rows (llm-compressor's v -> o)
            out[(f"{layer}.attention.output.dense",)] = (f"{layer}.attention.self.value", "linear", False)
        if scope == "mul":  # post-LN: no fold is exact, only an explicit Mul
            out[tuple(f"{layer}.attention.self.{p}" for p in ("query", "key", "value"))] = (None, "mul", True)
            out[(f"{layer}.intermediate.dense",)] = (None, "mul", True)
    if scope == "mul":
        out[("pooler.dense",)] = (None, "mul", True)
    return out


def _planned(path, config):
    """The plan and the model it was made on (the plan holds decisions only; the model is the caller's)."""
    loaded = load(path, config)
    return plan(path, config, loaded=loaded), loaded


def _plan(model_dir, scope, strength=None):
    return _planned(model_dir / "model.onnx", resolve(Options(scheme="W8A8_STATIC", smoothquant=scope,
                                                              smoothing_strength=strength)))


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-bert"])
def test_shipped_model_mappings(llama_dir, bert_dir, model, scope):
    run, loaded = _plan(llama_dir if model == "tiny-llama" else bert_dir, scope)
    expected = (_expected_llama if model == "tiny-llama" else _expected_bert)(scope)
    got = {m.balance: (None if m.explicit else m.smooth, m.candidate.kind, m.explicit) for m in run.decision(Smoothing).mappings}
    assert got == expected
    assert len(run.decision(Smoothing).mappings) == len(expected)  # no balance tuple twice
    smoothed_targets = {b for m in run.decision(Smoothing).mappings for b in m.balance}
    if model == "tiny-bert":
        for m in run.decision(Smoothing).mappings:
            if m.candidate.kind == "linear":  # value's output rows and its bias Add
                (param,) = m.candidate.params
                assert param.node.endswith("/attention/self/value/Add_output_0")
            elif not m.explicit:  # folded into GELU's final constant "* 0.5", nothing else
                (param,) = m.candidate.params
                assert param.node.endswith("/intermediate_act_fn/Mul_1_output_0")
                assert _const(loaded.model, param.value).tolist() == 0.5
    # every target that is not smoothed is said so in a note (nothing silently left out)
    for t in run.chosen:
        assert t.name in smoothed_targets or any(t.name in n for n in run.decision(Smoothing).notes), t.name


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-bert"])
def test_shipped_model_float_fold_is_exact(llama_dir, bert_dir, model, scope):
    model_dir = llama_dir if model == "tiny-llama" else bert_dir
    run, loaded = _plan(model_dir, scope)
    original = onnx.load(model_dir / "model.onnx")
    calib = load_data(model_dir / "calib.npz", graph_inputs(loaded.model), batch_size=16, num_samples=16)
    smoothed = collect(run, loaded, calib, device="cpu")
    types = dict(loaded.types)
    smoothed.fold(loaded.model, run, set(), types)
    onnx.checker.check_model(loaded.model, full_check=True)

    # the balance weights (and a linear smooth layer's) really changed, an exact no-op would pass the
    # comparison below; the others did not
    by_node = {t.node: t for t in run.found}
    changed = {b for m in run.decision(Smoothing).mappings for b in (*m.balance, m.candidate.linear) if b}
    for node in original.graph.node:
        t = by_node.get(node.name)
        if t is None:
            continue
        same = np.array_equal(_const(loaded.model, _node(loaded.model, node.name).input[1]), _const(original, node.input[1]))
        assert same == (t.name not in changed), t.name
    explicit = [n for n in loaded.model.graph.node if n.op_type == "Mul" and n.name.startswith(TAP_PREFIX)]
    assert len(explicit) == sum(m.explicit for m in run.decision(Smoothing).mappings)

    with np.load(model_dir / "heldout.npz") as data:
        feeds = {k: v[:8] for k, v in data.items()}
    before = _session(original).run(None, feeds)
    after = _session(loaded.model).run(None, feeds)
    for name, b, a in zip([o.name for o in original.graph.output], before, after):
        _close(a, b, 1e-5, name)


# ------------------------------------------------------------------------------------------
# 5. calibrate with SmoothQuant: the written static input scale, computed independently
# ------------------------------------------------------------------------------------------


def _smoothquant_scales(lo: torch.Tensor, hi: torch.Tensor, columns_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """algorithms.md §2.3, written out: a = max - min, w = 2 * pooled max|W[:, j]|,
    s = a^α / w^(1-α) (s = a where w = 0), clamped at 1e-5."""
    a = hi - lo
    w = 2 * columns_max
    s = torch.where(w > 0, a.pow(alpha) / w.pow(1 - alpha), a)
    return torch.clamp(s, min=1e-5)


def _tap(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for name in names:
        copy.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    return copy


def _reference_input_scale(model_dir, layer: str, alpha: float | None) -> torch.Tensor:
    """compressed-tensors' int8 symmetric per-tensor scale of what the MatMul ``layer`` (a legacy node
    path) reads in the ORIGINAL model over calib.npz, smoothed first (α ``alpha``, balanced over every
    MatMul reading the same tensor) unless ``alpha`` is None."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import calculate_qparams

    original = onnx.load(model_dir / "model.onnx")
    x_name = _node(original, f"{layer}/MatMul").input[0]
    with np.load(model_dir / "calib.npz") as data:
        calib = dict(data)
    x = torch.from_numpy(_session(_tap(original, [x_name])).run([x_name], calib)[0])
    if alpha is not None:
        flat = x.reshape(-1, x.shape[-1])
        balance = [n for n in original.graph.node if n.op_type == "MatMul" and n.input[0] == x_name]
        weights = [torch.from_numpy(_const(original, n.input[1])).T for n in balance]  # [in, out] -> [out, in]
        columns_max = torch.cat([w.abs() for w in weights]).amax(0)
        x = x / _smoothquant_scales(flat.amin(0), flat.amax(0), columns_max, alpha)
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False)
    scale, _ = calculate_qparams(x.min().reshape(1), x.max().reshape(1), args)
    return scale


@pytest.fixture(scope="module")
def llama_reference_scales(llama_dir):
    """(layer, α) -> the reference input scale, computed once."""
    cache = {}

    def get(layer, alpha):
        if (layer, alpha) not in cache:
            cache[layer, alpha] = _reference_input_scale(llama_dir, layer, alpha)
        return cache[layer, alpha]

    return get


Q_PROJ = "/model/layers.0/self_attn/q_proj"
GATE_PROJ = "/model/layers.0/mlp/gate_proj"


def test_calibrate_writes_the_smoothed_static_input_scale(llama_dir, tmp_path, llama_reference_scales):
    from safetensors.torch import load_file

    from graphcal.calibration.pipeline import calibrate
    from tests.helpers import sqnr_db

    result = calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "out", scheme="W8A8_STATIC",
                       smoothquant="norms")
    written = load_file(str(tmp_path / "out" / "qparams.safetensors"))
    expected = llama_reference_scales(Q_PROJ, 0.5)  # llm-compressor's default strength
    # smoothing moves the scale, so the comparison below can tell a smoothed input from an unsmoothed one
    assert not torch.allclose(expected, llama_reference_scales(Q_PROJ, None), rtol=1e-2)
    for p in "qkv":  # q, k and v read the same smoothed activation
        got = written[f"model.layers.0.self_attn.{p}_proj.input_scale"]
        # graphcal multiplies by float32(1/s) where the reference divides: an ulp or two (seen: 1e-7)
        _close(got.reshape(-1), expected.reshape(-1), 1e-6, f"{p}_proj.input_scale")

    # the written model loads and runs in onnxruntime at its default settings (ORT_ENABLE_ALL), close to fp32
    with np.load(llama_dir / "heldout.npz") as data:
        feeds = dict(data)
    ref = _session(llama_dir / "model.onnx").run(None, feeds)[0]
    _session(tmp_path / "out" / "model.onnx", level="all")  # it loads at the default level
    out = _session(tmp_path / "out" / "model.onnx", level=INT8_LEVEL).run(None, feeds)[0]
    assert np.isfinite(out).all()
    assert sqnr_db(ref, out) > 25, sqnr_db(ref, out)
    assert result.warnings == []


# ------------------------------------------------------------------------------------------
# 6. Recipes and inspect; 7. usage errors
# ------------------------------------------------------------------------------------------

# Mappings nested deeper than [[balance], smooth]: llm-compressor flattens them, the last leaf is the
# smooth layer. Only input_layernorm -> q/k/v; post_attention_layernorm is left alone.
NESTED_RECIPE = """
quant_stage:
  quant_modifiers:
    SmoothQuantModifier:
      smoothing_strength: 0.7
      mappings:
        - [[["re:.*q_proj"], ["re:.*k_proj", "re:.*v_proj"]], "re:.*input_layernorm"]
    QuantizationModifier:
      targets: [Linear]
      ignore: [lm_head]
      scheme: W8A8_STATIC
"""

DEFAULT_MAPPINGS_RECIPE = """
quant_stage:
  quant_modifiers:
    SmoothQuantModifier: {}
    QuantizationModifier:
      targets: [Linear]
      ignore: [lm_head]
      scheme: W8A8_STATIC
"""



def _run(model_dir, out, *args):
    return run_cli("run", model_dir / "model.onnx", "--data", model_dir / "calib.npz", "-o", out, "-q", *args)


def test_recipe_with_nested_mappings_smooths_what_it_names(llama_dir, tmp_path, llama_reference_scales):
    from safetensors.torch import load_file

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(NESTED_RECIPE)
    result = _run(llama_dir, tmp_path / "out", "--recipe", recipe)
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output, result.output
    written = load_file(str(tmp_path / "out" / "qparams.safetensors"))
    _close(written["model.layers.0.self_attn.q_proj.input_scale"], llama_reference_scales(Q_PROJ, 0.7), 1e-6,
           "q_proj (smoothed, α 0.7)")
    # post_attention_layernorm is in no mapping: gate_proj's input is the unsmoothed one
    _close(written["model.layers.0.mlp.gate_proj.input_scale"], llama_reference_scales(GATE_PROJ, None), 1e-6,
           "gate_proj (not smoothed)")


def test_default_mappings_match_nothing_in_bert(bert_dir, tmp_path):
    """llm-compressor's default (Llama) mappings match nothing in a BERT: it does nothing, with no error."""
    from safetensors.torch import load_file

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(DEFAULT_MAPPINGS_RECIPE)
    result = _run(bert_dir, tmp_path / "sq", "--recipe", recipe)
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert any("re:.*input_layernorm" in w and "matches nothing" in w for w in warnings), result.output
    assert any("re:.*post_attention_layernorm" in w and "matches nothing" in w for w in warnings), result.output
    plain = _run(bert_dir, tmp_path / "plain", "--scheme", "W8A8_STATIC")
    assert plain.exit_code == 0, plain.output
    got, expected = (load_file(str(tmp_path / d / "qparams.safetensors")) for d in ("sq", "plain"))
    assert got.keys() == expected.keys()
    for key in expected:  # nothing smoothed: every scale as without the SmoothQuantModifier
        assert torch.equal(got[key], expected[key]), key
    assert (tmp_path / "sq" / "model.onnx").read_bytes() == (tmp_path / "plain" / "model.onnx").read_bytes()


def test_inspect_lists_the_mappings(llama_dir):
    result = run_cli("inspect", llama_dir / "model.onnx", "--smoothquant", "all", "--smoothing-strength", "0.6", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["smoothquant"]
    assert (report["scope"], report["strength"], report["algorithm"]) == ("all", 0.6, "smoothquant")
    got = {tuple(m["balance"]): (m["smooth"], m["kind"], False) for m in report["mappings"]}
    assert got == _expected_llama("all") and len(report["mappings"]) == len(got)
    # o_proj has no exact fold: said so, not smoothed
    assert [n for n in report["not_smoothed"] if "o_proj" in n] and len(report["not_smoothed"]) == 2


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("command", ["run", "inspect"])
def test_bad_smoothing_strength_is_one_line(llama_dir, tmp_path, command, value):
    out = tmp_path / "out"
    result = run_cli(command, llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", out,
                     f"--smoothing-strength={value}")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "smoothing strength" in lines[0], result.output
    assert "Traceback" not in result.output
    assert not out.exists()


# The same mapping twice: llm-compressor keys its statistics by smooth layer name, and _apply_smoothing
# skips a mapping whose statistics an earlier one consumed, so it smooths each layer once.
DUPLICATE_RECIPE = """
quant_stage:
  quant_modifiers:
    SmoothQuantModifier:
      mappings:
        - [["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"]
        - [["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"]
    QuantizationModifier:
      targets: [Linear]
      ignore: [lm_head]
      scheme: W8A8_STATIC
"""


def test_a_mapping_given_twice_smooths_once(llama_dir, tmp_path, llama_reference_scales):
    from safetensors.torch import load_file

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(DUPLICATE_RECIPE)
    result = _run(llama_dir, tmp_path / "out", "--recipe", recipe)
    assert result.exit_code == 0, result.output
    written = load_file(str(tmp_path / "out" / "qparams.safetensors"))
    _close(written["model.layers.0.self_attn.q_proj.input_scale"], llama_reference_scales(Q_PROJ, 0.5), 1e-6,
           "q_proj (smoothed once)")
    # and the weights are balanced once too: the model still computes what the original does
    from tests.helpers import sqnr_db

    with np.load(llama_dir / "heldout.npz") as data:
        feeds = dict(data)
    ref = _session(llama_dir / "model.onnx").run(None, feeds)[0]
    _session(tmp_path / "out" / "model.onnx", level="all")  # it loads at the default level
    assert sqnr_db(ref, _session(tmp_path / "out" / "model.onnx", level=INT8_LEVEL).run(None, feeds)[0]) > 25


# ------------------------------------------------------------------------------------------
# --smoothing-strength auto (graphcal's extension)
# ------------------------------------------------------------------------------------------


def _fake_int8(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 with compressed-tensors' qparams for the given extrema (broadcast over ``x``)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor")
    scale, _ = calculate_qparams(lo, hi, args)
    return torch.clamp(torch.round(x / scale), -128, 127) * scale


def test_auto_strength_picks_the_grid_point_with_the_least_output_error(llama_dir, tmp_path):
    """With every calibration row sampled (128 rows, under the 256 the search keeps), the strength
    graphcal chose for input_layernorm -> q/k/v minimises, over 0.1 ... 1.0, the error of q/k/v's
    outputs under W8A8_STATIC, computed here independently: per-tensor static int8 of x/s from its
    extrema, per-output-channel int8 of W*s, the squared error of X W^T summed over q, k, v."""
    with np.load(llama_dir / "calib.npz") as data:
        calib = {k: v[:4] for k, v in data.items()}
    np.savez(tmp_path / "calib.npz", **calib)
    from graphcal.calibration.pipeline import calibrate

    calibrate(llama_dir / "model.onnx", tmp_path / "calib.npz", tmp_path / "out", scheme="W8A8_STATIC",
              smoothquant="norms", smoothing_strength="auto", batch_size=4)
    written = onnx.load(tmp_path / "out" / "model.onnx")
    record = json.loads(next(p.value for p in written.metadata_props if p.key == "graphcal.smoothquant"))
    assert record["strength"] == "auto"
    chosen = next(m["strength"] for m in record["mappings"] if m["smooth"] == "model.layers.0.input_layernorm")

    original = onnx.load(llama_dir / "model.onnx")
    x_name = _node(original, f"{Q_PROJ}/MatMul").input[0]
    x = torch.from_numpy(_session(_tap(original, [x_name])).run([x_name], calib)[0]).reshape(-1, 128).double()
    balance = [n for n in original.graph.node if n.op_type == "MatMul" and n.input[0] == x_name]
    weights = [torch.from_numpy(_const(original, n.input[1])).T.double() for n in balance]
    columns_max = torch.cat([w.abs() for w in weights]).amax(0)
    errors = {}
    for alpha in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
        s = _smoothquant_scales(x.amin(0), x.amax(0), columns_max, alpha)
        xs = x / s
        xq = _fake_int8(xs, xs.min().reshape(1), xs.max().reshape(1))
        total = 0.0
        for w in weights:
            ws = w * s[None, :]
            wq = _fake_int8(ws, ws.amin(1, keepdim=True), ws.amax(1, keepdim=True))
            total += float(((x @ w.T - xq @ wq.T) ** 2).sum())
        errors[alpha] = total
    best = min(errors.values())
    assert max(errors.values()) > 1.05 * best, errors  # the grid matters here: a wrong pick shows
    assert errors[chosen] <= best * (1 + 1e-3), (chosen, errors)


def test_auto_strength_from_the_command_line(llama_dir, tmp_path):
    result = _run(llama_dir, tmp_path / "out", "--smoothing-strength", "auto", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert len(summary["smoothquant"]) == 4  # --smoothing-strength implies --smoothquant (norms)
    bad = _run(llama_dir, tmp_path / "bad", "--smoothing-strength", "often")
    assert bad.exit_code == 2 and "smoothing strength must be a number or auto" in bad.output
    assert len(bad.output.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------
# eval: the SmoothQuant advice, and --isolated on a smoothed model
# ------------------------------------------------------------------------------------------


def _agreement(name: str, sqnr: float):
    from graphcal.evaluation import Agreement

    a = Agreement(name)
    a.add(np.ones(100), np.ones(100) + 10 ** (-sqnr / 20))  # error power 10^(-sqnr/10) of the reference's
    return a


def test_eval_suggests_the_scope_that_smooths_the_flagged_layers(llama_dir):
    from graphcal.evaluation import EvalReport
    from graphcal.evaluation import smoothable_layers as _smoothable
    from graphcal.graph.targets import find_targets

    model = onnx.load(llama_dir / "model.onnx")
    targets = find_targets(model)[0]
    smoothable = _smoothable(model, targets, {})
    assert smoothable["model.layers.0.self_attn.q_proj"] == "norms"
    assert smoothable["model.layers.0.mlp.down_proj"] == "all"  # folded into up_proj
    assert smoothable["model.layers.0.self_attn.o_proj"] == "mul"  # only an explicit Mul is exact
    # layers the model's own record says were smoothed are not suggested again
    record = {"mappings": [{"balance": ["model.layers.0.mlp.down_proj"]}]}
    assert "model.layers.0.mlp.down_proj" not in _smoothable(model, targets, record)

    names = [t.name for t in targets if t.name != "lm_head"]
    layers = [_agreement(n, 10.0 if n.endswith("down_proj") else 30.0) for n in names]
    report = EvalReport([], layers, 16, 2, "onnxruntime", smoothable=smoothable)
    assert set(report.suggested_ignore()) == {n for n in names if n.endswith("down_proj")}
    assert report.suggested_smoothquant() == ["--smoothquant", "all"]
    assert report.as_dict()["suggested_smoothquant"] == ["--smoothquant", "all"]
    layers = [_agreement(n, 10.0 if n.endswith(("down_proj", "o_proj")) else 30.0) for n in names]
    assert EvalReport([], layers, 16, 2, "onnxruntime", smoothable=smoothable).suggested_smoothquant() == [
        "--smoothquant", "mul"]
    layers = [_agreement(n, 10.0 if n.endswith("q_proj") else 30.0) for n in names]
    assert EvalReport([], layers, 16, 2, "onnxruntime", smoothable=smoothable).suggested_smoothquant() == [
        "--smoothquant"]


def test_eval_isolated_refuses_a_folded_smoothing(llama_dir, tmp_path):
    from graphcal.calibration.pipeline import calibrate
    from graphcal.errors import UsageError
    from graphcal.evaluation import evaluate

    calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "out", scheme="W8A8_STATIC",
              smoothquant="norms")
    with pytest.raises(UsageError, match="--isolated cannot feed them fp32 inputs"):
        evaluate(llama_dir / "model.onnx", tmp_path / "out" / "model.onnx", llama_dir / "heldout.npz", isolated=True)
    report = evaluate(llama_dir / "model.onnx", tmp_path / "out" / "model.onnx", llama_dir / "heldout.npz")
    assert report.outputs[0].sqnr_db > 25
    # q/k/v and gate/up were smoothed: no advice points back at them
    assert not {"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"} & set(report.smoothable)
