"""The block walks' cache (graphcal.calibration.block_cache, --cache-mb): in memory up to a budget, on disk
beyond it, in a folder inside the output's temporary folder that is gone after success, an error, SIGTERM
and Ctrl-C; the outputs the same bytes wherever the cached tensors were held."""

from __future__ import annotations

import collections
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from graphcal.calibration.block_cache import BlockCache, budget_bytes
from graphcal.errors import GraphcalError, UsageError
from tests.helpers import run_cli, signal_paused_run

OUTPUTS = ("model.onnx", "quantization_config.json", "qparams.safetensors")
RUNS = {"gptq": ["--scheme", "W4A16", "--algorithm", "gptq", "--gptq-order", "sequential"],
        "awq": ["--scheme", "W4A16", "--algorithm", "awq"]}


def _values():
    """Values of every kind a block run hands back: torch on the host (fp32, bf16, fp16, ints, bool, a
    scalar, an empty one, a transposed view) and numpy (float16, int8, big-endian, a strided view)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 7, generator=g)
    a = np.random.default_rng(0).standard_normal((4, 6))
    return [x, x.to(torch.bfloat16), x.to(torch.float16), (x * 100).to(torch.int64), x > 0, torch.tensor(2.5),
            torch.zeros(0, 4), x.transpose(0, 2), a.astype(np.float16), (a * 50).astype(np.int8),
            a.astype(">f4"), a[::2, 1::3]]


def _same(got, want) -> bool:
    """Same type, dtype, shape and bytes (NaN-safe)."""
    if isinstance(want, torch.Tensor):
        return (isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
                and got.device.type == "cpu"
                and torch.equal(got.contiguous().reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8)))
    return (isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
            and np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes())


def test_values_come_back_with_their_bytes_from_disk(tmp_path):
    values = _values()
    with BlockCache(0, lambda: tmp_path) as cache:
        cache.put("x", values)
        spool = cache["x"]
        assert spool.on_disk == sum((v.size if isinstance(v, np.ndarray) else v.numel()) > 0 for v in values) > 0
        assert cache.held == 0 and len(spool) == len(values)
        for got, want in zip(spool, values):
            assert _same(got, want), want.dtype
        folder = cache.folder()
        assert folder.parent == tmp_path and len(list(folder.iterdir())) == spool.on_disk
        cache.drop("x")
        assert list(folder.iterdir()) == [] and cache.on_disk == 0
    assert list(tmp_path.iterdir()) == []  # close() removes the folder


def test_memory_up_to_the_budget_then_disk(tmp_path):
    x = torch.arange(250, dtype=torch.float32)  # 1000 bytes each
    with BlockCache(2500, lambda: tmp_path) as cache:
        spool = cache.spool()
        for i in range(4):
            spool.append(x + i)
        assert (cache.held, spool.on_disk, cache.on_disk) == (2000, 2, 2000)  # two held, two written
        cache.put("a", spool)
        assert cache["a"] is spool  # a spool of the cache is taken as it is, not copied
        assert all(torch.equal(spool[i], x + i) for i in range(4))
        cache.put("b", [x])  # 2000 held + 1000 > 2500: on disk
        assert cache["b"].on_disk == 1
        cache.drop("a")
        assert (cache.held, cache.on_disk) == (0, 1000)
        cache.put("c", [x, x])
        assert (cache.held, cache["c"].on_disk) == (2000, 0)  # the budget freed by the drop is used again


def test_no_budget_and_gpu_values_stay_in_memory(tmp_path):
    with BlockCache(None, lambda: tmp_path) as cache:
        cache.put("x", _values())
        assert cache["x"].on_disk == 0 and cache.files_written == 0
    assert list(tmp_path.iterdir()) == []  # no spill: no folder made


def test_a_dropped_spool_deletes_its_files(tmp_path):
    cache = BlockCache(0, lambda: tmp_path)
    spool = cache.spool()
    spool.append(torch.ones(10))
    folder = cache.folder()
    assert len(list(folder.iterdir())) == 1
    del spool  # run_block's spool that no keep() took
    assert list(folder.iterdir()) == [] and cache.on_disk == 0
    cache.close()
    assert not folder.exists()


def test_budget_from_cache_mb_and_from_the_memory_available(monkeypatch):
    import graphcal.calibration.block_cache as block_cache

    monkeypatch.setattr(block_cache, "available_memory", lambda: 8_000_000)
    assert budget_bytes(None) == 4_000_000
    assert budget_bytes(0) == 0 and budget_bytes(1.5) == 1_500_000
    monkeypatch.setattr(block_cache, "available_memory", lambda: None)
    assert budget_bytes(None) is None
    for bad in (-1, float("nan"), float("inf"), "many", True):
        with pytest.raises(UsageError, match="cache_mb"):
            budget_bytes(bad)


def test_the_disk_check_counts_only_what_spills(tmp_path, monkeypatch):
    import graphcal.calibration.block_cache as block_cache

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(block_cache.shutil, "disk_usage", lambda p: usage(10**9, 0, 600))
    with BlockCache(1000, lambda: tmp_path) as cache:
        cache.put("x", [torch.zeros(100)])  # 400 bytes held
        assert cache.spill_bytes(500) == 0
        cache.check_disk(1100, "the tensors")  # 500 of them spill: 600 free
        with pytest.raises(GraphcalError) as e:
            cache.check_disk(1300, "the tensors")  # 700 spill
        message = str(e.value)
        assert "\n" not in message and "700 bytes on disk" in message and "--cache-mb" in message, message


def test_blockwise_results_equal_with_everything_on_disk(llama_dir, tmp_path):
    """run_block and keep on a cache of budget 0 hand the next block the values of a cache in memory."""
    from graphcal.calibration.blockwise import Blockwise
    from graphcal.calibration.plan import load, plan
    from graphcal.config import Options, resolve
    from graphcal.data import graph_inputs, load_data

    path = llama_dir / "model.onnx"
    config = resolve(Options(scheme="W4A16", algorithm="gptq"))
    loaded = load(path, config)
    run = plan(path, config, loaded=loaded)
    arrays = {k: v[:6] for k, v in np.load(llama_dir / "calib.npz").items()}
    calib = load_data(arrays, graph_inputs(loaded.model), batch_size=2)
    walks = [Blockwise(run, loaded, calib, device="cpu", cache_mb=None),
             Blockwise(run, loaded, calib, device="cpu", cache_mb=0, cache_folder=lambda: tmp_path)]
    try:
        for walk in walks:
            walk.keep(0, walk.run_block(0, walk.needed(0)))
        memory, disk = walks
        assert disk.cache.files_written == 3 * len(disk.needed(0)) and memory.cache.files_written == 0
        assert len(list(tmp_path.rglob("*.bin"))) == disk.cache.files_written
        a, b = memory.run_block(1, memory.needed(1) or memory.blocks[1].outputs), disk.run_block(1, disk.needed(1) or disk.blocks[1].outputs)
        for name in a:
            assert len(a[name]) == len(b[name]) == 3
            assert all(_same(x, y) for x, y in zip(b[name], a[name])), name
    finally:
        for walk in walks:
            walk.close()
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def writes(monkeypatch):
    """Every block cache file written in this process: (its path, whether it existed right after)."""
    seen = []
    real = BlockCache._write

    def counted(self, value, path):
        item = real(self, value, path)
        seen.append((path, path.is_file()))
        return item

    monkeypatch.setattr(BlockCache, "_write", counted)
    return seen


def _leftovers(folder: Path) -> list[Path]:
    """Temporary folders, lock files and cache files of a run under ``folder``."""
    return [p for p in folder.rglob("*") if ".tmp-" in p.name or "graphcal-block-cache" in str(p) or p.suffix == ".bin"
            or "lock" in p.name]


@pytest.mark.parametrize("algorithm", list(RUNS))
def test_outputs_are_the_same_bytes_wherever_the_cache_is_held(llama_dir, tmp_path, writes, algorithm):
    args = ["run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", *RUNS[algorithm], "-q"]
    result = run_cli(*args, "-o", tmp_path / "memory")
    assert result.exit_code == 0, result.output
    assert writes == []  # the default budget holds tiny-llama's cache in memory
    for label, mb in (("disk", "0"), ("part", "0.3")):
        result = run_cli(*args, "-o", tmp_path / label, "--cache-mb", mb)
        assert result.exit_code == 0, result.output
        for name in OUTPUTS:
            assert (tmp_path / label / name).read_bytes() == (tmp_path / "memory" / name).read_bytes(), (label, name)
    assert writes and all(existed for _, existed in writes)
    for path, _ in writes:  # in the output's temporary folder, beside -o, never in it
        assert path.parent.parent.parent == tmp_path and path.parent.parent.name.startswith((".disk.tmp-", ".part.tmp-"))
    assert _leftovers(tmp_path) == []
    assert {p.name for p in (tmp_path / "disk").iterdir()} == {p.name for p in (tmp_path / "memory").iterdir()}


@pytest.mark.parametrize("algorithm", list(RUNS))
def test_nothing_remains_after_an_error_in_the_walk(llama_dir, tmp_path, writes, monkeypatch, algorithm):
    from graphcal.calibration.blockwise import Blockwise

    real = Blockwise.batches

    def failing(self, k):
        if k == 1:  # block 1's inputs asked for: GPTQ's Hessians, AWQ's block run
            assert list(tmp_path.rglob("*.bin")), "block 0's outputs are on disk by now"
            raise GraphcalError("a failure in block 1")
        return real(self, k)

    monkeypatch.setattr(Blockwise, "batches", failing)
    result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", *RUNS[algorithm],
                     "--cache-mb", "0", "-o", tmp_path / "o")
    assert result.exit_code == 1 and "error: a failure in block 1" in result.output, result.output
    assert writes and _leftovers(tmp_path) == [] and not (tmp_path / "o").exists()


def test_a_walk_without_an_output_folder_cleans_its_own(llama_dir, tmp_path, monkeypatch):
    """The API's walks outside a run (no output slot) spill to the system's temporary folder, removed
    by close() however the walk ends."""
    import tempfile

    from graphcal.calibration.blockwise import Blockwise
    from graphcal.calibration.plan import load, plan
    from graphcal.config import Options, resolve
    from graphcal.data import graph_inputs, load_data

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = llama_dir / "model.onnx"
    config = resolve(Options(scheme="W4A16", algorithm="gptq"))
    loaded = load(path, config)
    run = plan(path, config, loaded=loaded)
    calib = load_data({k: v[:2] for k, v in np.load(llama_dir / "calib.npz").items()}, graph_inputs(loaded.model))
    with pytest.raises(RuntimeError, match="stop"), Blockwise(run, loaded, calib, device="cpu", cache_mb=0) as walk:
        walk.keep(0, walk.run_block(0, walk.needed(0)))
        assert [p.name.startswith("graphcal-block-cache-") for p in tmp_path.iterdir()] == [True]
        raise RuntimeError("stop")
    assert list(tmp_path.iterdir()) == []


# the run in a child process, paused right after the block cache's first file is written (the signal is
# then taken in Python, as it would be between two block runs)
PAUSED = """
import os, sys, time
from pathlib import Path
from graphcal.calibration.block_cache import BlockCache
real = BlockCache._write
def paused(self, value, path):
    item = real(self, value, path)
    Path(os.environ["GC_PAUSED"]).touch()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.05)
    return item
