"""Synthetic inputs and models: seeded token data, ``.npz`` files written byte for byte, the benchmark decoders.

tools/make_models.py writes the shipped models with these; tools/bench.py and the tables make their
data and the (not shipped) benchmark decoders with them.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np

OPSET = 17
BENCH_SEQ = 512
LARGE_SEQ = 256
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


def save_npz(path: str | Path, arrays: dict[str, np.ndarray]) -> Path:
    """Write ``arrays`` like ``numpy.savez`` (loadable with ``numpy.load``), deterministically.

    Entries are sorted by key, stored uncompressed with a fixed timestamp and permissions.
    """
    path = Path(path)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for key in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arrays[key]), allow_pickle=False)
            info = zipfile.ZipInfo(key + ".npy", date_time=_ZIP_DATE)
            info.compress_type = zipfile.ZIP_STORED
            info.external_attr = 0o644 << 16
            info.create_system = 3  # unix, whatever the host
            zf.writestr(info, buf.getvalue())
    return path


def make_data(input_names: list[str], vocab_size: int, n: int, seq: int, seed: int) -> dict:
    """Synthetic token data: random ids, all-ones attention mask, zero token type ids."""
    rng = np.random.Generator(np.random.PCG64(seed))
    ids = rng.integers(0, vocab_size, size=(n, seq), dtype=np.int64)
    data = {}
    for name in input_names:
        if name == "input_ids":
            data[name] = ids
        elif name == "attention_mask":
            data[name] = np.ones((n, seq), dtype=np.int64)
        elif name == "token_type_ids":
            data[name] = np.zeros((n, seq), dtype=np.int64)
        else:
            raise ValueError(f"no synthetic data rule for input {name!r}")
    return data


def make_bench_decoder(out_dir: str | Path) -> Path:
    """The benchmark decoder (tools.builders.build_bench_decoder), not shipped: ``out_dir/model.onnx``.

    Its data comes from :func:`make_data` with ``BENCH_SEQ`` tokens (tools/bench.py makes it).
    """
    from tools.builders import build_bench_decoder  # lazy: torch and transformers, only to make the model

    return _export_decoder(build_bench_decoder, BENCH_SEQ, out_dir)


def make_large_decoder(out_dir: str | Path) -> Path:
    """The 1.5B-parameter decoder (tools.builders.build_large_decoder), not shipped:
    ``out_dir/model.onnx`` with its weights in ``model.onnx.data`` beside it.

    Its data comes from :func:`make_data` with ``LARGE_SEQ`` tokens (tools/bench.py makes it).
    Building it takes a few minutes and about 12 GB of host memory (torch's model and the exporter's copy).
    """
    from tools.builders import build_large_decoder  # lazy: torch and transformers, only to make the model

    return _export_decoder(build_large_decoder, LARGE_SEQ, out_dir)


def _export_decoder(build, seq: int, out_dir: str | Path) -> Path:
    """``build(seed=0, seq=seq)`` exported to ``out_dir/model.onnx`` (external data past 2 GB)."""
    from graphcal.export import export_torch  # lazy: torch, only to make the model

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, inputs, output_names, dynamic_axes = build(seed=0, seq=seq)
    return export_torch(model, inputs, out_dir / "model.onnx", output_names=output_names,
                        dynamic_axes=dynamic_axes, dynamo=False, constant_folding=True, opset=OPSET)
