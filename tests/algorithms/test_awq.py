"""graphcal.algorithms.awq.math against llm-compressor 0.14's AWQ test vectors (shared/reference/algorithm_vectors.pt, ``awq``).

Each case is a block ``x + mlp(post_attention_layernorm(x))``, ``mlp(h) = down(silu(gate(h)) * up(h))``
(RMSNorm eps 1e-6, no biases) and two mappings, searched in order: norm -> [gate, up] with the parent
``layers.0.mlp`` (input h, output mlp(h)), then up -> [down] with the parent ``down_proj`` itself, whose
cached inputs were captured in the calibration pass, before the first mapping rescaled gate and up.
Every check is exact (torch single-threaded, CPU, as the vectors were made).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

from graphcal.algorithms.awq import math as awq
from graphcal.algorithms.awq.gram import Gram, LayerLoss
from tests.helpers import ALGORITHM_VECTORS, ulps_apart

VECTORS = ALGORITHM_VECTORS
PREFIX = "layers.0."
NORM = PREFIX + "post_attention_layernorm.weight"
PROJ = ("gate", "up", "down")

pytestmark = pytest.mark.skipif(not VECTORS.exists(), reason="the shared reference vectors are not here")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    return torch.load(VECTORS, weights_only=True)["awq"]


def case_ids():
    if not VECTORS.exists():
        return []
    return [c["name"] for c in torch.load(VECTORS, weights_only=True)["awq"]]


# ----------------------------------------------------------------------------------------------- the block

def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm: in fp32, back to the input dtype, times the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return weight * h.to(x.dtype)


def mlp(h: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.linear(F.silu(F.linear(h, w["gate"])) * F.linear(h, w["up"]), w["down"])


def weights_of(params: dict) -> dict[str, torch.Tensor]:
    return {k: params[f"{PREFIX}mlp.{k}_proj.weight"] for k in PROJ}


def run_case(case: dict, gram: bool = False, **search_kwargs) -> dict:
    """Both mappings of a case through graphcal.algorithms.awq.math, as llm-compressor runs them: statistics and cached
    parent inputs from one calibration pass with the original weights, then search + apply in order."""
    a = case["args"]
    qargs = QuantizationArgs(**a["quant_args"])
    w = dict(weights_of(case["inputs"]["params"]))
    norm = case["inputs"]["params"][NORM]
    hidden = [rms_norm(x, norm) for x in case["inputs"]["activations"]]  # the mlp's cached inputs
    down_in = [F.silu(F.linear(h, w["gate"])) * F.linear(h, w["up"]) for h in hidden]  # down_proj's cached inputs
    out = {"mappings": []}
    for inputs, balance in ((hidden, ("gate", "up")), (down_in, ("down",))):
        stats = awq.AbsMean()
        for x in inputs:
            stats.update(x)
        if balance == ("down",):
            def parent(ws, inputs=inputs):
                return (F.linear(x, ws["down"]) for x in inputs)
        else:
            def parent(ws, inputs=inputs, current=dict(w)):
                return (mlp(h, {**current, **ws}) for h in inputs)
        names = {b: f"{PREFIX}mlp.{b}_proj" for b in balance}
        objective = lambda ws, parent=parent: parent({b: ws[names[b]] for b in balance})  # noqa: E731
        if gram and balance == ("down",):  # graphcal's stage: a one-layer parent scored from its input's Gram matrix
            moments = Gram()
            for x in inputs:
                moments.update(x)
            objective = LayerLoss(moments)
        result = awq.search(stats.value(), {names[b]: w[b] for b in balance}, {names[b]: qargs for b in balance},
                            objective, duo_scaling=a["duo_scaling"], n_grid=a["n_grid"], **search_kwargs)
        out["mappings"].append({"stats": stats, "result": result})
        for b in balance:
            w[b] = awq.apply(w[b], result.scales)
        if balance == ("down",):
            w["up"] = awq.divide(w["up"], result.scales)
        else:
            norm = awq.divide(norm, result.scales)
    out["params"] = {NORM: norm, **{f"{PREFIX}mlp.{k}_proj.weight": w[k] for k in PROJ}}
    return out


def _same_search(losses: list[float], want: list[float]) -> bool:
    """The grid's losses pick the same point with the same loss, bit for bit; the others agree to
    10%: the scales of each point come from torch's vectorized pow, whose last bit depends on the
    instruction set (AVX2 / AVX-512), and on these small layers one code rounding the other way
    moves a point's loss by up to 5%."""
    if len(losses) != len(want) or not want:
        return False
    best = min(range(len(want)), key=want.__getitem__)
    return (min(range(len(losses)), key=losses.__getitem__) == best and losses[best] == want[best]
            and all(abs(a - b) <= 0.1 * abs(b) for a, b in zip(losses, want)))


