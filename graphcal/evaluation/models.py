"""The models one eval compares, each read once: the fp32 reference (rotated as a ``--rotate``
model was, graphcal.evaluation.rotated), the quantized model, and the ``--fallback``.

They are read lazily (weights stay on disk: onnxruntime reads them by path) and never re-read:
a step that runs a model as a whole protobuf (onnx.reference, the comparison kept apart) gets a
copy with its weights read in (:meth:`EvalModels.whole`). Where some weight is on disk, the folder
every session reads external data from is fixed once for all of them (:attr:`EvalModels.folder`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import onnx

from graphcal.evaluation.rotated import rotated_as
from graphcal.graph import identity
from graphcal.graph.external import common_root, inline, is_external
from graphcal.graph.io import load_model_info, runs_in_onnxruntime


@dataclass(frozen=True)
class Loaded:
    """One model as read: its path, the (lazy) model, and the external data files it reads."""

    path: Path
    model: onnx.ModelProto
    files: tuple[str, ...]

    @property
    def on_disk(self) -> list[Path]:
        """The model file and its data files: what onnxruntime reads by path."""
        return [self.path.parent / f for f in (self.path.name, *self.files)]


@dataclass(frozen=True)
class EvalModels:
    reference: Loaded  # rotated as the quantized models were, where they were and it was not
    candidate: Loaded
    fallback: Loaded | None

    @cached_property
    def folder(self) -> Path | None:
        """Where every session reads external data from (None: no weight on disk, or not onnxruntime),
        fixed once, when the first session opens: it rewrites the models' references relative to it
        (graph.external.common_root), so the steps that read weights by each model's own folder
        (the rotation, the layouts, the plans) come before."""
        if not self.in_onnxruntime:
            return None
        return common_root([(m.model, m.path) for m in self.loaded])

    @property
    def loaded(self) -> list[Loaded]:
        return [m for m in (self.reference, self.candidate, self.fallback) if m is not None]

    @property
    def in_onnxruntime(self) -> bool:
        return all(runs_in_onnxruntime(m.model) for m in self.loaded)

    def whole(self, loaded: Loaded) -> onnx.ModelProto:
        """``loaded``'s model with every weight read in, to read and copy, never to edit: a copy where
        some weight is on disk (the loaded model stays lazy), else the loaded model itself."""
        if not any(map(is_external, loaded.model.graph.initializer)):
            return loaded.model
        base = self.folder if self.folder is not None else loaded.path.parent  # first: it may rebase the references
        copy = onnx.ModelProto()
        copy.CopyFrom(loaded.model)
        for t in copy.graph.initializer:
            if is_external(t):
                inline(t, base)
        return copy

    def check_unchanged(self) -> None:
        """onnxruntime read the weights by path: the numbers hold only if the files are still those the loads checked."""
        identity.check_unchanged([p for m in (self.reference, self.candidate) for p in m.on_disk])


def load_models(reference: str | Path, candidate: str | Path, fallback: str | Path | None) -> EvalModels:
    """Each model read once (lazily), the reference rotated as the quantized ones were (refused in one
    line where they were rotated differently)."""
    ref, cand = (Loaded(Path(p), *load_model_info(p, lazy=True)) for p in (reference, candidate))
    high = Loaded(Path(fallback), *load_model_info(fallback, lazy=True)) if fallback is not None else None
    rotated_as(ref.model, str(ref.path.parent), cand.model, *([high.model] if high is not None else []))
    return EvalModels(ref, cand, high)
