"""GPTQ and AWQ on the ONNX graph, end to end, against llm-compressor's own results.

The reference: llm-compressor 0.14's ``oneshot`` on its tiny random Llama (shared/reference/
algorithm_vectors.pt, ``e2e``; algorithms.md §8.4), run in torch. graphcal exports the same model
with its exporter, feeds the same batches through onnxruntime and must give the same numbers:

* GPTQ (sequential order, as llm-compressor's default pipeline): the same grid, and every int code
  equal. Why not bit-exact floats: graphcal's Hessians are ``X^T X`` computed inside onnxruntime
  (summed in another order than torch's, ~1e-7 relative), and layer 1's inputs come from
  onnxruntime's run of the quantized layer 0; the codes still agree everywhere and the losses to
  1e-4 relative.
* AWQ (+ QuantizationModifier): every mapping picks the same grid point; the scales (fp64) agree to
  1e-6 relative (the |x| means come from onnxruntime's activations), and so do the smoothed weights
  and norms.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from graphcal.calibration.observe import ObserverSet
from graphcal.calibration.plan import load, plan
from graphcal.data import graph_inputs, load_data
from graphcal.graph.targets import torch_weight
from tests.helpers import ALGORITHM_VECTORS, EXPORTER_CHATTER, reference_llama, run_cli, sqnr_db

VECTORS = ALGORITHM_VECTORS

pytestmark = [*EXPORTER_CHATTER, pytest.mark.skipif(not VECTORS.exists(), reason="reference vectors not here")]

GPTQ_W4_RECIPE = """
GPTQModifier:
  config_groups:
    group_0:
      targets: [Linear]
      weights: {num_bits: 4, type: int, symmetric: false, group_size: 32, strategy: group, dynamic: false}
  ignore: [lm_head]
  block_size: 128
  dampening_frac: 0.01
  actorder: null
"""

SQ_GPTQ_RECIPE = """
stage:
  quant_modifiers:
    SmoothQuantModifier: {smoothing_strength: 0.8}
    GPTQModifier: {targets: [Linear], ignore: [lm_head], scheme: W8A8, actorder: static}
"""

AWQ_RECIPE = """
stage:
  quant_modifiers:
    AWQModifier: {duo_scaling: true, n_grid: 20}
    QuantizationModifier:
      config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 4, type: int, symmetric: false, group_size: 32, strategy: group, dynamic: false}
      ignore: [lm_head]
"""


@pytest.fixture(scope="module")
def vectors():
    return torch.load(VECTORS, weights_only=True)


def _case(vectors, name):
    return next(c for c in vectors["e2e"] if c["name"] == name)


@pytest.fixture(scope="module")
def llama(vectors, tmp_path_factory):
    """The reference's tiny Llama (all three e2e cases start from the same init)."""
    case = _case(vectors, "gptq_w4a16_asym_g32_none")
    for other in vectors["e2e"]:
        for key, value in other["inputs"]["init_state_dict"].items():
            assert torch.equal(value, case["inputs"]["init_state_dict"][key])
    path, arrays, logits = reference_llama(case, tmp_path_factory.mktemp("llama"))
    return path, arrays, logits, case["inputs"]["batch_size"]