def mismatches(case: dict, got: dict) -> list[str]:
    """Every field of the case's outputs that ``got`` does not reproduce: exactly, except the last
    bit of what torch's vectorized kernels compute on another instruction set than the vectors' CPU
    (the grid's losses, :func:`_same_search`; the best scales, to 2 ulps). The written parameters
    are compared bit for bit."""
    bad = []
    for i, (want, have) in enumerate(zip(case["outputs"]["mappings"], got["mappings"], strict=True)):
        stats, r = have["stats"], have["result"]
        checks = {
            "x_abs_sum": torch.equal(stats.sum, want["x_abs_sum"]),
            "x_count": stats.count == want["x_count"],
            "x_mean": torch.equal(r.x_mean, want["x_mean"]),
            "grid": list(r.grid) == [tuple(p) for p in case["args"]["grid"]],
            "grid_losses": _same_search(list(r.losses), want["grid_losses"]),
            "best_scales": r.scales.dtype == want["best_scales"].dtype and ulps_apart(r.scales, want["best_scales"]) <= 2,
            "error_metrics": r.error_metrics(want["smooth_name"], want["parent_name"]) == want["error_metrics"],
        }
        if r.w_mean is not None:  # the vectors hold w_mean for every case; the search needs it with duo scaling
            checks["w_mean"] = r.w_mean.dtype == torch.float64 and torch.equal(r.w_mean, want["w_mean"])
        bad += [f"mapping {i} {k}" for k, ok in checks.items() if not ok]
    for name, value in case["outputs"]["params"].items():
        if not (got["params"][name].dtype == value.dtype and torch.equal(got["params"][name], value)):
            bad.append(f"param {name}")
    return bad


# ----------------------------------------------------------------------------------------------- the vectors

@pytest.mark.parametrize("index", range(len(case_ids())), ids=case_ids())
def test_case_is_bit_exact(cases, index):
    case = cases[index]
    assert mismatches(case, run_case(case)) == []


@pytest.mark.parametrize("index", range(len(case_ids())), ids=case_ids())
def test_a_one_layer_parent_scored_from_the_gram_matrix_is_llmcompressors_search(cases, index):
    """down_proj's parent is the layer itself: its output's MSE from the input's Gram matrix (what
    the stage does, with no run of the parent) gives the best point's loss to float rounding, picks
    the vectors' point and writes the vectors' parameters bit for bit."""
    case = cases[index]
    got = run_case(case, gram=True)
    want = case["outputs"]["mappings"][1]["grid_losses"]
    losses = got["mappings"][1]["result"].losses
    best = min(range(len(want)), key=want.__getitem__)
    assert got["mappings"][1]["result"].best_index == best
    assert abs(losses[best] - want[best]) <= 1e-5 * want[best]
    # the other points to 10%: each point's scales carry the last bit of torch's vectorized pow (_same_search)
    assert all(abs(a - b) <= 0.1 * abs(b) for a, b in zip(losses, want, strict=True))
    assert [m for m in mismatches(case, got) if "grid_losses" not in m and "error_metrics" not in m] == []


def test_the_layer_loss_is_the_mse_of_the_layers_outputs():
    """LayerLoss from the Gram matrix equals the MSE of the balance layers' outputs side by side."""
    torch.manual_seed(0)
    xs = [torch.randn(2, 5, 8), torch.randn(3, 5, 8)]
    w = {"a": torch.randn(4, 8), "b": torch.randn(6, 8)}
    trial = {"a": w["a"] + 0.01 * torch.randn(4, 8), "b": w["b"]}
    g = Gram()
    for x in xs:
        g.update(x)
    objective = LayerLoss(g)
    assert objective.prepare(w) is None and objective(w) == 0.0
    both = [torch.cat([F.linear(x, ws["a"]), F.linear(x, ws["b"])], dim=-1) for ws in (w, trial) for x in xs]
    assert objective(trial) == pytest.approx(awq.loss(both[:2], both[2:]), rel=1e-5)
    assert LayerLoss(Gram()).prepare(w) == "saw no token"


