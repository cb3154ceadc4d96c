"""GPTQ's Hessian of one layer input as the activation pass feeds it (an Observed, like an observer)."""

from __future__ import annotations

import torch

from graphcal.algorithms.gptq.math import Hessian


class HessianObserver:
    """The Hessian of one tapped activation, fed ``x^T x`` per batch (or whole activations), and
    gathered across torchrun ranks like an observer's statistics."""

    takes_extrema = False
    observer_name = "GPTQ Hessian"
    sync_ops = {"hessian_sum": None, "hessian_count": None}

    def __init__(self, columns: int):
        self.columns = columns
        self.hessian = Hessian()
        self._value: torch.Tensor | None = None

    def add_gram(self, gram: torch.Tensor, sequences: int) -> None:
        self.hessian.add_gram(gram.cpu(), sequences)  # held in host memory (counted by check_one_pass)

    def add_activations(self, x: torch.Tensor) -> None:
        self.hessian.add_activations(x)
        self.hessian.sum = self.hessian.sum.cpu()

    @property
    def has_statistics(self) -> bool:
        return self.hessian.sum is not None and self.hessian.count > 0

    def value(self) -> torch.Tensor:
        """H / number of sequences (computed once; q/k/v share it)."""
        if self._value is None:
            self._value = self.hessian.value()
        return self._value

    def take(self) -> torch.Tensor:
        """:meth:`value` divided in the sum's own memory (the same numbers, one matrix instead of two),
        for a reader that never reads the sum again (sequential GPTQ's block Hessians: no exchange
        follows); ``has_statistics`` is False after."""
        if self._value is None:
            self._value = self.hessian.take()
        return self._value

    def release(self) -> None:
        """Let the Hessian go once every layer reading it is quantized."""
        self.hessian.sum, self._value = None, None

    # torchrun (graphcal.calibration.distributed.gather_statistics)
    def state_dict_stats(self) -> dict:
        if self.hessian.sum is None:
            return {}
        return {"hessian_sum": self.hessian.sum, "hessian_count": torch.tensor(self.hessian.count)}

    def reset(self) -> None:
        self.hessian, self._value = Hessian(), None

    def load_stats(self, stats: dict) -> None:
        self.hessian.sum = stats["hessian_sum"].float()
        self.hessian.count = int(stats["hessian_count"])

    def merge(self, *others: HessianObserver) -> None:
        self.hessian.merge(*(o.hessian for o in others))
        self._value = None