def _codes(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """round(w / s + zp) with each column's group qparams (the codes of an on-grid weight)."""
    group = w.shape[1] // scale.shape[1]
    s = scale.repeat_interleave(group, dim=1)
    zp = zero_point.repeat_interleave(group, dim=1).float()
    return torch.round(w / s + zp)


def _config(text: str, folder: Path, **flags):
    """A recipe's RunConfig as run resolves it (graphcal.config.resolve: the recipe, then the flags)."""
    from graphcal.config import Options, resolve

    path = folder / "recipe.yaml"
    path.write_text(text)
    return resolve(Options(recipe=path, **flags))


def _planned(path: Path, config):
    """The plan and the model it was made on (the plan holds decisions only; the model is the caller's)."""
    loaded = load(path, config)
    return plan(path, config, loaded=loaded), loaded


def _grid(observers, run, t, w):
    observers.weight_observers[t.name](w)
    return observers.qparams(t, run.schemes[t.name]).qparams["weight"]


@pytest.mark.slow
@pytest.mark.parametrize("name, recipe", [("gptq_w4a16_asym_g32_none", GPTQ_W4_RECIPE),
                                          ("sq_gptq_w8a8", SQ_GPTQ_RECIPE)])
def test_sequential_gptq_gives_llm_compressors_codes(vectors, llama, name, recipe, tmp_path):
    """Sequential GPTQ is the weight pass's order: each weight it writes (recorded here in place of
    the Q/DQ writer) is llm-compressor's, on llm-compressor's grid."""
    from graphcal.calibration.seams import PassSettings
    from graphcal.calibration.transforms.gptq import Sequential
    from graphcal.calibration.transforms.smoothquant import collect
    from graphcal.calibration.weights import quantize_weights
    from graphcal.config import Smoothing

    path, arrays, _, batch_size = llama
    ref = _case(vectors, name)["outputs"]
    run, loaded = _planned(path, _config(recipe, tmp_path))
    assert {t.name for t in run.chosen} == set(ref["weight_codes"])
    calib = load_data(arrays, graph_inputs(loaded.model), batch_size=batch_size)
    smoothed = collect(run, loaded, calib, device="cpu") if run.decision(Smoothing) is not None else None
    observers = ObserverSet(run)
    rounding = Sequential(run, loaded, calib, PassSettings(device="cpu"), smoothed)

    class Recorder:  # the writer's part the weight pass uses
        model, written = loaded.model, {}

        def quantize_weight(self, item, weight):
            assert item.target.name not in self.written
            self.written[item.target.name] = (item, weight)

    writer = Recorder()
    quantize_weights(run, observers, writer, torch.device("cpu"), smoothed=smoothed, rounding=rounding)
    assert set(writer.written) == {t.name for t in run.chosen}
    for t in run.chosen:
        item, q = writer.written[t.name]
        qp = item.qparams["weight"]  # the one grid, taken by the run's observers
        np.testing.assert_allclose(qp.scale, ref["qparams"][f"{t.name}.weight_scale"], rtol=1e-6, atol=0,
                                   err_msg=t.name)
        codes = _codes(q, qp.scale, qp.zero_point)
        assert torch.equal(codes, ref["weight_codes"][t.name].float()), (t.name, float((codes != ref["weight_codes"][
            t.name].float()).float().mean()))
        assert torch.equal(q, (codes - _codes(torch.zeros_like(q), qp.scale, qp.zero_point)) *
                           qp.scale.repeat_interleave(q.shape[1] // qp.scale.shape[1], dim=1))  # on the grid
        expected = ref["gptq"][t.name]
        assert rounding.log.losses[t.name] == pytest.approx(expected["loss"], rel=1e-4), t.name
        assert not expected["rtn_fallback"] and t.name not in rounding.log.rtn_fallback


@pytest.mark.slow
def test_one_pass_gptq_equals_the_sequential_order_on_the_first_layer_only(vectors, llama, tmp_path):
    """One pass takes every Hessian from the float model: layer 0 sees what the sequential order
    sees (the same codes as llm-compressor), layer 1 does not (no error propagated)."""
    from graphcal.calibration.activations import run_activation_pass
    from graphcal.calibration.seams import Member
    from graphcal.calibration.transforms.gptq import OnePass

    path, arrays, _, batch_size = llama
    ref = _case(vectors, "gptq_w4a16_asym_g32_none")["outputs"]
    run, loaded = _planned(path, _config(GPTQ_W4_RECIPE, tmp_path, gptq_order="one-pass"))
    calib = load_data(arrays, graph_inputs(loaded.model), batch_size=batch_size)
    observers = ObserverSet(run)
    assert len({id(h) for h in observers.hessians.values()}) == 8  # q/k/v and gate/up share their input's
    run_activation_pass(run, loaded, observers, calib, device="cpu")
    rounding = OnePass(observers.hessians, run.config.gptq)
    agree = {}
    for t in run.chosen:
        w = torch.from_numpy(torch_weight(loaded.model, t))
        observers.weight_observers[t.name](w)
        item = observers.qparams(t, run.schemes[t.name])
        qp = item.qparams["weight"]
        codes = _codes(rounding([Member(t, w, item)])[t.name], qp.scale, qp.zero_point)
        agree[t.name] = float((codes == ref["weight_codes"][t.name].float()).float().mean())
    layer0 = [v for k, v in agree.items() if ".layers.0." in k]
    layer1 = [v for k, v in agree.items() if ".layers.1." in k]
    assert layer0 == [1.0] * 7
    assert min(layer1) < 1.0  # layer 1's Hessians miss layer 0's rounding error


@pytest.mark.slow
def test_awq_picks_llm_compressors_scales(vectors, llama, tmp_path):
    from graphcal.calibration.transforms.awq import awq_smoothing

    path, arrays, _, batch_size = llama
    ref = _case(vectors, "awq_qm_w4a16_asym_g32")["outputs"]
    run, loaded = _planned(path, _config(AWQ_RECIPE, tmp_path))
    # llm-compressor skips v_proj -> o_proj under grouped-query attention; graphcal finds no exact fold there
    assert any("re:.*v_proj$" in w for w in run.warnings)
    calib = load_data(arrays, graph_inputs(loaded.model), batch_size=batch_size)
    smoothed = awq_smoothing(run, loaded, calib, device="cpu")
    assert {m.smooth for m in smoothed.mappings} == set(ref["awq_best_scales"])
    for m in smoothed.mappings:
        s = smoothed.scales[m.candidate.activation]
        assert s.dtype == torch.float64
        np.testing.assert_allclose(s, ref["awq_best_scales"][m.smooth], rtol=1e-6, atol=0, err_msg=m.smooth)
    observers = ObserverSet(run)
    for t in run.chosen:
        w = smoothed.weight(t, torch.from_numpy(torch_weight(loaded.model, t)))
        expected = ref["changed_params"].get(f"{t.name}.weight")  # o_proj: not smoothed, unchanged
        if expected is None:
            assert not any(t.name in m.balance or t.name == m.candidate.linear for m in smoothed.mappings)
            expected = torch.from_numpy(torch_weight(loaded.model, t))
        np.testing.assert_allclose(w, expected, rtol=0, err_msg=t.name, atol=1e-6 * float(w.abs().max()))
        qp = _grid(observers, run, t, w)  # the QuantizationModifier's min-max grid of the smoothed weight
        np.testing.assert_allclose(qp.scale, ref["qparams"][f"{t.name}.weight_scale"], rtol=1e-5, atol=0)
        zp = ref["qparams"][f"{t.name}.weight_zero_point"]
        assert float((qp.zero_point == zp).float().mean()) > 0.99, t.name  # a zero point at a .5 may round over
    # the norms the scales fold into, as the written model holds them
    smoothed.fold(loaded.model, run, {t.name for t in run.chosen}, dict(loaded.types))
    record = json.loads(next(p.value for p in loaded.model.metadata_props if p.key == "graphcal.awq"))
    assert len(record["mappings"]) == 6
    inits = {i.name: i for i in loaded.model.graph.initializer}
    from onnx import numpy_helper

    for m in smoothed.mappings:
        if m.candidate.kind != "norm":
            continue
        node = next(n for n in loaded.model.graph.node if m.candidate.tensor in n.output)
        (weight,) = [numpy_helper.to_array(inits[i]) for i in node.input if i in inits]
        np.testing.assert_allclose(weight, ref["changed_params"][f"{m.smooth}.weight"], rtol=1e-6, atol=0)


def test_awq_on_some_mappings_and_some_samples(llama_dir, tmp_path):
    """A recipe mapping only up_proj -> down_proj: the last block runs just what down_proj's input
    needs (fed only the inputs that subgraph reads). --awq-samples is recorded in the metadata."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(AWQ_RECIPE.replace("AWQModifier: {duo_scaling: true, n_grid: 20}",
                                         'AWQModifier: {mappings: [{smooth_layer: "re:.*up_proj$", '
                                         'balance_layers: ["re:.*down_proj$"]}]}'))
    out = tmp_path / "o"
    result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--recipe", recipe,
                     "--awq-samples", "8", "-o", out, "-q")
    assert result.exit_code == 0, result.output
    record = json.loads(next(p.value for p in onnx.load(out / "model.onnx").metadata_props if p.key == "graphcal.awq"))
    assert [m["balance"] for m in record["mappings"]] == [["model.layers.0.mlp.down_proj"],
                                                          ["model.layers.1.mlp.down_proj"]]
    assert record["search_samples"] == 8


@pytest.mark.parametrize("samples, batches, want", [(None, 8, list(range(8))), (16, 8, [0, 4]), (8, 8, [0]),
                                                    (1000, 8, list(range(8))), (3, 4, [0, 1, 3])])
def test_awq_scores_parents_on_batches_spread_over_the_data(samples, batches, want):
    from types import SimpleNamespace

    from graphcal.calibration.transforms.awq import search_batches

    per_batch = 8 if batches == 8 else 1
    calib = SimpleNamespace(num_batches=batches, num_samples=batches * per_batch)
    assert search_batches(calib, samples) == want



@pytest.mark.slow
def test_gptq_recipe_writes_llm_compressors_qparams_and_its_weights(vectors, llama, tmp_path):
    """From the command line: the written qparams are llm-compressor's (compressed-tensors names), and
    the written model computes with GPTQ's weights: its logits are those of the torch model holding
    llm-compressor's dequantized codes, far closer than to round-to-nearest's."""
    from safetensors.torch import load_file

    path, arrays, _, _ = llama
    np.savez(tmp_path / "calib.npz", **arrays)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(GPTQ_W4_RECIPE)
    result = run_cli("run", path, "--data", tmp_path / "calib.npz", "-o", tmp_path / "out", "--recipe", recipe,
                     "--batch-size", 2, "--target", "qdq", "--json")
    assert result.exit_code == 0, result.output
    ref = _case(vectors, "gptq_w4a16_asym_g32_none")["outputs"]
    written = load_file(str(tmp_path / "out" / "qparams.safetensors"))
    for key, value in ref["qparams"].items():
        np.testing.assert_allclose(written[key].float(), value.float(), rtol=1e-6, atol=0, err_msg=key)
    config = json.loads((tmp_path / "out" / "quantization_config.json").read_text())
    assert config["config_groups"]["group_0"]["weights"].get("actorder") is None
    got = _logits(tmp_path / "out" / "model.onnx", arrays)
    expected = _torch_logits(vectors, ref, arrays)
    rtn = tmp_path / "rtn"
    assert run_cli("run", path, "--data", tmp_path / "calib.npz", "-o", rtn, "--scheme",
                   '{"weights": {"num_bits": 4, "type": "int", "symmetric": false, "group_size": 32, "strategy": '
                   '"group"}}', "--target", "qdq").exit_code == 0
    assert sqnr_db(expected, got) > 60
    assert sqnr_db(expected, _logits(rtn / "model.onnx", arrays)) < 40


def _logits(model: Path, arrays: dict) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"]).run(None, arrays)[0]


def _torch_logits(vectors, ref, arrays) -> np.ndarray:
    """The reference model with llm-compressor's GPTQ weights (codes and qparams dequantized)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    case = _case(vectors, "gptq_w4a16_asym_g32_none")
    config = LlamaConfig(use_cache=False, **case["inputs"]["llama_config"])
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()
    state = dict(case["inputs"]["init_state_dict"])
    for name, codes in ref["weight_codes"].items():
        scale, zp = ref["qparams"][f"{name}.weight_scale"], ref["qparams"][f"{name}.weight_zero_point"]
        group = codes.shape[1] // scale.shape[1]
        state[f"{name}.weight"] = (codes.float() - zp.repeat_interleave(group, 1).float()) * scale.repeat_interleave(
            group, 1)
    model.load_state_dict(state)
    with torch.no_grad():
        return model(**{k: torch.from_numpy(v) for k, v in arrays.items()}).logits.numpy()


@pytest.mark.slow
def test_awq_from_the_command_line_adds_no_node(llama, tmp_path):
    path, arrays, _, _ = llama
    np.savez(tmp_path / "calib.npz", **arrays)
    out = tmp_path / "out"
    result = run_cli("run", path, "--data", tmp_path / "calib.npz", "-o", out, "--scheme", "W4A16", "--group-size", 32,
                     "--algorithm", "awq", "--target", "qdq", "--json")
    assert result.exit_code == 0, result.output
    rtn = tmp_path / "rtn"
    assert run_cli("run", path, "--data", tmp_path / "calib.npz", "-o", rtn, "--scheme", "W4A16", "--group-size", 32,
                   "--target", "qdq").exit_code == 0
    from collections import Counter

    a, b = onnx.load(str(out / "model.onnx")), onnx.load(str(rtn / "model.onnx"))
    ops, rtn_ops = Counter(n.op_type for n in a.graph.node), Counter(n.op_type for n in b.graph.node)
    assert all(ops[op] <= rtn_ops[op] for op in ops), ops - rtn_ops  # (an Identity copy of a norm may go)
    assert any(p.key == "graphcal.awq" for p in a.metadata_props)


@pytest.mark.parametrize("args, message", [
    (["--block-size", "64"], "--block-size needs --algorithm gptq"),
    (["--duo-scaling", "false"], "--duo-scaling needs --algorithm awq"),
    (["--algorithm", "gptq", "--actorder", "static", "--scheme",
      '{"weights": {"num_bits": 4, "strategy": "group", "group_size": 32, "actorder": null}}'], None),
    (["--algorithm", "awq", "--smoothquant"], "SmoothQuant and AWQ both rescale"),
    (["--algorithm", "awq", "--n-grid", "2"], "AWQ n_grid must be an integer >= 3"),
    (["--awq-samples", "16"], "--awq-samples needs --algorithm awq"),
])
def test_algorithm_flags(llama_dir, args, message):
    result = run_cli("inspect", llama_dir / "model.onnx", "--scheme", "W4A16", "--group-size", "32", *args)
    if message is None:
        assert result.exit_code == 0, result.output
    else:
        assert result.exit_code == 2 and message in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1


def test_one_pass_hessians_that_cannot_fit_are_refused(llama_dir, tmp_path, monkeypatch):
    import graphcal.calibration.transforms.gptq
    import graphcal.limits

    monkeypatch.setattr(graphcal.calibration.transforms.gptq, "hessian_bytes", lambda targets: 1 << 60)
    # one memory figure for both refusals (each prints the memory available when it is read)
    monkeypatch.setattr(graphcal.limits, "available_memory", lambda: 16 * 10**9)
    flags = ["--scheme", "W4A16", "--group-size", "32", "--algorithm", "gptq", "--gptq-order", "one-pass"]
    result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", tmp_path / "o", *flags)
    assert result.exit_code == 1, result.output
    assert "GPTQ's one-pass Hessians needs" in result.output and "--gptq-order sequential" in result.output
    assert not (tmp_path / "o").exists()
    # inspect shares run's pre-flight checks (calibration.prepare), so it refuses the same run the same way
    inspected = run_cli("inspect", llama_dir / "model.onnx", *flags)
    assert inspected.exit_code == 1 and inspected.output.strip().splitlines() == result.output.strip().splitlines()


def test_gptq_on_the_shipped_llama_beats_round_to_nearest(llama_dir, tmp_path):
    """Both orders, on held-out data: GPTQ's logits are nearer fp32 than round-to-nearest's."""
    from graphcal.evaluation import evaluate

    runs = {}
    for label, extra in (("rtn", []), ("gptq", ["--algorithm", "gptq"]),
                         ("gptq1", ["--algorithm", "gptq", "--gptq-order", "one-pass"])):
        out = tmp_path / label
        result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", out, "--scheme",
                         "W4A16", "--group-size", "32", "-q", *extra)
        assert result.exit_code == 0, result.output
        report = evaluate(llama_dir / "model.onnx", out / "model.onnx", llama_dir / "heldout.npz")
        runs[label] = report.outputs[0].sqnr_db
    assert runs["gptq"] > runs["rtn"] + 1 and runs["gptq1"] > runs["rtn"] + 1, runs


def test_layers_stacked_on_one_hessian_round_as_each_alone():
    """q/k/v (one input, one Hessian) are swept once, stacked along their rows: each layer's result
    is the one it gets alone, codes and loss (GPTQ treats rows independently)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from graphcal.calibration.observe import to_qparams
    from graphcal.calibration.seams import Member
    from graphcal.calibration.transforms.gptq import GPTQLog, gptq_weights
    from graphcal.config import GPTQSettings
    from graphcal.observers import make_observer
    from graphcal.types import QuantizedTarget, Target

    torch.manual_seed(0)
    args = QuantizationArgs(num_bits=4, strategy="group", group_size=32, symmetric=False, actorder="static")
    x = torch.randn(512, 96) * torch.linspace(0.1, 3, 96)
    h = 2 * x.T @ x / 4
    members = []
    for name, rows in (("q", 64), ("k", 32), ("v", 32)):
        w = torch.randn(rows, 96)
        obs = make_observer("memoryless_minmax", "weight", args)
        obs(w)
        t = Target(name, name, "MatMul", "x", name, (), "in_out", rows, 96)
        members.append(Member(t, w, QuantizedTarget(t, QuantizationScheme(targets=["Linear"], weights=args),
                                                     {"weight": to_qparams(obs.get_qparams())})))
    settings = GPTQSettings(block_size=32)
    stacked_log, alone_log = GPTQLog(), GPTQLog()
    stacked = gptq_weights(members, h, settings, stacked_log)
    for m in members:
        name = m.target.name
        alone = gptq_weights([m], h, settings, alone_log)[name]
        assert torch.equal(stacked[name], alone), name
        assert stacked_log.losses[name] == pytest.approx(alone_log.losses[name], rel=1e-5)


@pytest.mark.parametrize("order", ["sequential", "one-pass"])
def test_gptq_keeps_the_observers_grid_nvfp4_global_scales_included(llama_dir, tmp_path, order):
    """GPTQ writes the grid the scheme's observer takes from the weights before it (llm-compressor
    fixes it there): NVFP4's shared q/k/v and gate/up global scales and its group scales are RTN's."""
    from safetensors.torch import load_file

    common = ["--data", llama_dir / "calib.npz", "--scheme", "NVFP4A16", "--target", "qdq", "-q"]
    assert run_cli("run", llama_dir / "model.onnx", *common, "-o", tmp_path / "rtn").exit_code == 0
    result = run_cli("run", llama_dir / "model.onnx", *common, "-o", tmp_path / "gptq", "--algorithm", "gptq",
                     "--gptq-order", order)
    assert result.exit_code == 0, result.output
    rtn, gptq = (load_file(str(tmp_path / d / "qparams.safetensors")) for d in ("rtn", "gptq"))
    assert rtn.keys() == gptq.keys() and any(k.endswith("weight_global_scale") for k in rtn)
    for key in rtn:
        assert torch.equal(rtn[key], gptq[key]), key

    def fp4(d):
        return {t.name: onnx.numpy_helper.to_array(t).astype(np.float32) for t in
                onnx.load(str(tmp_path / d / "model.onnx")).graph.initializer if t.data_type == onnx.TensorProto.FLOAT4E2M1}

    a, b = fp4("rtn"), fp4("gptq")
    assert a.keys() == b.keys() and a
    assert np.mean([np.mean(a[k] != b[k]) for k in a]) > 0.05  # GPTQ moved codes, on the same grid


@pytest.mark.parametrize("algorithm", ["gptq", "awq"])
def test_cached_block_inputs_that_cannot_fit_are_refused(llama_dir, tmp_path, monkeypatch, algorithm):
    """Past the memory budget the block cache spills to disk; a disk that cannot take it is refused
    (tests/calibration/test_block_cache.py has the rest)."""
    import collections

    import graphcal.calibration.block_cache as block_cache

    monkeypatch.setattr(block_cache.shutil, "disk_usage", lambda p: collections.namedtuple("U", "total used free")(1, 1, 0))
    result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", tmp_path / "o",
                     "--scheme", "W4A16", "--algorithm", algorithm, "--cache-mb", "0")
    assert result.exit_code == 1, result.output
    line = result.output.strip().splitlines()[-1]
    assert "for 64 samples need" in line and "--num-samples" in line and "--cache-mb" in line, line
    assert not (tmp_path / "o").exists()


def test_a_data_reader_is_refused_where_the_data_is_read_per_block(llama_dir, tmp_path):
    """A CalibrationDataReader is read once: sequential GPTQ and AWQ say so before any work; one-pass runs."""
    from graphcal.calibration.pipeline import calibrate
    from graphcal.config import Options, resolve
    from graphcal.errors import UsageError

    arrays = dict(np.load(llama_dir / "calib.npz"))

    class Reader:
        def __init__(self):
            self.batches = iter([{k: v[i:i + 8] for k, v in arrays.items()} for i in range(0, 64, 8)])

        def get_next(self):
            return next(self.batches, None)

    for algorithm, order in (("gptq", None), ("awq", None)):
        with pytest.raises(UsageError, match="read once"):
            calibrate(llama_dir / "model.onnx", Reader(), tmp_path / "o",
                      config=resolve(Options(scheme="W4A16", algorithm=algorithm, gptq_order=order)))
    result = calibrate(llama_dir / "model.onnx", Reader(), tmp_path / "o1",
                       config=resolve(Options(scheme="W4A16", algorithm="gptq", gptq_order="one-pass")))
    assert result.transforms["gptq"].layers == 14


def test_lm_head_quantized_by_sequential_gptq_keeps_no_logits(llama_dir, tmp_path, monkeypatch):
    """The last block's graph output (logits) is not rerun and cached: nothing after it reads it."""
    import graphcal.calibration.blockwise

    seen = []
    original = graphcal.calibration.blockwise.Blockwise.check_cache
    monkeypatch.setattr(graphcal.calibration.blockwise.Blockwise, "check_cache",
                        lambda self, k, first, what="": (seen.append(sorted(first)), original(self, k, first, what))[1])
    result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", tmp_path / "o",
                     "--scheme", "W4A16", "--algorithm", "gptq", "--ignore", "none", "--json")
    assert result.exit_code == 0, result.output
    assert "lm_head" in json.loads(result.stdout)["quantized"]
    assert seen and all("logits" not in names for names in seen), seen