@pytest.mark.parametrize("index", range(len(case_ids())), ids=case_ids())
def test_weight_mean_and_grid(cases, index):
    case = cases[index]
    a = case["args"]
    qargs = QuantizationArgs(**a["quant_args"])
    assert awq.grid(a["duo_scaling"], a["n_grid"]) == [tuple(p) for p in a["grid"]]
    w = weights_of(case["inputs"]["params"])
    first, second = case["outputs"]["mappings"]
    # w_mean is recorded for every case (from the original weights; up_proj's rows are not rescaled yet
    # when down_proj's mean is taken, and down_proj's columns only after)
    assert torch.equal(awq.weight_mean([w["gate"], w["up"]], [qargs, qargs]), first["w_mean"])
    assert torch.equal(awq.weight_mean([w["down"]], [qargs]), second["w_mean"])


def test_add_sums_matches_update(cases):
    x = cases[0]["inputs"]["activations"]
    a, b = awq.AbsMean(), awq.AbsMean()
    for t in x:
        a.update(t)
        b.add_sums(t.abs().reshape(-1, t.shape[-1]).float().sum(0), t.shape[0] * t.shape[1])
    assert torch.equal(a.value(), b.value()) and a.count == b.count == 64
    masked = awq.AbsMean()
    mask = torch.zeros(2, 16)
    mask[:, :5] = 1
    masked.update(x[0], mask)
    assert masked.count == 10 and torch.equal(masked.sum, x[0][:, :5].abs().reshape(-1, 32).sum(0))
    with pytest.raises(ValueError, match="no tokens"):
        awq.AbsMean().value()


# ----------------------------------------------------------------------------------------------- the checks can fail

def test_a_wrong_grid_is_caught(cases, monkeypatch):
    """Spacing the duo points by 1/(n_grid - 1) instead of 1/(n_grid - 2) moves the best scales."""
    case = cases[0]
    monkeypatch.setattr(awq, "grid", lambda duo, n: [(0.0, False)] + [(k / (n - 1), True) for k in range(n - 1)])
    bad = mismatches(case, run_case(case))
    assert "mapping 0 grid" in bad and "mapping 0 grid_losses" in bad and "mapping 0 best_scales" in bad


