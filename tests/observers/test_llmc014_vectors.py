"""The observers llm-compressor 0.13-0.14 added, against llm-compressor 0.14.0.1's own numbers.

``llmc014_vectors.py`` was made by ``tools/make_observer_vectors_014.py`` with llm-compressor 0.14.0.1
(compressed-tensors 0.19.0, torch 2.13, CPU, one thread). Every case gives graphcal's observer the same
tensors and kwargs and asks for the same qparams, bit for bit:

* ``memoryless_mse``, ``mse`` and ``imatrix_mse`` with ``expand`` 1.0 and 1.5 on the tensor, channel,
  group, block and tensor_group (NVFP4, fp8 scales) strategies, fp32 and bf16 weights;
* ``nvfp4_expanded_mse`` (and its warning alias ``fouroversix``) and ``nvfp4_expanded_imatrix``
  with their defaults and with ``expand`` 1.5;
* ``imatrix_mse`` fed its activations in several batches, one batch, or none (the uniform fallback);
* ``mse`` / ``memoryless_mse`` on activations over several batches;
* ``imatrix_mse`` split over two data-parallel ranks (gloo), reduced with graphcal's ``merge``;
* what an ``expand`` below 1 does (a ValueError for the MSE observers; imatrix searches from it).

The end-to-end tests through a recipe and through flags are in tests/observers/test_expand_run.py.
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs

from graphcal.observers import Observer
from tests.observers.llmc014_vectors import VECTORS


def decode(entry):
    """A tensor from the vectors' exact form (see the tool)."""
    if entry is None:
        return None
    dtype = getattr(torch, entry["dtype"])
    if "bits" in entry:
        return torch.tensor(entry["bits"], dtype=torch.int32).view(torch.float32).reshape(entry["shape"]).to(dtype)
    return torch.tensor(entry["ints"], dtype=dtype).reshape(entry["shape"])


TENSORS = {name: decode(t) for name, t in VECTORS["tensors"].items()}
BATCHES = [decode(b) for b in VECTORS["batches"]]
ACT_BATCHES = [decode(b) for b in VECTORS["act_batches"]]
CASES = {c["name"]: c for c in VECTORS["observers"]}
RESULTS = [n for n, c in CASES.items() if "error" not in c]
ERRORS = [n for n, c in CASES.items() if "error" in c]


def _args(case) -> QuantizationArgs:
    return QuantizationArgs(**case["args"], observer=case["observer"], observer_kwargs=case["observer_kwargs"])


def _load(case):
    if case["observer"] == "fouroversix":
        with pytest.warns(UserWarning, match="nvfp4_expanded_mse"):
            return Observer.load_from_registry("fouroversix", base_name=case["base_name"], args=_args(case))
    return Observer.load_from_registry(case["observer"], base_name=case["base_name"], args=_args(case))


def assert_qparams(got: dict, expected: dict) -> None:
    for key in ("scale", "zero_point", "global_scale"):
        want = decode(expected[key])
        if want is None:
            assert got[key] is None, key
            continue
        assert got[key] is not None, key
        assert got[key].dtype == want.dtype, (key, got[key].dtype, want.dtype)
        assert got[key].shape == want.shape, (key, got[key].shape, want.shape)
        assert torch.equal(got[key], want), (key, got[key], want)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the vectors were made with one torch thread


def test_vectors_are_llm_compressor_014():
    assert VECTORS["meta"]["llmcompressor"] == "0.14.0.1"
    assert len(RESULTS) > 90 and len(VECTORS["ddp"]) == 3


@pytest.mark.parametrize("name", RESULTS)
def test_observer_gives_llm_compressors_qparams(name):
    case = CASES[name]
    obs = _load(case)
    if case["base_name"] == "input":
        for batch in ACT_BATCHES:
            obs(batch)
    else:
        w = TENSORS[case["input"]]
        for i in case["batches"] or ():
            obs.accumulate_importance(BATCHES[i].to(w.dtype))
        with pytest.warns() if case["batches"] == [] else _no_check():
            obs(w)
            qparams = obs.get_qparams()
        assert_qparams(qparams, case["expected"])
        return
    assert_qparams(obs.get_qparams(), case["expected"])


class _no_check:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("name", ERRORS)
def test_expand_below_one_is_refused_where_llm_compressor_refuses_it(name):
    case = CASES[name]
    assert "expand value must be at least 1.0" in case["error"]
    with pytest.raises(ValueError, match="expand"):
        _load(case)


def test_the_expanded_search_really_leaves_the_observed_range():
    """The vectors exercise expand: some NVFP4 group ends above its observed range (scale * 6 > absmax)."""
    case = CASES["nvfp4_expanded_mse_nvfp4_w"]
    w = TENSORS["w"]
    q = {k: decode(v) for k, v in case["expected"].items()}
    local = q["scale"].float() / q["global_scale"]
    absmax = w.reshape(w.shape[0], -1, 16).abs().amax(-1)
    assert bool((local * 6 > absmax * 1.05).any())


@pytest.mark.parametrize("case", VECTORS["ddp"], ids=lambda c: c["name"])
def test_imatrix_over_two_ranks(case):
    """Each rank's importance sums and counts are summed before the weight is observed (llm-compressor's
    sync_activation_stats on two gloo ranks): graphcal's merge of the two ranks' observers gives its qparams."""
    ranks = []
    for batches in case["rank_batches"]:
        obs = _load(case)
        for i in batches:
            obs.accumulate_importance(BATCHES[i])
        ranks.append(obs)
    merged = ranks[0].merge(ranks[1])
    merged(TENSORS[case["input"]])
    assert_qparams(merged.get_qparams(), case["expected"])


@pytest.mark.parametrize("name", ["imatrix_mse", "nvfp4_expanded_imatrix"])
@pytest.mark.parametrize("expand", [0, -1.5, float("nan")])
def test_imatrix_expand_must_be_positive(name, expand):
    """llm-compressor's imatrix observers search from any expand (0.9 included, see the vectors); graphcal
    refuses the meaningless ones (a range of zero or turned inside out)."""
    with pytest.raises(ValueError, match="expand"):
        Observer.load_from_registry(name, base_name="weight", args=QuantizationArgs(num_bits=4, strategy="channel"),
                                    expand=expand)