def test_actorder_from_the_command_line_overrides_the_recipes(tmp_path):
    """--actorder beats the GPTQModifier's, and the schemes get it as llm-compressor resolves it: the
    recipe's static on a scheme without one, or none when the flag says none."""
    recipe = GPTQ_W4_RECIPE.replace("actorder: null", "actorder: static")
    args = lambda config: config.groups["group_0"].weights.actorder  # noqa: E731
    from graphcal.types import enum_value

    assert enum_value(args(_config(recipe, tmp_path))) == "static"
    assert args(_config(recipe, tmp_path, actorder="none")) is None
    assert args(_config(GPTQ_W4_RECIPE, tmp_path)) is None
    assert _config(GPTQ_W4_RECIPE, tmp_path, gptq_order="one-pass").gptq.order == "one-pass"


def test_whole_model_awq_keeps_a_tied_table_tied(tied_builder_model, tmp_path):
    """A builder model with its table tied to lm_head, quantized whole: AWQ leaves out the final
    norm's mapping into lm_head (llm-compressor's mappings never scale lm_head), so the lookup still
    reads lm_head's MatMulNBits bytes and one table is stored. With the table left in float, that
    mapping is searched as before."""
    folder, calib = tied_builder_model
    records = {}
    for name, extra in (("whole", ["--scheme-for", "Embedding=W4A16"]), ("head", [])):
        out = tmp_path / name
        result = run_cli("run", folder / "model.onnx", "--data", calib, "--scheme", "W4A16", "--group-size", "32", "--lm-head",
                         "--matmulnbits", "--algorithm", "awq", "-o", out, *extra)
        assert result.exit_code == 0, result.output
        assert "both tables are stored" not in result.output
        written = onnx.load(str(out / "model.onnx"), load_external_data=False)
        records[name] = json.loads(next(p.value for p in written.metadata_props if p.key == "graphcal.awq"))
        if name == "whole":
            gather = next(n for n in written.graph.node if n.op_type == "GatherBlockQuantized")
            lm_head = next(n for n in written.graph.node if n.name == "/lm_head/MatMul")
            reshape = next(n for n in written.graph.node if n.output[0] == gather.input[0])
            assert lm_head.op_type == "MatMulNBits" and reshape.input[0] == lm_head.input[1]  # one int4 table
    into_head = [[m for m in records[n]["mappings"] if "lm_head" in m["balance"]] for n in ("whole", "head")]
    assert into_head[0] == [] and len(into_head[1]) == 1
    assert len(records["whole"]["mappings"]) == len(records["head"]["mappings"]) - 1 > 0
