"""GPTQ's activation ordering as llm-compressor 0.14 has it, against llm-compressor 0.14.0.1's own numbers.

The vectors (tests/observers/llmc014_vectors.py, made by tools/make_observer_vectors_014.py):

* ``gptq``: llm-compressor's ``quantize_weight`` (eager, CPU, one thread) on a fixed 16x32 weight and a
  Hessian its ``accumulate_hessian`` built, on the grid of the weight observer, with ``actorder``
  None / static / weight, on block strategies (8x8 int4 and asymmetric int8, 6x12 int4 whose tiles do not
  divide the weight, 8x16 fp8), on NVFP4 (also on the nvfp4_expanded_mse grid) and on asymmetric int4
  groups: graphcal's observer gives the same grid and :func:`quantize_weight` the same weight, bit for bit;
* ``actorder_resolution``: what ``GPTQModifier(actorder=...).resolve_quantization_config()`` gives for
  each modifier-level value (unset, null, static, weight, group, dynamic) against each scheme-level
  value (unset, null, static, weight), on block, group and channel weights: graphcal resolves a recipe
  the same way, and refuses where llm-compressor refuses (``static`` and ``weight`` are different
  values there, and an explicit null conflicts with a scheme's order);
* ``actorder_group``: ``group`` (and ``dynamic``, and ``True``) in a scheme is a compressed-tensors
  validation error; at the modifier level llm-compressor takes it without a warning and fails in
  GPTQ after calibrating, with "Invalid activation ordering group": graphcal refuses it with that
  message before reading the model.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from compressed_tensors.quantization import QuantizationArgs

from graphcal.algorithms.gptq.math import quantize_weight
from graphcal.config import Options, resolve
from graphcal.errors import UsageError
from graphcal.observers import Observer
from graphcal.types import enum_value
from tests.observers.llmc014_vectors import VECTORS
from tests.observers.test_llmc014_vectors import TENSORS, assert_qparams, decode

UNSET = "<unset>"


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the vectors were made with one torch thread


@pytest.mark.parametrize("case", VECTORS["gptq"], ids=lambda c: c["name"])
def test_gptq_matches_llm_compressor(case):
    args = QuantizationArgs(**case["args"])
    w = TENSORS["w_gptq"]
    observer = Observer.load_from_registry(case["observer"], base_name="weight", args=args)
    observer(w)
    q = observer.get_qparams()
    assert_qparams(q, case["qparams"])
    result = quantize_weight(w, TENSORS["hessian"], q["scale"], q["zero_point"], q["global_scale"], args,
                             block_size=case["blocksize"], dampening_frac=case["percdamp"])
    assert result.rtn_fallback is case["rtn_fallback"]
    assert (result.perm is None) == (case["args"]["actorder"] is None)
    want = decode(case["weight"])
    assert result.weight.dtype == want.dtype
    assert torch.equal(result.weight, want), (result.weight - want).abs().max()
    assert result.loss == pytest.approx(case["loss"], rel=1e-5, abs=0)


def test_actorder_changes_the_block_results():
    """The vectors exercise the ordering: on every block strategy it changes llm-compressor's weight."""
    cases = {c["name"]: c for c in VECTORS["gptq"]}
    for name in ("int4_block8x8", "int8_block8x8_asym", "int4_block6x12", "fp8_block8x16"):
        plain, ordered = cases[f"{name}_actorder_None"], cases[f"{name}_actorder_static"]
        assert not torch.equal(decode(plain["weight"]), decode(ordered["weight"])), name
        assert ordered["weight"] == cases[f"{name}_actorder_weight"]["weight"]  # static is weight's alias


def _recipe(tmp_path, weights: dict, modifier):
    body = {"config_groups": {"g": {"targets": ["Linear"], "weights": weights}}}
    if modifier != UNSET:
        body["actorder"] = modifier
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"GPTQModifier": body}))
    return path


_FIELDS = {
    "block": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "block", "block_structure": [8, 8]},
    "group": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16},
    "channel": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
}


@pytest.mark.parametrize("case", VECTORS["actorder_resolution"],
                         ids=lambda c: f"{c['strategy']}-modifier_{c['modifier']}-scheme_{c['scheme']}")
def test_modifier_actorder_resolves_as_llm_compressor(tmp_path, case):
    weights = dict(_FIELDS[case["strategy"]])
    if case["scheme"] != UNSET:
        weights["actorder"] = case["scheme"]
    path = _recipe(tmp_path, weights, case["modifier"])
    if "error" in case or case["modifier"] in ("group", "dynamic"):
        # llm-compressor refuses a conflict here, and group/dynamic in GPTQ after calibrating: graphcal both up
        # front (group/dynamic first, whatever the scheme says)
        expected = "Invalid activation ordering" if case["modifier"] in ("group", "dynamic") else \
            "Cannot resolve activation ordering"
        with pytest.raises(UsageError, match=expected):
            resolve(Options(recipe=path))
        return
    args = resolve(Options(recipe=path)).groups["g"].weights
    got = None if args.actorder is None else enum_value(args.actorder)
    assert got == case["actorder"]


@pytest.mark.parametrize("flag,scheme,expected", [
    (None, None, "static"),  # GPTQ's default, on a block scheme
    ("weight", None, "weight"),
    ("none", None, None),
    ("none", "static", "error"),  # an explicit none against the scheme's order: llm-compressor refuses it
    ("static", "weight", "error"),
])
def test_actorder_flag_resolves_as_the_modifier_field(flag, scheme, expected):
    weights = dict(_FIELDS["block"])
    if scheme is not None:
        weights["actorder"] = scheme
    import json

    options = Options(scheme=json.dumps({"weights": weights}), algorithm="gptq", actorder=flag)
    if expected == "error":
        with pytest.raises(UsageError, match="Cannot resolve activation ordering"):
            resolve(options)
        return
    args = resolve(options).groups["group_0"].weights
    assert (None if args.actorder is None else enum_value(args.actorder)) == expected


def test_actorder_group_is_refused_as_llm_compressor_refuses_it(tmp_path):
    behaviour = VECTORS["actorder_group"]
    assert behaviour["modifier_group_warnings"] == []  # no deprecation warning: an error
    assert behaviour["modifier_group_resolves_to"] == "group"
    message = behaviour["quantize_group"].removeprefix("ValueError: ")
    for value in ("group", "dynamic"):
        with pytest.raises(UsageError, match="Invalid activation ordering " + value):
            resolve(Options(recipe=_recipe(tmp_path, _FIELDS["group"], value)))
    with pytest.raises(UsageError) as info:
        resolve(Options(recipe=_recipe(tmp_path, _FIELDS["group"], "group")))
    assert message in str(info.value)
    # in a scheme: compressed-tensors' own validation error
    assert "actorder='group' has been removed" in behaviour["args_group"]
    with pytest.raises(UsageError, match="has been removed"):
        resolve(Options(recipe=_recipe(tmp_path, dict(_FIELDS["group"], actorder="group"), UNSET)))
