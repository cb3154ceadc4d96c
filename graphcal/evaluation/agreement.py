"""How close a candidate tensor is to its reference: streaming float64 sums, SQNR and cosine."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np

from graphcal.errors import GraphcalError

CHUNK = 1 << 20  # elements compared at a time (8 MB of float64 each)


@dataclass
class Agreement:
    """Streaming agreement between a reference tensor and a candidate one."""

    name: str
    ref_sq: float = 0.0
    cand_sq: float = 0.0
    dot: float = 0.0
    err_sq: float = 0.0
    max_abs_err: float = 0.0
    max_abs_ref: float = 0.0

    def add(self, ref: np.ndarray, cand: np.ndarray) -> None:
        """Fold in one batch's tensors, in float64 a slice at a time (a large vocabulary's logits
        in float64 whole would be several times the batch's own memory)."""
        if is_torch(ref) or is_torch(cand):
            self._add_torch(ref, cand)
            return
        ref, cand = np.asarray(ref), np.asarray(cand)
        if ref.shape != cand.shape:
            raise GraphcalError(f"{self.name}: shapes differ between the models ({ref.shape} vs {cand.shape})")
        ref, cand = ref.reshape(-1), cand.reshape(-1)
        for start in range(0, ref.size, CHUNK):
            r, c = ref[start:start + CHUNK].astype(np.float64), cand[start:start + CHUNK].astype(np.float64)
            err = c - r
            self.ref_sq += float(np.dot(r, r))
            self.cand_sq += float(np.dot(c, c))
            self.dot += float(np.dot(r, c))
            self.err_sq += float(np.dot(err, err))
            self.max_abs_err = max(self.max_abs_err, float(np.abs(err).max()))
            self.max_abs_ref = max(self.max_abs_ref, float(np.abs(r).max()))

    def _add_torch(self, ref, cand) -> None:
        """:meth:`add` for torch tensors (a GPU session's outputs, handed over by DLPack): the same sums
        in float64 where the tensors lie, a slice at a time, accumulated there; six numbers come back."""
        import torch  # lazy: only where a runner hands over torch tensors (it imported torch)

        ref = ref if is_torch(ref) else torch.as_tensor(np.asarray(ref))
        cand = (cand if is_torch(cand) else torch.as_tensor(np.asarray(cand))).to(ref.device)
        if tuple(ref.shape) != tuple(cand.shape):
            raise GraphcalError(f"{self.name}: shapes differ between the models ({tuple(ref.shape)} vs {tuple(cand.shape)})")
        ref, cand = ref.reshape(-1), cand.reshape(-1)
        if ref.numel() == 0:
            return
        sums = torch.zeros(4, dtype=torch.float64, device=ref.device)  # ref², cand², ref·cand, err²
        peaks = torch.zeros(2, dtype=torch.float64, device=ref.device)  # max |err|, max |ref|
        for start in range(0, ref.numel(), CHUNK):
            r, c = ref[start:start + CHUNK].to(torch.float64), cand[start:start + CHUNK].to(torch.float64)
            err = c - r
            sums += torch.stack([torch.dot(r, r), torch.dot(c, c), torch.dot(r, c), torch.dot(err, err)])
            peaks = torch.maximum(peaks, torch.stack([err.abs().max(), r.abs().max()]))
        ref_sq, cand_sq, dot, err_sq = sums.tolist()
        max_abs_err, max_abs_ref = peaks.tolist()
        self.add_sums(ref_sq, cand_sq, dot, err_sq, max_abs_err, max_abs_ref)

    def add_sums(self, ref_sq: float, cand_sq: float, dot: float, err_sq: float, max_abs_err: float,
                 max_abs_ref: float) -> None:
        """Fold in one batch's sums as graph.compare reduces them in the graph (float64)."""
        self.ref_sq += ref_sq
        self.cand_sq += cand_sq
        self.dot += dot
        self.err_sq += err_sq
        self.max_abs_err = max(self.max_abs_err, max_abs_err)
        self.max_abs_ref = max(self.max_abs_ref, max_abs_ref)

    @property
    def sqnr_db(self) -> float:
        if self.err_sq == 0:
            return math.inf
        return 10 * math.log10(self.ref_sq / self.err_sq) if self.ref_sq > 0 else -math.inf

    @property
    def noise(self) -> float:
        """Error power relative to the reference's (10^(-SQNR/10))."""
        return self.err_sq / self.ref_sq if self.ref_sq > 0 else math.inf

    @property
    def cosine(self) -> float:
        denom = math.sqrt(self.ref_sq * self.cand_sq)
        return self.dot / denom if denom > 0 else 1.0

    def as_dict(self) -> dict:
        return {"name": self.name, "sqnr_db": finite(self.sqnr_db), "cosine": self.cosine,
                "max_abs_error": self.max_abs_err, "max_abs_reference": self.max_abs_ref}


def is_torch(value) -> bool:
    """A torch tensor (torch is loaded wherever one exists: this module never imports it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
