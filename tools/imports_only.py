"""Child program: only the imports a calibration child holds before it calibrates, for its peak RSS.

    python -m tools.imports_only

tools/algorithms_table.py reports each calibration's peak above this one's.
"""

import onnxruntime  # noqa: F401

import graphcal.calibration.pipeline  # noqa: F401
import graphcal.calibration.transforms.awq  # noqa: F401
import graphcal.calibration.transforms.gptq  # noqa: F401
import graphcal.cli  # noqa: F401
