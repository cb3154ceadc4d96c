"""Developer tools, run from the repository root; not part of the shipped package.

- Scripts (``python tools/NAME.py --help``): make_models (the shipped models, byte for byte), accuracy,
  bench (calibration cost against inference), weight_phase, speed_table, smoothquant_table,
  algorithms_table, observers_table, histogram_agreement, make_decoder (random-weight decoders of real shapes,
  without torch); shell: output_digests.sh, gpu_check.sh.
  ``python -m tools.awq_cost`` times AWQ (and round to nearest) against inference on a real LLM, with
  peak memory and perplexity.
- Child programs the scripts start (``python -m tools.NAME`` from the repository root): peak_rss (a
  command's own peak memory), infer_baseline (plain onnxruntime over the calibration batches),
  ort_static (onnxruntime's quantize_static), imports_only (graphcal's imports alone).
- :mod:`tools.lib`: what the scripts share (models and data, the one way to get a model's outputs,
  child processes, reporting). A script imports from there, never another script.
- :mod:`tools.builders`: the test and benchmark models as torch modules (tests import it through
  pytest's ``pythonpath = ["."]`` in pyproject.toml).

Each script puts the repository root on ``sys.path`` itself (weight_phase.py after PYTHONPATH, so that
it can time an older checkout).
"""
