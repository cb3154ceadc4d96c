"""SIGTERM and SIGINT stop eval, bench and export within a second or two, as they stop run, with nothing half written.

Python runs a signal's handler in the main thread between bytecodes: a command inside one long call
in C (here an onnxruntime run of a chain of 2048 x 2048 MatMuls, many seconds on a small machine)
saw the signal only when the call returned. graphcal.cli.guard's watcher stops it from another
thread after a second's grace, running the registered clean-ups first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.helpers import REPO

WIDTH = 2048  # each MatMul of the chain: 2 x 2048^3 = 17 GFLOP, whatever the batch
CHAIN = 48


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    """(a model whose one run is a long onnxruntime call, its copy as the "quantized" one, data)."""
    folder = tmp_path_factory.mktemp("slow")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [WIDTH, WIDTH])
    nodes = [helper.make_node("Transpose", ["x"], ["xt"]), helper.make_node("MatMul", ["xt", "x"], ["m0"]),
             helper.make_node("Tanh", ["m0"], ["t0"])]
    for i in range(CHAIN):
        nodes += [helper.make_node("MatMul", [f"t{i}", f"t{i}"], [f"m{i + 1}"]),
                  helper.make_node("Tanh", [f"m{i + 1}"], [f"t{i + 1}" if i + 1 < CHAIN else "y"])]
    model = helper.make_model(helper.make_graph(nodes, "slow", [x], [y]), opset_imports=[helper.make_opsetid("", 17)],
                              ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, folder / "ref.onnx")
    onnx.save(model, folder / "q.onnx")
    np.savez(folder / "data.npz", x=np.random.default_rng(0).standard_normal((16, WIDTH), dtype=np.float32) / 64)
    return folder


def _stopped(args, marker, tmp_path, sig=signal.SIGTERM, env=None):
    """Start ``graphcal -v ARGS`` in ``tmp_path``, wait for the log line ``marker`` (the long pass has
    begun), send ``sig`` and return (exit code, seconds from the signal to the exit, stderr)."""
    # SIGINT's default action restored in the child: a shell starting pytest in the background
    # (``cmd &``) ignores SIGINT for it, the children inherit that, and graphcal rightly honours it
    proc = subprocess.Popen([sys.executable, "-m", "graphcal", "-v", *map(str, args)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    deadline = time.monotonic() + 120
    for line in proc.stderr:
        seen.append(line)
        if marker in line:
            break
        assert time.monotonic() < deadline, "".join(seen)
    else:
        proc.wait()
        pytest.fail(f"exited {proc.returncode} before {marker!r}:\n{''.join(seen)}")
    time.sleep(0.5)  # inside the long call
    sent = time.monotonic()
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, time.monotonic() - sent, "".join(seen) + err


def _stopped_promptly(code, seconds, err, want):
    assert code == want, err
    assert seconds < 4, f"still running {seconds:.1f} s after the signal"
    assert "interrupted; no output was written" in err and "Traceback" not in err, err


@pytest.mark.slow
@pytest.mark.parametrize("sig, want", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_eval_stops_inside_a_long_onnxruntime_run(slow, tmp_path, sig, want):
    page = tmp_path / "report.html"
    code, seconds, err = _stopped(["eval", slow / "ref.onnx", slow / "q.onnx", "--data", slow / "data.npz",
                                   "--html", page], "evaluating on 16 samples", tmp_path, sig)
    _stopped_promptly(code, seconds, err, want)
    assert list(tmp_path.iterdir()) == []  # no page, no temporary file


@pytest.mark.slow
def test_bench_stops_inside_a_long_onnxruntime_run(slow, tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    code, seconds, err = _stopped(["bench", slow / "ref.onnx", slow / "q.onnx", "--data", slow / "data.npz",
                                   "--no-decode", "--warmup", "1", "--rounds", "1"], "timing the prefill",
                                  tmp_path, env={"TMPDIR": str(temp)})
    _stopped_promptly(code, seconds, err, 143)
    assert [p for p in temp.iterdir() if p.name.startswith("graphcal-bench-")] == []  # its temporary folder is gone


@pytest.mark.slow
def test_export_stops_while_tokenizing(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tools.builders import build_tiny_llama

    folder = tmp_path / "llama"
    build_tiny_llama()[0].save_pretrained(folder)
    words = ["<unk>", "<pad>"] + [f"w{i}" for i in range(254)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                            model_input_names=["input_ids", "attention_mask"]).save_pretrained(folder)
    rng = np.random.default_rng(0)
    line = " ".join(f"w{i}" for i in rng.integers(0, 254, 20))
    text = tmp_path / "calib.txt"
    text.write_text((line + "\n") * 400_000)  # 32 MB of lines: seconds in the tokenizer
    work = tmp_path / "work"
    work.mkdir()
    code, seconds, err = _stopped(["export", folder, "-o", work / "out", "--text", text, "--seq", "32"],
                                  "tokenizing 400,000 lines", work)
    _stopped_promptly(code, seconds, err, 143)
    assert list(work.iterdir()) == []  # no -o, no temporary folder, no lock file