def test_a_reordered_grid_is_caught(cases, monkeypatch):
    """"both" with the duo point first at each ratio: the losses no longer line up with the grid."""
    case = cases[2]
    monkeypatch.setattr(awq, "grid", lambda duo, n: [(k / (n // 2 - 1), d) for k in range(n // 2) for d in (True, False)])
    bad = mismatches(case, run_case(case))
    assert "mapping 0 grid_losses" in bad and "mapping 0 error_metrics" in bad


def test_the_loss_dtype_is_caught(cases, monkeypatch):
    """Accumulating the loss in Python floats (fp64) instead of fp32 changes the recorded losses."""
    def fp64_loss(refs, outs):
        return sum(F.mse_loss(r, o, reduction="sum").item() for r, o in zip(refs, outs)) / sum(r.numel() for r in refs)

    monkeypatch.setattr(awq, "mean_squared_error", lambda refs, outs: torch.tensor(fp64_loss(refs, list(outs)),
                                                                                 dtype=torch.float64))
    assert "mapping 0 grid_losses" in mismatches(cases[0], run_case(cases[0]))


def test_scale_dtype_is_caught(cases, monkeypatch):
    """Duo scales in fp32 (w_mean cast down) change the best scales and the final weights."""
    real = awq.candidate_scales
    monkeypatch.setattr(awq, "candidate_scales", lambda x, w, r, d: real(x, None if w is None else w.float(), r, d))
    bad = mismatches(cases[0], run_case(cases[0]))
    assert "mapping 0 best_scales" in bad and f"param {NORM}" in bad


def test_down_inputs_after_smoothing_are_caught(cases):
    """down_proj's statistics come from the calibration pass's cache: recomputed with the gate/up/norm
    weights as the first mapping leaves them, they differ (in the last bits)."""
    case = cases[0]
    s = case["outputs"]["mappings"][0]["best_scales"]
    w = weights_of(case["inputs"]["params"])
    norm = awq.divide(case["inputs"]["params"][NORM], s)
    gate, up = awq.apply(w["gate"], s), awq.apply(w["up"], s)
    stats = awq.AbsMean()
    for x in case["inputs"]["activations"]:
        h = rms_norm(x, norm)
        stats.update(F.silu(F.linear(h, gate)) * F.linear(h, up))
    want = case["outputs"]["mappings"][1]["x_abs_sum"]
    assert torch.equal(run_case(case)["mappings"][1]["stats"].sum, want)
    assert not torch.equal(stats.sum, want)


# ----------------------------------------------------------------------------------------------- the rest of the API

def test_grid_errors():
    assert awq.grid(True, 3) == [(0.0, False), (0.0, True), (1.0, True)]
    assert awq.grid(False, 2) == [(0.0, False), (1.0, False)]
    assert awq.grid("both", 5) == [(0.0, False), (0.0, True), (1.0, False), (1.0, True)]
    for duo, n in ((True, 2), (True, 1), (False, 1), (False, 0), ("both", 3), ("both", 0)):
        with pytest.raises(ValueError, match="n_grid must be at least"):
            awq.grid(duo, n)
    for duo in ("Both", "true", 1, None):
        with pytest.raises(ValueError, match="duo_scaling must be"):
            awq.grid(duo, 20)
    with pytest.raises(ValueError, match="must be an integer"):
        awq.grid(True, 20.0)


def naive_weight_mean(w: torch.Tensor, chunk_rows: int, chunk_cols: int) -> torch.Tensor:
    out = torch.empty_like(w)
    for i in range(0, w.shape[0], chunk_rows):
        for j in range(0, w.shape[1], chunk_cols):
            block = w[i:i + chunk_rows, j:j + chunk_cols].abs()
            out[i:i + chunk_rows, j:j + chunk_cols] = block / (block.max() + 1e-6)
    return out.double().sum(0) / w.shape[0]


@pytest.mark.parametrize("strategy, extra, chunk", [
    ("tensor", {}, (10, 12)), ("channel", {}, (1, 12)), ("group", {"group_size": 4}, (1, 4)),
    ("block", {"block_structure": [4, 5]}, (4, 5)), ("block", {"block_structure": [5, 4]}, (5, 4)),
])
def test_weight_mean_strategies(strategy, extra, chunk):
    w = torch.randn(10, 12, generator=torch.Generator().manual_seed(0))
    args = QuantizationArgs(num_bits=4, strategy=strategy, **extra)
    got = awq.weight_mean([w, w * 2, w], [args, args, None])  # a layer without a scheme is left out
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, naive_weight_mean(w, *chunk), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="no balance layer"):
        awq.weight_mean([w], [None])


def test_candidate_scales():
    x = torch.tensor([0.0, 1.0, 4.0, float("nan")])
    s = awq.candidate_scales(x, None, 0.5, False)
    assert s.dtype == torch.float32 and s[3] == 1  # nan -> 1
    assert torch.equal(awq.candidate_scales(torch.rand(5), None, 0.0, False), torch.ones(5))
    s = awq.candidate_scales(torch.rand(5) + 0.1, torch.rand(5, dtype=torch.float64) + 0.1, 0.3, True)
    assert s.dtype == torch.float64 and math.isclose(s.max().item() * s.min().item(), 1.0, rel_tol=1e-12)


def test_apply_and_divide_round_once():
    w = torch.randn(6, 4, dtype=torch.float16)
    s = torch.rand(4, dtype=torch.float64) + 0.5
    assert torch.equal(awq.apply(w, s), (w.double() * s).half())
    norm = torch.randn(4)
    assert torch.equal(awq.divide(norm, s), (norm.double() / s).float())
    up = torch.randn(6, 3)
    got = awq.divide(up, s)  # the last 4 rows only
    assert torch.equal(got[:2], up[:2]) and torch.equal(got[2:], (up[2:].double() / s[:, None]).float())
    with pytest.raises(ValueError):
        awq.apply(w, torch.ones(3))
    with pytest.raises(ValueError):
        awq.divide(torch.ones(3), s)


def linear_parent(xs):
    return lambda ws: [F.linear(x, ws["a"]) for x in xs]


def test_ties_keep_the_first_point_and_unquantized_layers_stay():
    xs = [torch.randn(3, 8)]
    w = torch.randn(5, 8)
    # the parent ignores the weights: every loss is 0, the identity (first point) wins
    r = awq.search(torch.rand(8) + 0.1, {"a": w}, {"a": QuantizationArgs(num_bits=4, strategy="channel")},
                   lambda ws: [torch.ones(2)], duo_scaling=True, n_grid=5)
    assert r.losses == (0.0,) * 5 and r.best_index == 0 and torch.equal(r.scales, torch.ones(8))
    assert r.reduction == 1.0
    seen = []
    r = awq.search(torch.rand(8) + 0.1, {"a": w, "b": w}, {"a": QuantizationArgs(num_bits=4, strategy="channel")},
                   lambda ws: seen.append(ws["b"]) or linear_parent(xs)(ws), duo_scaling=False, n_grid=4)
    assert all(b is w for b in seen) and len(seen) == 5


def test_search_errors_and_skips(caplog):
    w = torch.randn(5, 8)
    x = torch.rand(8) + 0.1
    tensor = QuantizationArgs(num_bits=4, strategy="tensor")
    with pytest.raises(ValueError, match="TENSOR"):
        awq.search(x, {"a": w}, {"a": tensor}, linear_parent([x[None]]))
    assert awq.search(x, {"a": w}, {"a": tensor}, linear_parent([x[None]]), duo_scaling=False) is not None
    with pytest.raises(ValueError, match="no balance layer"):
        awq.search(x, {"a": w}, {}, linear_parent([x[None]]))
    with pytest.raises(ValueError, match="finite loss"):
        awq.search(x, {"a": w}, {"a": tensor}, lambda ws: [torch.ones(2)] if ws["a"] is w else [torch.full((2,), math.nan)],
                   duo_scaling=False)
    assert awq.search(x, {"a": w}, {"a": tensor}, lambda ws: [], duo_scaling=False) is None
    assert awq.search(x, {"a": w}, {"a": tensor}, lambda ws: [torch.tensor([math.inf])], duo_scaling=False) is None
    assert "skipped" in caplog.text
    with pytest.raises(ValueError, match="not balance layers"):
        awq.search(x, {"a": w}, {"a": tensor, "z": tensor}, linear_parent([x[None]]), duo_scaling=False)


def test_fused_global_scale_is_shared():
    """TENSOR_GROUP (NVFP4) gate/up share one global scale during the search when named as a fused group."""
    g = torch.Generator().manual_seed(1)
    w = {"gate": torch.randn(4, 16, generator=g), "up": torch.randn(4, 16, generator=g) * 10}
    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=8, scale_dtype=torch.float8_e4m3fn)
    s = torch.rand(16, dtype=torch.float64) + 0.5

    def reference(fused: bool) -> dict[str, torch.Tensor]:
        scaled = {n: awq.apply(w[n], s) for n in w}
        joint = torch.maximum(scaled["gate"].abs().max(), scaled["up"].abs().max())
        out = {}
        for n in w:
            absmax = joint if fused else scaled[n].abs().max()
            global_scale = generate_gparam(-absmax, absmax)
            flat = scaled[n].reshape(4, 2, 8)
            scale, zp = calculate_qparams(flat.amin(-1), flat.amax(-1), args, global_scale=global_scale)
            fq = fake_quantize(scaled[n], scale, zp, args, global_scale=global_scale)
            out[n] = (fq.double() / s).float()
        return out

    for groups in ((), [("gate", "up")]):
        got = awq.quantize_scaled(w, {"gate": args, "up": args}, s, groups)
        want = reference(bool(groups))
        assert all(torch.equal(got[n], want[n]) for n in w)
    separate = awq.quantize_scaled(w, {"gate": args, "up": args}, s)
    fused = awq.quantize_scaled(w, {"gate": args, "up": args}, s, [("gate", "up")])
    assert not torch.equal(separate["gate"], fused["gate"]) and torch.equal(separate["up"], fused["up"])


def test_search_ignores_the_schemes_observer():
    """The scheme's observer (here MSE, with kwargs) is replaced by memoryless min-max in the search."""
    w = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    s = torch.rand(8) + 0.5
    mse = QuantizationArgs(num_bits=4, strategy="channel", observer="memoryless_mse", observer_kwargs={"maxshrink": 0.5})
    plain = QuantizationArgs(num_bits=4, strategy="channel")
    assert torch.equal(awq.quantize_scaled({"a": w}, {"a": mse}, s)["a"], awq.quantize_scaled({"a": w}, {"a": plain}, s)["a"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scaling_in_the_weights_dtype_is_the_fp64_product_rounded_once(dtype):
    """apply (W * s) and the division back (Q / s) run in the weight's dtype when s has it: bit for
    bit what fp64 then one rounding gives, over weights and scales spanning 12 decades."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 512, generator=gen) * torch.logspace(-4, 2, 512)).to(dtype)
    s = (torch.rand(512, generator=gen) * 50 + 1e-3).to(dtype)
    assert torch.equal(awq.apply(w, s), (w.double() * s.double()[None, :]).to(dtype))
    args = QuantizationArgs(num_bits=4, strategy="group", group_size=64, symmetric=True)
    got = awq.quantize_scaled({"w": w}, {"w": args}, s)["w"]
    scaled = (w.double() * s.double()[None, :]).to(dtype)
    again = awq.quantize_scaled({"w": scaled}, {"w": args}, torch.ones(512, dtype=dtype))["w"]  # Q(W s), unscaled
    assert torch.equal(got, (again.double() / s.double()[None, :]).to(dtype))
