"""What the tools/ scripts share; a script imports from here (and :mod:`tools.builders`), never another script.

- :mod:`tools.lib.report`: progress lines on stderr, the printed/written result, the CPU's name, cell formatting;
- :mod:`tools.lib.synthetic`: seeded token data, deterministic ``.npz`` files, the benchmark decoders' export;
- :mod:`tools.lib.decoder`: Llama-style decoders of any shape in numpy and onnx, written tensor by tensor (make_decoder);
- :mod:`tools.lib.text`: English text found on this machine (standard library docstrings, licence texts);
- :mod:`tools.lib.models`: the models the tables measure, with their calibration and held-out data;
- :mod:`tools.lib.outputs`: THE way to get a model's first output over data, and its metrics against fp32;
- :mod:`tools.lib.children`: child processes with their own peak memory (through ``python -m tools.peak_rss``);
- :mod:`tools.lib.perplexity`: held-out perplexity of a causal LM in ONNX (tools/real_llm.py's SmolLM2);
- :mod:`tools.lib.speed_page`: tools/speed_table.py's forms and its markdown page.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository root
