"""Registry names, kwargs defaults/validation and the observe/get_qparams lifecycle rules."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs

from graphcal.observers import (
    IMatrixMSEObserver,
    MemorylessMinMaxObserver,
    MemorylessMSEObserver,
    MinMaxObserver,
    MissingStatisticsError,
    MovingAverageMSEObserver,
    NVFP4ExpandedIMatrixObserver,
    NVFP4ExpandedMSEObserver,
    Observer,
    StaticMinMaxObserver,
)

NAMES = {
    "memoryless_minmax": MemorylessMinMaxObserver,
    "static_minmax": StaticMinMaxObserver,
    "minmax": MinMaxObserver,
    "memoryless_mse": MemorylessMSEObserver,
    "mse": MovingAverageMSEObserver,
    "imatrix_mse": IMatrixMSEObserver,
    "nvfp4_expanded_mse": NVFP4ExpandedMSEObserver,
    "nvfp4_expanded_imatrix": NVFP4ExpandedIMatrixObserver,
}


def load(name, base_name="weight", args=None, **kw):
    return Observer.load_from_registry(
        name, base_name=base_name, args=args or QuantizationArgs(), **kw
    )


@pytest.mark.parametrize("name,cls", sorted(NAMES.items()))
def test_names_normalised(name, cls):
    assert type(load(name)) is cls
    assert type(load(name.replace("_", "-"))) is cls
    assert type(load(name.upper())) is cls


def test_fouroversix_alias_warns():
    with pytest.warns(UserWarning, match="nvfp4_expanded_mse"):
        obs = load("fouroversix")
    assert type(obs) is NVFP4ExpandedMSEObserver
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load("nvfp4-expanded-mse")  # the canonical name does not warn


def test_unknown_observer_name():
    with pytest.raises(KeyError):
        load("not_an_observer")


def test_defaults():
    assert load("minmax").kwargs["averaging_constant"] == 0.01
    mse = load("memoryless_mse").kwargs
    assert (mse["maxshrink"], mse["patience"], mse["grid"], mse["norm"], mse["expand"]) == (
        0.2, 5, 100.0, 2.4, 1.0,
    )
    imx = load("imatrix_mse").kwargs
    assert (imx["maxshrink"], imx["patience"], imx["grid"], imx["norm"], imx["strict"], imx["expand"]) == (
        0.95, 5, 20, 3.0, False, 1.0,
    )
    for name in ("nvfp4_expanded_mse", "nvfp4_expanded_imatrix"):
        kw = load(name).kwargs
        assert kw["expand"] == 1.8 and kw["grid"] == 200 and kw["patience"] == 1000
        assert kw["maxshrink"] == pytest.approx(1 - 0.8 / 1.8)
        assert kw["norm"] == 2.4
        # 111 steps, from 1.8x down to 1.8 * (1 - 110/200) = 0.81x of the observed range
        assert int(kw["maxshrink"] * kw["grid"]) == 111
    assert load("nvfp4_expanded_mse", grid=50).kwargs["grid"] == 50  # overridable


def test_unknown_kwarg_names_kwarg_and_accepted():
    with pytest.raises(ValueError, match=r"'maxshrinkk'.*accepted kwargs: .*maxshrink"):
        load("memoryless_mse", maxshrinkk=0.1)
    with pytest.raises(ValueError, match=r"'grid'.*averaging_constant"):
        load("static_minmax", grid=10)
    with pytest.raises(ValueError, match="'averaging_constant'"):
        load("imatrix_mse", averaging_constant=0.1)


@pytest.mark.parametrize(
    "name,kw",
    [
        ("memoryless_mse", {"expand": 0.9}),
        ("memoryless_mse", {"maxshrink": 1.5}),
        ("memoryless_mse", {"maxshrink": -0.1}),
        ("memoryless_mse", {"grid": 0}),
        ("memoryless_mse", {"patience": -1}),
        ("memoryless_mse", {"patience": 2.5}),
        ("mse", {"norm": 0}),
        ("minmax", {"averaging_constant": 1.5}),
        ("minmax", {"averaging_constant": "0.1"}),
        ("imatrix_mse", {"norm": 0}),
        ("imatrix_mse", {"norm": -1}),
        ("imatrix_mse", {"norm": math.inf}),
        ("imatrix_mse", {"norm": math.nan}),
        ("imatrix_mse", {"grid": -3}),
        ("imatrix_mse", {"patience": -1}),
        ("imatrix_mse", {"maxshrink": 1.01}),
        ("imatrix_mse", {"strict": "yes"}),
    ],
)
def test_bad_kwargs_raise(name, kw):
    with pytest.raises(ValueError):
        load(name, **kw)


def test_kwargs_from_args_and_call_merge_without_mutating_args():
    args = QuantizationArgs(observer_kwargs={"grid": 50, "maxshrink": 0.1})
    obs = Observer.load_from_registry("memoryless_mse", base_name="weight", args=args, maxshrink=0.3)
    assert obs.kwargs["grid"] == 50 and obs.kwargs["maxshrink"] == 0.3
    assert obs.kwargs["patience"] == 5
    assert args.observer_kwargs == {"grid": 50, "maxshrink": 0.1}
    other = Observer.load_from_registry("memoryless_mse", base_name="weight", args=args)
    assert other.kwargs["maxshrink"] == 0.1
    with pytest.raises(ValueError, match="'grid'"):
        Observer.load_from_registry("memoryless_mse", base_name="weight", args=args, grid=-1)
    bad = QuantizationArgs(observer_kwargs={"typo": 1})
    with pytest.raises(ValueError, match="'typo'"):
        Observer.load_from_registry("minmax", base_name="input", args=bad)


def test_bad_base_name():
    with pytest.raises(ValueError, match="base_name"):
        load("minmax", base_name="bias")


@pytest.mark.parametrize("name", sorted(NAMES))
def test_no_statistics_error(name):
    obs = load(name, args=QuantizationArgs(strategy="channel"))
    assert not obs.has_statistics
    with pytest.raises(MissingStatisticsError, match="No statistics available"):
        obs.get_qparams()
    assert isinstance(MissingStatisticsError("x"), AssertionError)


@pytest.mark.parametrize("name", sorted(NAMES))
def test_empty_tensor_is_noop_and_stats_deleted(name):
    obs = load(name, base_name="weight", args=QuantizationArgs(strategy="channel"))
    obs(torch.empty(0, 4))
    assert not obs.has_statistics
    obs(torch.randn(3, 4))
    assert obs.has_statistics
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # imatrix without importance falls back (tested elsewhere)
        qp = obs.get_qparams()
    assert set(qp) == {"scale", "zero_point", "global_scale"}
    assert qp["global_scale"] is None and tuple(qp["scale"].shape) == (3, 1)
    assert not obs.has_statistics


@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax", "minmax", "mse"])
def test_weight_observed_once(name):
    obs = load(name, base_name="weight")
    obs(torch.tensor([[1.0, -2.0]]))
    obs(torch.tensor([[10.0, -20.0]]))
    assert obs.min_vals.item() == -2.0 and obs.max_vals.item() == 1.0
    obs.get_qparams()
    obs(torch.tensor([[10.0, -20.0]]))  # after qparams were taken, a new weight is observed
    assert obs.min_vals.item() == -20.0


def test_integer_tensor_rejected():
    with pytest.raises(TypeError):
        load("minmax", base_name="input")(torch.ones(1, 2, 3, dtype=torch.int64))


def test_needs_activations_only_for_imatrix_weights():
    for name in NAMES:
        expected = "imatrix" in name
        assert load(name, base_name="weight").needs_activations is expected
        assert load(name, base_name="input").needs_activations is False
    with pytest.raises(TypeError):
        load("minmax").accumulate_importance(torch.ones(2, 2))
