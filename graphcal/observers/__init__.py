"""Observers reproducing llm-compressor's calibration statistics (no ONNX knowledge).

Registered names (``_`` and ``-`` are interchangeable): memoryless_minmax, static_minmax,
minmax, memoryless_mse, mse, nvfp4_expanded_mse (alias fouroversix, warns), imatrix_mse,
nvfp4_expanded_imatrix; and graphcal's own histogram observers for per-tensor activations:
percentile, entropy, histogram_mse.

Observers of one fused group (q/k/v, gate/up, ...) share one global scale through
:func:`share_global_scale`; which modules form a group is the graph side's business
(:func:`graphcal.graph.fusion.find_fused_groups`).
"""


from graphcal.observers.base import (
    SYNC_OPS,
    MissingStatisticsError,
    Observer,
    share_global_scale,
)
from graphcal.observers.helpers import flatten_for_calibration
from graphcal.observers.histogram import EntropyObserver, HistogramMSEObserver, PercentileObserver
from graphcal.observers.imatrix import (
    IMatrixFallbackWarning,
    IMatrixMSEObserver,
    NVFP4ExpandedIMatrixObserver,
    imatrix_grid_search,
)
from graphcal.observers.min_max import (
    MemorylessMinMaxObserver,
    MinMaxObserver,
    StaticMinMaxObserver,
)
from graphcal.observers.mse import (
    MemorylessMSEObserver,
    MovingAverageMSEObserver,
    NVFP4ExpandedMSEObserver,
    grid_search_mse,
)
from graphcal.observers.registry import make_observer

__all__ = [
    "Observer",
    "make_observer",
    "MissingStatisticsError",
    "SYNC_OPS",
    "share_global_scale",
    "flatten_for_calibration",
    "grid_search_mse",
    "imatrix_grid_search",
    "IMatrixFallbackWarning",
    "MemorylessMinMaxObserver",
    "StaticMinMaxObserver",
    "MinMaxObserver",
    "MemorylessMSEObserver",
    "MovingAverageMSEObserver",
    "NVFP4ExpandedMSEObserver",
    "IMatrixMSEObserver",
    "NVFP4ExpandedIMatrixObserver",
    "PercentileObserver",
    "EntropyObserver",
    "HistogramMSEObserver",
]
