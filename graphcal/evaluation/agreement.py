"""How close a candidate tensor is to its reference: streaming float64 sums, SQNR and cosine."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from graphcal.errors import GraphcalError


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
        ref, cand = np.asarray(ref, np.float64), np.asarray(cand, np.float64)
        if ref.shape != cand.shape:
            raise GraphcalError(f"{self.name}: shapes differ between the models ({ref.shape} vs {cand.shape})")
        err = cand - ref
        self.ref_sq += float((ref * ref).sum())
        self.cand_sq += float((cand * cand).sum())
        self.dot += float((ref * cand).sum())
        self.err_sq += float((err * err).sum())
        if err.size:
            self.max_abs_err = max(self.max_abs_err, float(np.abs(err).max()))
            self.max_abs_ref = max(self.max_abs_ref, float(np.abs(ref).max()))

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
    def cosine(self) -> float:
        denom = math.sqrt(self.ref_sq * self.cand_sq)
        return self.dot / denom if denom > 0 else 1.0

    def as_dict(self) -> dict:
        return {"name": self.name, "sqnr_db": finite(self.sqnr_db), "cosine": self.cosine,
                "max_abs_error": self.max_abs_err, "max_abs_reference": self.max_abs_ref}


def finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
