"""A one-layer parent's loss without running it: the MSE of a linear layer's outputs under a weight
change is ``tr(dW G dW^T)`` over the tokens' count, G the Gram matrix of its input (``sum of x xᵀ``).
AWQ scores ``up_proj -> down_proj`` this way (graphcal's fast objective), and its clip search reads
the same matrices."""

from __future__ import annotations

import torch


class Gram:
    """``sum over tokens of x x^T`` and the token count: all a linear layer's output MSE under a weight change needs."""

    def __init__(self) -> None:
        self.sum: torch.Tensor | None = None
        self.count = 0

    def update(self, x: torch.Tensor) -> None:
        flat = x.reshape(-1, x.shape[-1]).float()
        part = (flat.T @ flat).double()  # each batch's product in fp32 (a GEMM), the sum over batches in fp64
        self.sum = part if self.sum is None else self.sum + part
        self.count += flat.shape[0]


class LayerLoss:
    """graphcal's fast objective: the MSE of the balance layers' own outputs (all of them, side by
    side), ``sum_l tr((W'_l - W_l) G (W'_l - W_l)^T) / (tokens * rows)`` from the input's Gram
    matrix G: exact for those outputs, and one [rows, in] x [in, in] product per candidate instead
    of a run of the parent over every token."""

    def __init__(self, gram: Gram):
        self.gram, self.original, self._g = gram, None, None

    def prepare(self, weights: dict[str, torch.Tensor]) -> str | None:
        if self.gram.sum is None or self.gram.count == 0:
            return "saw no token"
        if not torch.isfinite(self.gram.sum).all():
            return "gives non-finite inputs"
        self.original = dict(weights)
        self._g = self.gram.sum.float()
        return None

    def score(self, trial: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss of ``trial`` as a 0-d fp64 tensor where G lies (no sync)."""
        total = torch.zeros((), dtype=torch.float64, device=self._g.device)
        rows = 0
        for name, w in self.original.items():
            rows += w.shape[0]
            t = trial.get(name, w)
            if t is w:
                continue
            d = (t.float() - w.float()).to(self._g.device)
            total += ((d @ self._g) * d).sum(dtype=torch.float64)
        return total / (self.gram.count * rows)

    def __call__(self, trial: dict[str, torch.Tensor]) -> float:
        return self.score(trial).item()
