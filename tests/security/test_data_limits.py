"""Calibration data from strangers: no hang, no memory blow-up, no quadratic reading.

Only regular files are opened; .npy headers are checked against the zip's sizes and the batch
against the available memory before anything is read; batches are streamed (each array opened
and decompressed once per pass, only the rows the run uses); damaged members end in one line.
"""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphcal.data.npz as gnpz  # check_memory reads _available_memory here
from graphcal.data import InputSpec, graph_inputs, load_data
from graphcal.errors import GraphcalError
from tests.helpers import run_cli, time_box

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")

SPECS = [
    InputSpec("input_ids", np.dtype(np.int64), ("batch", "seq")),
    InputSpec("attention_mask", np.dtype(np.int64), ("batch", "seq")),
]


# -- helpers -----------------------------------------------------------------------------------


def _invoke(model, data, out, *extra):
    result = run_cli("run", str(model), "--data", str(data), "-o", str(out), "-q", *extra)
    return result.exit_code, result.output


def _assert_one_line_error(code, text, *fragments):
    assert code in (1, 2), text
    assert "Traceback" not in text, text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text
    for fragment in fragments:
        assert fragment in errors[0], text


def _limit_memory(nbytes: int):
    def apply():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))

    return apply


def _graphcal(*args, timeout=120, max_memory=4 << 30):
    """graphcal in a child process, so that a regression that hangs or reads without end fails
    here (timeout, address-space limit) instead of hanging the suite or the machine; returns
    (exit code, stderr, the child's own peak RSS in bytes)."""
    code = ("import resource, sys\nfrom graphcal.cli import main\nsys.argv = ['graphcal'] + sys.argv[1:]\n"
            "try:\n    main()\nfinally:\n"
            "    sys.stderr.write(f'\\nMAXRSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}\\n')\n")
    p = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, stdin=subprocess.DEVNULL, preexec_fn=_limit_memory(max_memory))
    lines = p.stderr.splitlines()
    rss = next((int(line.split()[1]) for line in reversed(lines) if line.startswith("MAXRSS ")), 0)
    rss *= 1 if sys.platform == "darwin" else 1024  # Linux reports KiB
    text = "\n".join(line for line in lines if not line.startswith("MAXRSS ")).strip()
    return p.returncode, text, rss


def _npy(array: np.ndarray, version=None) -> bytes:
    f = io.BytesIO()
    np.lib.format.write_array(f, array, version=version, allow_pickle=False)
    return f.getvalue()


def _npy_header(shape, dtype, fortran=False) -> bytes:
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        f, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": fortran, "shape": shape})
    return f.getvalue()


def _zip(path, members: dict[str, bytes], method=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", method) as zf:
        for name, payload in members.items():
            zf.writestr(name, payload)
    return path


def _raw_zip(path, members):
    """A zip written by hand (no zip64): members are (name, method, payload, crc, file_size), so
    the declared sizes can be anything the test wants."""
    out, central = bytearray(), bytearray()
    for name, method, payload, crc, size in members:
        encoded = name.encode()
        offset = len(out)
        out += struct.pack("<4s2B4HL2L2H", b"PK\x03\x04", 20, 0, 0, method, 0, 0x21, crc, len(payload), size,
                           len(encoded), 0) + encoded + payload
        central += struct.pack("<4s4B4HL2L5H2L", b"PK\x01\x02", 20, 3, 20, 0, 0, method, 0, 0x21, crc, len(payload),
                               size, len(encoded), 0, 0, 0, 0, 0o600 << 16, offset) + encoded
    out += central + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members), len(members), len(central),
                                 len(out), 0)
    Path(path).write_bytes(bytes(out))
    return path


