"""Regression tests on exported graphs: compare calibrated qparams with a stored golden file.

    from graphcal.testing import assert_matches_golden

    def test_my_export_calibrates_as_before(tmp_path):
        result = graphcal.calibrate("model.onnx", "calib.npz", tmp_path, scheme="W8A8_STATIC")
        assert_matches_golden(result, "tests/golden/model_w8a8_static.safetensors")

The golden file is a safetensors file of the same tensors graphcal writes to qparams.safetensors.
Create or refresh it with ``GRAPHCAL_UPDATE_GOLDEN=1 pytest ...`` (or ``update=True``); a missing
golden file is an error, never created silently.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

UPDATE_ENV = "GRAPHCAL_UPDATE_GOLDEN"


def qparams_of(actual) -> dict[str, torch.Tensor]:
    """The qparams of a CalibrationResult, an output folder, a qparams.safetensors file or a mapping."""
    from safetensors.torch import load_file  # lazy: loads safetensors' torch half only when a file is read or written

    if isinstance(actual, Mapping):
        return dict(actual)
    if hasattr(actual, "qparams") and hasattr(actual, "output_dir"):
        return dict(actual.qparams)
    path = Path(actual)
    return load_file(str(path / "qparams.safetensors" if path.is_dir() else path))


def save_golden(actual, golden: str | os.PathLike) -> Path:
    """Write ``actual``'s qparams to ``golden`` (safetensors)."""
    from safetensors.torch import save_file  # lazy: loads safetensors' torch half only when a file is read or written

    golden = Path(golden)
    golden.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in sorted(qparams_of(actual).items())}
    save_file(tensors, str(golden), metadata={"format": "pt"})
    return golden


def assert_matches_golden(actual, golden: str | os.PathLike, *, rtol: float = 1e-5, atol: float = 0.0,
                          update: bool | None = None) -> None:
    """Assert that ``actual``'s qparams equal the golden file's, key for key, within tolerances.

    Keys must match exactly; dtypes and shapes too; values as ``torch.testing.assert_close``
    judges them (``|a - g| <= atol + rtol * |g|``, NaN where the golden file has NaN).
    The message lists every difference (missing and extra keys, worst relative errors).
    With ``update`` (default: the GRAPHCAL_UPDATE_GOLDEN environment variable) the golden
    file is rewritten instead.
    """
    golden = Path(golden)
    if update is None:
        update = os.environ.get(UPDATE_ENV, "") not in ("", "0")
    if update:
        save_golden(actual, golden)
        return
    if not golden.exists():
        raise AssertionError(f"golden file {golden} does not exist; create it with {UPDATE_ENV}=1")
    got, want = qparams_of(actual), qparams_of(golden)
    problems = []
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing:
        problems.append(f"missing: {', '.join(missing)}")
    if extra:
        problems.append(f"not in the golden file: {', '.join(extra)}")
    worst = []
    for key in sorted(set(want) & set(got)):
        a, g = got[key], want[key]
        if a.dtype != g.dtype or a.shape != g.shape:
            problems.append(f"{key}: {a.dtype} {tuple(a.shape)} != golden {g.dtype} {tuple(g.shape)}")
            continue
        try:  # torch's own comparison decides: |a - g| <= atol + rtol * |g|, NaN only where the golden has NaN
            torch.testing.assert_close(a, g, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError:
            a64, g64 = a.to(torch.float64), g.to(torch.float64)
            rel = ((a64 - g64).abs() / g64.abs().clamp_min(1e-30)).nan_to_num(nan=float("inf")).max().item()
            worst.append((rel, f"{key}: max relative difference {rel:.3g}"))
    problems += [text for _, text in sorted(worst, reverse=True)]
    if problems:
        raise AssertionError(f"qparams differ from {golden} (rtol={rtol}, atol={atol}):\n  " + "\n  ".join(problems))