BlockCache._write = paused
from graphcal.cli import main
sys.argv = ["graphcal", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_the_cache_is_gone_after_sigterm_and_ctrl_c(llama_dir, tmp_path, sig, code):
    work = tmp_path / "work"
    work.mkdir()

    def check():
        files = list(work.rglob("*.bin"))
        assert files and all("graphcal-block-cache-" in f.parent.name for f in files)

    returncode, err = signal_paused_run(PAUSED, ["run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz",
                                                 *RUNS["gptq"], "--cache-mb", "0", "-o", work / "o"], tmp_path, sig,
                                        "its block cache", check)
    assert returncode == code, err
    lines = err.strip().splitlines()
    assert lines == ["interrupted; no output was written"], err
    assert list(work.iterdir()) == []  # the cache, the temporary folder and the lock all gone


def test_cache_mb_flag(llama_dir, tmp_path):
    assert "--cache-mb" in run_cli("run", "--help").output
    help_text = " ".join(run_cli("run", "--help").output.split())
    assert "half the memory available" in help_text and "0: all on disk" in help_text
    for bad in ("-1", "nan", "lots"):
        result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", tmp_path / "o",
                         "--cache-mb", bad)
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert [line for line in result.output.splitlines() if line.startswith("error")], result.output
    from graphcal.calibration.pipeline import calibrate

    with pytest.raises(UsageError, match="cache_mb"):
        calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "o", scheme="W4A16", algorithm="gptq",
                  cache_mb=-5)
    assert not (tmp_path / "o").exists()