def _zeros_member(name, shape, dtype, block=1 << 24):
    """A deflated .npy of zeros declaring ``shape``, built without compressing all of it: after a
    full flush, deflate writes every block of zeros the same way, so one block is repeated."""
    header = _npy_header(shape, dtype)
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    assert nbytes % block == 0
    c = zlib.compressobj(6, zlib.DEFLATED, -15)
    zero = bytes(block)
    head = c.compress(header) + c.flush(zlib.Z_FULL_FLUSH)
    chunk = c.compress(zero) + c.flush(zlib.Z_FULL_FLUSH)
    assert chunk == c.compress(zero) + c.flush(zlib.Z_FULL_FLUSH)
    crc = zlib.crc32(header)
    for _ in range(nbytes // block):
        crc = zlib.crc32(zero, crc)
    return name + ".npy", zipfile.ZIP_DEFLATED, head + chunk * (nbytes // block) + c.flush(), crc, len(header) + nbytes


def _expected(files, names, batch_size, num_samples):
    """The batches the old reader gave: whole arrays from np.load, sliced."""
    out, left = [], num_samples
    for path in files:
        with np.load(path) as z:
            arrays = {k: z[k] for k in names}
        n = next(a.shape[0] for a in arrays.values() if a.ndim)
        n = n if left is None else min(left, n)
        for start in range(0, n, batch_size):
            stop = min(start + batch_size, n)
            out.append({k: (a if a.ndim == 0 else a[start:stop]) for k, a in arrays.items()})
        if left is not None:
            left -= n
            if left <= 0:
                break
    return out


def _count_opens(monkeypatch):
    calls: list[str] = []
    real = zipfile.ZipFile.open

    def counting(self, name, *args, **kwargs):
        calls.append(name.filename if isinstance(name, zipfile.ZipInfo) else name)
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", counting)
    return calls


# -- only regular files ------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_dev_zero_as_data_is_refused(bert_dir, tmp_path):
    # in a child process: before the fix, reading /dev/zero as a zip never ended and took all memory
    code, text, _ = _graphcal("run", bert_dir / "model.onnx", "--data", "/dev/zero", "-o", tmp_path / "out", "-q",
                              timeout=60)
    _assert_one_line_error(code, text, "/dev/zero is a character device, not a regular .npz file")
    assert not (tmp_path / "out").exists()


@needs_fifo
def test_fifo_as_data_is_refused_without_blocking(bert_dir, tmp_path):
    fifo = tmp_path / "calib.npz"
    os.mkfifo(fifo)
    code, text, _ = _graphcal("run", bert_dir / "model.onnx", "--data", fifo, "-o", tmp_path / "out", "-q",
                              timeout=60)
    _assert_one_line_error(code, text, f"{fifo} is a FIFO, not a regular .npz file")


@needs_fifo
def test_fifo_inside_a_data_folder_is_an_error_not_skipped(bert_dir, tmp_path):
    folder = tmp_path / "calib"
    folder.mkdir()
    (folder / "a.npz").write_bytes((bert_dir / "calib.npz").read_bytes())
    os.mkfifo(folder / "x.npz")
    (folder / "sub").mkdir()  # subfolders are still ignored
    # load_data in a child process (no torch to import: quick), so that a regression fails, not hangs
    code = ("import sys, onnx\nfrom graphcal.data import graph_inputs, load_data\nfrom graphcal.errors import "
            "GraphcalError\ntry:\n    load_data(sys.argv[2], graph_inputs(onnx.load(sys.argv[1])))\n"
            "except GraphcalError as e:\n    sys.exit(f'error: {e}')\n")
    p = subprocess.run([sys.executable, "-c", code, str(bert_dir / "model.onnx"), str(folder)], capture_output=True,
                       text=True, timeout=60, stdin=subprocess.DEVNULL, preexec_fn=_limit_memory(4 << 30))
    _assert_one_line_error(p.returncode, p.stderr, f"{folder / 'x.npz'} is a FIFO, not a regular .npz file")


def test_symlink_to_a_regular_file_is_fine_and_a_folder_named_npz_is_not(bert_dir, tmp_path):
    inputs = graph_inputs(onnx.load(bert_dir / "model.onnx"))
    folder = tmp_path / "calib"
    folder.mkdir()
    (folder / "a.npz").symlink_to(bert_dir / "calib.npz")
    (folder / "sub").mkdir()
    assert load_data(folder, inputs).num_samples == 64
    (folder / "b.npz").mkdir()
    with pytest.raises(GraphcalError, match=r"b\.npz is a folder, not a regular \.npz file"):
        load_data(folder, inputs)


# -- sizes from the headers, before anything is read -------------------------------------------


def test_lying_header_is_refused_naming_file_array_and_sizes(bert_dir, tmp_path):
    real = dict(np.load(bert_dir / "calib.npz"))
    header = _npy_header((1000, 32), np.int64)  # the data holds 64 rows
    path = _zip(tmp_path / "lying.npz", {
        "input_ids.npy": header + real["input_ids"].tobytes(),
        "attention_mask.npy": _npy(real["attention_mask"]),
        "token_type_ids.npy": _npy(real["token_type_ids"]),
    })
    code, text = _invoke(bert_dir / "model.onnx", path, tmp_path / "out")
    declared, actual = len(header) + 1000 * 32 * 8, len(header) + 64 * 32 * 8
    _assert_one_line_error(code, text, str(path), "'input_ids'", "lying header", f"{declared:,}", f"{actual:,}")


def test_huge_declared_header_length_is_refused_before_reading(tmp_path):
    # a v2.0 header whose length field says 4 GiB: numpy would read it all before its size check
    payload = np.lib.format.MAGIC_PREFIX + bytes([2, 0]) + struct.pack("<I", 0xFFFFFFF0) + b"{" * 64
    path = _zip(tmp_path / "h.npz", {"input_ids.npy": payload, "attention_mask.npy": _npy(np.ones((2, 3), np.int64))})
    with pytest.raises(GraphcalError, match="more than numpy's limit"):
        load_data(path, SPECS)


def test_a_batch_too_big_for_memory_is_refused_naming_the_array(bert_dir, monkeypatch):
    inputs = graph_inputs(onnx.load(bert_dir / "model.onnx"))
    monkeypatch.setattr(gnpz, "_available_memory", lambda: 40_000)  # half: 20 kB; one batch of 8: 3 x 2 kB
    assert load_data(bert_dir / "calib.npz", inputs, batch_size=8).num_batches == 8
    with pytest.raises(GraphcalError) as e:
        load_data(bert_dir / "calib.npz", inputs, batch_size=32)
    message = str(e.value)
    assert "\n" not in message and "calib.npz" in message and "per batch of 32" in message
    assert any(f"array '{spec.name}'" in message for spec in inputs)
    assert "needs 8.2 kB per batch of 32" in message and "all inputs needs 24.6 kB" in message
    assert "more than half the 40.0 kB of memory available; use a smaller --batch-size" in message
    # --num-samples caps the batch: 4 samples of a 32-batch fit
    assert load_data(bert_dir / "calib.npz", inputs, batch_size=32, num_samples=4).num_batches == 1


def test_a_fortran_array_is_checked_whole(tmp_path, monkeypatch):
    specs = [InputSpec("x", np.dtype(np.float32), ("batch", 100))]
    np.savez(tmp_path / "f.npz", x=np.asfortranarray(np.zeros((1000, 100), np.float32)))
    monkeypatch.setattr(gnpz, "_available_memory", lambda: 400_000)
    with pytest.raises(GraphcalError, match=r"array 'x' is Fortran-ordered and read whole: 400\.0 kB"):
        load_data(tmp_path / "f.npz", specs, batch_size=1)


def test_unknown_available_memory_skips_the_check(bert_dir, monkeypatch):
    inputs = graph_inputs(onnx.load(bert_dir / "model.onnx"))
    monkeypatch.setattr(gnpz, "_available_memory", lambda: None)
    assert load_data(bert_dir / "calib.npz", inputs, batch_size=64).num_batches == 1
    assert gnpz._available_memory is not None


def test_two_gib_of_declared_zeros_streams_in_little_memory(bert_dir, tmp_path):
    """A 6 MB .npz declaring 3 x 2 GiB of zeros: with --num-samples 8 only 8 rows are decompressed.
    (Before streaming, this run peaked at 6.5 GB and took 49 s.)"""
    rows = (1 << 31) // (32 * 8)
    _, method, payload, crc, size = _zeros_member("input_ids", (rows, 32), np.int64)
    path = _raw_zip(tmp_path / "bomb.npz", [(key + ".npy", method, payload, crc, size)
                                            for key in ("input_ids", "attention_mask", "token_type_ids")])
    assert path.stat().st_size < 8_000_000
    common = ["--num-samples", "8", "--batch-size", "8", "--scheme", "W8A8_STATIC", "-q"]  # static: reads batches
    # an address-space cap well above a normal run, so that a regression fails instead of taking the machine
    code, text, bomb_rss = _graphcal("run", bert_dir / "model.onnx", "--data", path, "-o", tmp_path / "a", *common,
                                     max_memory=12 << 30)
    assert code == 0, text
    code, text, normal_rss = _graphcal("run", bert_dir / "model.onnx", "--data", bert_dir / "calib.npz", "-o",
                                       tmp_path / "b", *common, max_memory=12 << 30)
    assert code == 0, text
    assert bomb_rss < normal_rss + 300 * 2**20 and bomb_rss < 2**30, (bomb_rss, normal_rss)


# -- streaming gives the same batches ----------------------------------------------------------


def _mixed_files(folder: Path):
    """Two files (one stored, one deflated) with a C array, a Fortran 3-d array and a 0-d array."""
    rng = np.random.default_rng(0)
    files = []
    for i, (n, save) in enumerate([(11, np.savez), (6, np.savez_compressed)]):
        arrays = {
            "ids": rng.integers(0, 1000, (n, 5)).astype(np.int64),
            "f": np.asfortranarray(rng.standard_normal((n, 3, 4)).astype(np.float32)),
            "s": np.array(0.5 + i, np.float32),
        }
        assert arrays["f"].flags.f_contiguous and not arrays["f"].flags.c_contiguous
        save(folder / f"{i}.npz", **arrays)
        files.append(folder / f"{i}.npz")
    return files


MIXED = [InputSpec("ids", np.dtype(np.int64), ("batch", "seq")),
         InputSpec("f", np.dtype(np.float32), ("batch", 3, 4)),
         InputSpec("s", np.dtype(np.float32), ())]


@pytest.mark.parametrize("batch_size", [1, 3, 4, 64])
@pytest.mark.parametrize("num_samples", [None, 1, 7, 12, 100])
def test_streamed_batches_equal_whole_arrays(tmp_path, batch_size, num_samples):
    files = _mixed_files(tmp_path)
    for data, paths in [(tmp_path, files), (files[0], files[:1]), (files[1], files[1:])]:
        calib = load_data(data, MIXED, batch_size=batch_size, num_samples=num_samples)
        got = list(calib.batches())
        want = _expected(paths, [s.name for s in MIXED], batch_size, num_samples)
        assert len(got) == len(want) == calib.num_batches
        for g, w in zip(got, want):
            assert list(g) == [s.name for s in MIXED]
            for name in g:
                assert g[name].flags.c_contiguous and g[name].flags.writeable and g[name].dtype == w[name].dtype
                np.testing.assert_array_equal(g[name], w[name])


def test_each_array_is_opened_once_per_pass(tmp_path, monkeypatch):
    n = 20
    ids = np.arange(n * 6, dtype=np.int64).reshape(n, 6)
    np.savez_compressed(tmp_path / "c.npz", input_ids=ids, attention_mask=ids % 2)
    calls = _count_opens(monkeypatch)
    calib = load_data(tmp_path / "c.npz", SPECS, batch_size=3)
    assert sorted(calls) == ["attention_mask.npy", "input_ids.npy"]  # headers: once each
    for _ in range(2):
        calls.clear()
        batches = list(calib.batches())
        assert len(batches) == 7
        assert sorted(calls) == ["attention_mask.npy", "input_ids.npy"]
    np.testing.assert_array_equal(np.concatenate([b["input_ids"] for b in batches]), ids)


def test_streaming_stops_at_num_samples(tmp_path, monkeypatch):
    np.savez(tmp_path / "c.npz", input_ids=np.zeros((1000, 6), np.int64), attention_mask=np.ones((1000, 6), np.int64))
    read = []
    real = zipfile.ZipExtFile.read

    def counting(self, n=-1):
        data = real(self, n)
        read.append(len(data))
        return data

    calib = load_data(tmp_path / "c.npz", SPECS, batch_size=4, num_samples=10)
    monkeypatch.setattr(zipfile.ZipExtFile, "read", counting)
    assert [len(b["input_ids"]) for b in calib.batches()] == [4, 4, 2]
    assert sum(read) < 2 * (10 * 6 * 8 + 200)  # 10 rows and the header, per array


def test_npy_version_3_header_is_parsed_without_loading(tmp_path, monkeypatch):
    ids = np.arange(24, dtype=np.int64).reshape(4, 6)
    path = _zip(tmp_path / "v3.npz", {"input_ids.npy": _npy(ids, version=(3, 0)),
                                      "attention_mask.npy": _npy(ids * 0, version=(2, 0))})
    assert zipfile.ZipFile(path).read("input_ids.npy")[6:8] == bytes([3, 0])

    def no_load(*args, **kwargs):
        raise AssertionError("the array was loaded whole")

    monkeypatch.setattr(np, "load", no_load)
    monkeypatch.setattr(np.lib.format, "read_array", no_load)
    calib = load_data(path, SPECS, batch_size=3)
    assert calib.num_samples == 4
    np.testing.assert_array_equal(np.concatenate([b["input_ids"] for b in calib.batches()]), ids)


# -- damaged members and bad values --------------------------------------------------------------


def test_bad_crc_is_one_line(tmp_path):
    ids = np.arange(60, dtype=np.int64).reshape(10, 6)
    path = _zip(tmp_path / "c.npz", {"input_ids.npy": _npy(ids), "attention_mask.npy": _npy(ids)})
    raw = bytearray(path.read_bytes())
    raw[raw.index(ids[9].tobytes())] ^= 0xFF  # the last row of input_ids
    path.write_bytes(bytes(raw))
    with pytest.raises(GraphcalError, match=r"c\.npz: array 'input_ids' could not be read; the file is damaged "
                                            r"\(Bad CRC-32"):  # at load (a small member is read whole) or streaming
        list(load_data(path, SPECS, batch_size=4).batches())


def test_corrupt_deflate_stream_is_one_line(bert_dir, tmp_path):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 50, (400, 32)).astype(np.int64)
    path = _zip(tmp_path / "c.npz", {"input_ids.npy": _npy(ids), "attention_mask.npy": _npy(ids * 0)},
                method=zipfile.ZIP_DEFLATED)
    info = zipfile.ZipFile(path).getinfo("input_ids.npy")
    raw = bytearray(path.read_bytes())
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    for i in range(start + info.compress_size // 2, start + info.compress_size // 2 + 64):
        raw[i] ^= 0x5A
    path.write_bytes(bytes(raw))
    calib = load_data(path, SPECS, batch_size=50)
    with pytest.raises(GraphcalError, match=r"array 'input_ids' could not be read; the file is damaged"):
        list(calib.batches())


def test_check_values_finds_nan(tmp_path):
    specs = [InputSpec("x", np.dtype(np.float32), ("batch", 3))]
    x = np.zeros((9, 3), np.float32)
    np.savez_compressed(tmp_path / "ok.npz", x=x)
    assert load_data(tmp_path / "ok.npz", specs, batch_size=2).check_values() == 5
    x[5, 2] = np.nan
    np.savez_compressed(tmp_path / "nan.npz", x=x)
    calib = load_data(tmp_path / "nan.npz", specs, batch_size=2)
    with pytest.raises(GraphcalError, match=r"nan\.npz: input 'x' holds NaN or Inf \(sample 5\)"):
        calib.check_values()
    # only the samples the run uses are checked
    assert load_data(tmp_path / "nan.npz", specs, batch_size=2, num_samples=5).check_values() == 3


# -- fuzz: mutated headers and declared sizes ----------------------------------------------------


def _fuzz_base() -> tuple[bytes, list[tuple[int, int, int, int]]]:
    """A small stored .npz (a v1.0 and a v2.0 .npy), and for each member (start of its .npy data
    in the file, its .npy header's length, offset of its central directory record, its size)."""
    ids = np.arange(7 * 5, dtype=np.int64).reshape(7, 5)
    f = io.BytesIO()
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("input_ids.npy", _npy(ids, version=(1, 0)))
        zf.writestr("attention_mask.npy", _npy(ids % 3, version=(2, 0)))
    raw = f.getvalue()
    cd = struct.unpack("<L", raw[-6:-2])[0]
    regions = []
    for info in zipfile.ZipFile(io.BytesIO(raw)).infolist():
        data = info.header_offset + 30 + len(info.filename) + len(info.extra)
        prefix = 10 if raw[data + 6] == 1 else 12
        length = struct.unpack("<H" if prefix == 10 else "<I", raw[data + 8:data + prefix])[0]
        regions.append((data, prefix + length, cd, info.file_size))
        cd += 46 + len(info.filename) + len(info.extra) + len(info.comment)
    return raw, regions


_BASE, _REGIONS = _fuzz_base()
_INTERESTING = st.sampled_from(list(b"0123456789(),' :<>|fFiTbuv{}\x00\xff") + [0x7F])
_DIM = st.one_of(st.integers(0, 12), st.integers(-2, 2**63), st.sampled_from([2**31, 2**32 + 7, 2**62, 10**30]))
_HEADER = st.tuples(st.lists(_DIM, max_size=4).map(tuple),
                    st.sampled_from(["<i8", "<f4", "|b1", ">i8", "|O", "<U3", "|V0", "<i8"]), st.booleans())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    member=st.integers(0, 1),
    header=st.one_of(st.none(), _HEADER),
    edits=st.lists(st.tuples(st.integers(0, 200), st.one_of(_INTERESTING, st.integers(0, 255))), max_size=4),
    sizes=st.one_of(
        st.none(),
        st.tuples(st.sampled_from(["file", "compress", "both"]),
                  st.one_of(st.integers(-300, 300), st.integers(0, 2**32 - 1).map(lambda v: ("abs", v)),
                            st.just("fit")))),
    fix_crc=st.booleans(),
    batch_size=st.integers(1, 8),
)
def test_fuzzed_headers_and_sizes_load_or_fail_cleanly(tmp_path_factory, member, header, edits, sizes, fix_crc,
                                                       batch_size):
    raw = bytearray(_BASE)
    data_start, header_len, cd, size = _REGIONS[member]
    prefix = 10 if member == 0 else 12
    declared = None
    if header is not None:  # a well-formed header declaring another shape, dtype or order
        shape, descr, fortran = header
        text = f"{{'descr': {descr!r}, 'fortran_order': {fortran}, 'shape': {shape!r}, }}"
        if len(text) < header_len - prefix:
            raw[data_start + prefix:data_start + header_len] = (text.ljust(header_len - prefix - 1) + "\n").encode()
            if all(d >= 0 for d in shape):
                declared = header_len + int(np.prod(shape, dtype=object)) * np.dtype(descr).itemsize
    for position, value in edits:  # bytes of the .npy magic, version, length and header text
        raw[data_start + position % header_len] = value
    if fix_crc:  # so that the edited header reaches the parser instead of failing the CRC check
        raw[cd + 16:cd + 20] = struct.pack("<L", zlib.crc32(raw[data_start:data_start + size]))
    if sizes is not None:
        which, change = sizes
        fields = {"compress": [20], "file": [24], "both": [20, 24]}[which]
        for field in fields:
            old = struct.unpack("<L", raw[cd + field:cd + field + 4])[0]
            if change == "fit":  # agree with the declared header (the data is still what it was)
                new = declared if declared is not None and declared < 2**32 else old
            else:
                new = change[1] if isinstance(change, tuple) else old + change
            raw[cd + field:cd + field + 4] = struct.pack("<L", min(max(new, 0), 2**32 - 1))
    path = tmp_path_factory.mktemp("fuzz") / "c.npz"
    path.write_bytes(bytes(raw))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gnpz, "_available_memory", lambda: 64 << 20)  # a declared huge batch is refused
        try:
            with time_box(20):  # never a hang
                calib = load_data(path, SPECS, batch_size=batch_size)
                batches = list(calib.batches())
        except GraphcalError as e:
            assert "\n" not in str(e)
            return
    for name, (shape, dtype) in calib._sources[0].headers.items():
        got = np.concatenate([b[name] for b in batches]) if batches else None
        assert got is not None and got.shape == shape and got.dtype == dtype
        try:
            with np.load(path) as z:
                want = z[name]
        except Exception:  # noqa: BLE001 -- numpy may refuse what streamed fine; the shapes agree
            continue
        np.testing.assert_array_equal(got, want)
