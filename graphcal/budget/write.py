"""The mix written into ``-o``: the low form's folder with the chosen layers spliced in from the high form's.

Both forms were written by `run` into the temporary folder (graphcal.budget); the mix is made of what
they hold, nothing is calibrated again: the graph by graph.splice (the low form's nodes for the chosen
layers replaced by the high form's, as eval's switches measured them), each weight copied a chunk at a
time from the form's data file it sits in (graph.io.save_model), the quantization_config.json of the
run's config with the mix's ``--scheme-for`` groups, qparams.safetensors with each layer's scales from
its form, and the low folder's companions (genai_config.json, the tokenizer: copied there by `run`,
after its checks) as they are.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from graphcal.calibration.result import CalibrationResult
from graphcal.calibration.sizing import float_weight_bytes
from graphcal.graph.external import common_root
from graphcal.graph.io import load_model_info, save_model, unchecked_ops
from graphcal.graph.splice import splice
from graphcal.output import MANIFEST, MODEL_FILE
from graphcal.output.metadata import CONFIG_FILE, QPARAMS_FILE, build_quantization_config, config_json, qparam_tensors
from graphcal.runtime import check_loads
from graphcal.types import QuantizedTarget


def write_mix(work: Path, reference: Path, low: CalibrationResult, high: CalibrationResult, config,
              layers: dict[str, str], slot) -> CalibrationResult:
    """Write into ``slot`` (the reserved ``-o``) the low form (``work/low``, ``low``'s result) with ``layers``
    (layer -> the fp32 node computing it) in the high form (``work/high``); ``config``: the run's RunConfig
    with the mix's groups (graphcal.config.resolve of the low form's options and the mix's flags).
    Returns the low run's result for the written folder."""
    low_path, high_path = work / "low" / MODEL_FILE, work / "high" / MODEL_FILE
    low_model, low_files = load_model_info(low_path, lazy=True)
    high_model, _ = load_model_info(high_path, lazy=True)
    ref_model, _ = load_model_info(reference, lazy=True)  # its graph only: which values fp32 computes
    root = common_root([(low_model, low_path), (high_model, high_path)])  # every reference relative to work/
    model = splice(low_model, high_model, ref_model, layers)
    del ref_model
    taken = {i.target.name: i for i in high.targets}
    items = []
    for item in low.targets:
        source = taken[item.target.name] if item.target.name in layers else item
        items.append(QuantizedTarget(source.target, config.scheme_for(source.target), source.qparams))
    transform = json.loads((work / "low" / CONFIG_FILE).read_text()).get("transform_config") or None
    qc = build_quantization_config(config, items, low.ignored, (), transform)[1]
    tensors = qparam_tensors(items)
    unchecked = unchecked_ops(low_model)
    own = {MANIFEST, CONFIG_FILE, QPARAMS_FILE, MODEL_FILE, *low_files}
    companions = sorted(p for p in (work / "low").iterdir() if p.name not in own and p.is_file())

    def write(tmp: Path) -> list[Path]:
        from safetensors.torch import save_file  # lazy: safetensors' torch half loads only when writing

        files = save_model(model, tmp / MODEL_FILE, external=bool(low_files), base_dir=root, unchecked=unchecked)
        check_loads(tmp / MODEL_FILE)
        for p in companions:
            shutil.copyfile(p, tmp / p.name)
            files.append(tmp / p.name)
        (tmp / CONFIG_FILE).write_text(config_json(qc))
        save_file(tensors, str(tmp / QPARAMS_FILE), metadata={"format": "pt"})
        return files + [tmp / CONFIG_FILE, tmp / QPARAMS_FILE]

    files = slot.write(write)
    return dataclasses.replace(low, output_dir=slot.path, files=files, targets=items, forms=[],
                               float_bytes=float_weight_bytes(model),
                               model_bytes=sum(f.stat().st_size for f in files if f.name.startswith(MODEL_FILE)))