def _cuda_usable() -> bool:
    import onnxruntime as ort

    return torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers()


GPU = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_usable(), reason="needs a CUDA GPU, a CUDA torch and onnxruntime-gpu")]


@GPU[0]
@GPU[1]
def test_gpu_values_stay_on_the_gpu_uncounted(tmp_path):
    x = torch.arange(1000, dtype=torch.float32, device="cuda")
    with BlockCache(0, lambda: tmp_path) as cache:
        cache.put("x", [x, x.cpu()])
        assert cache["x"][0] is x and cache["x"].on_disk == 1 and cache.held == 0  # the host copy spilled
        assert torch.equal(cache["x"][1], x.cpu())


@GPU[0]
@GPU[1]
@pytest.mark.parametrize("algorithm", list(RUNS))
def test_cuda_walk_spilling_host_tensors_writes_the_same_bytes(llama_dir, tmp_path, writes, monkeypatch, algorithm):
    """Under CUDA: the walk's tensors on the GPU (default), and kept on the host (placement told the GPU is
    full) with every one of them on disk (--cache-mb 0), give the same output bytes."""
    from graphcal.calibration.blockwise import Blockwise

    args = ["run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", *RUNS[algorithm], "--device", "cuda", "-q"]
    result = run_cli(*args, "-o", tmp_path / "gpu", "--cache-mb", "0")
    assert result.exit_code == 0, result.output
    assert writes == []  # on the GPU: nothing counted, nothing spilled
    monkeypatch.setattr(Blockwise, "placement", lambda self, k, first: torch.device("cpu"))  # as for a full GPU
    result = run_cli(*args, "-o", tmp_path / "host", "--cache-mb", "0")
    assert result.exit_code == 0, result.output
    assert writes
    for name in OUTPUTS:
        assert (tmp_path / "host" / name).read_bytes() == (tmp_path / "gpu" / name).read_bytes(), name
    assert _leftovers(tmp_path) == []
