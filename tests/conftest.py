"""Shared fixtures: shipped models, exported variants, and a GPU skip."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def llama_dir() -> Path:
    return MODELS / "tiny-llama"


@pytest.fixture(scope="session")
def bert_dir() -> Path:
    return MODELS / "tiny-bert"


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """Export forms made at test time: ``exported("dynamo")`` / ``exported("nofold")`` -> model path."""
    cache: dict[str, Path] = {}

    def make(form: str) -> Path:
        if form not in cache:
            from graphcal.export import export_torch
            from tools.builders import build_tiny_llama

            model, inputs, output_names, dynamic_axes = build_tiny_llama()
            path = tmp_path_factory.mktemp(form) / "model.onnx"
            if form == "dynamo":
                export_torch(model, inputs, path, output_names=output_names, dynamo=True, opset=18)
            elif form == "nofold":
                export_torch(model, inputs, path, output_names=output_names, dynamic_axes=dynamic_axes,
                             constant_folding=False)
            else:
                raise ValueError(form)
            cache[form] = path
        return cache[form]

    return make
