"""A model folder chooses no code: a genai_config.json naming a custom ops library (or provider options
naming libraries, files to write) makes neither `bench` load it nor `run` copy it into -o.

The library is a real one, compiled here with the system's C compiler (skipped without one): its
constructor writes a marker file the moment anything loads it, so "not loaded" is checked by the
marker's absence, and `bench --allow-custom-ops` loading it shows the marker works.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from graphcal.data.genai_native import strip_native
from tests.helpers import run_cli

MARKER_ENV = "GRAPHCAL_TEST_MARKER"
# a custom ops library that registers no op: RegisterCustomOps returns no error (a null OrtStatus*)
LIBRARY_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void mark(void) {
  const char *path = getenv("GRAPHCAL_TEST_MARKER");
  FILE *f = path ? fopen(path, "w") : NULL;
  if (f) { fputs("loaded\n", f); fclose(f); }
}
void *RegisterCustomOps(void *options, const void *api) { return 0; }
"""
FAST = ["--rounds", "1", "--warmup", "0", "--no-memory", "--device", "cpu", "--genai-tokens", "2",
        "--genai-rounds", "1", "--json"]


def test_strip_native_keeps_flags_and_drops_libraries_paths_and_config_entries():
    config = {"model": {
        "decoder": {"filename": "model.onnx", "session_options": {
            "log_id": "onnxruntime-genai", "intra_op_num_threads": 2, "custom_ops_library": "libx.so",
            "enable_profiling": "/tmp/profile", "ep.context_file_path": "/elsewhere/ctx.onnx",
            "session.intra_op.allow_spinning": "0",
            "provider_options": [{"cuda": {"enable_cuda_graph": "0", "gpu_external_alloc": "140000000"}},
                                 {"qnn": {"backend_path": "libQnnHtp.so"}}]},
            "run_options": {"qnn.lora_config": "lora.txt"}},
        "vision": {"session_options": {"custom_ops_library": "/abs/libv.so"}},
        "context_length": 128}}
    stripped = strip_native(config)
    assert stripped.config == {"model": {
        "decoder": {"filename": "model.onnx", "session_options": {
            "log_id": "onnxruntime-genai", "intra_op_num_threads": 2, "session.intra_op.allow_spinning": "0",
            "provider_options": [{"cuda": {"enable_cuda_graph": "0"}}, {"qnn": {}}]},
            "run_options": {}},
        "vision": {"session_options": {}},
        "context_length": 128}}
    assert stripped.dropped == (
        "model.decoder.session_options.custom_ops_library", "model.decoder.session_options.enable_profiling",
        "model.decoder.session_options.ep.context_file_path",
        "model.decoder.session_options.provider_options[0].cuda.gpu_external_alloc",
        "model.decoder.session_options.provider_options[1].qnn.backend_path",
        "model.decoder.run_options.qnn.lora_config", "model.vision.session_options.custom_ops_library")
    assert stripped.libraries == (("model.decoder.session_options.custom_ops_library", "libx.so"),
                                  ("model.vision.session_options.custom_ops_library", "/abs/libv.so"))
    assert config["model"]["decoder"]["session_options"]["custom_ops_library"] == "libx.so"  # the input untouched
    kept = strip_native(config, lambda value: "copied.so" if value == "libx.so" else None)
    assert kept.config["model"]["decoder"]["session_options"]["custom_ops_library"] == "copied.so"
    assert "model.decoder.session_options.custom_ops_library" not in kept.dropped


@pytest.fixture(scope="module")
def hostile(builder_model, tmp_path_factory):
    """(the builder model's folder with a custom ops library beside it that its genai_config.json names,
    the library, the calibration data); skipped without a C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the custom ops library")
    folder, calib = builder_model
    root = tmp_path_factory.mktemp("native")
    evil = root / "evil"
    shutil.copytree(folder, evil)
    (root / "lib.c").write_text(LIBRARY_C)
    library = evil / "libmarker.so"
    built = subprocess.run([cc, "-shared", "-fPIC", "-o", str(library), str(root / "lib.c")], capture_output=True, text=True)
    if built.returncode != 0:
        pytest.skip(f"could not build the custom ops library: {built.stderr[-300:]}")
    config = json.loads((evil / "genai_config.json").read_text())
    options = config["model"]["decoder"]["session_options"]
    options["custom_ops_library"] = "libmarker.so"
    options["enable_profiling"] = str(root / "profile")  # a file onnxruntime would write
    (evil / "genai_config.json").write_text(json.dumps(config, indent=4))
    return evil, library, calib


def test_run_never_copies_a_custom_ops_library_into_the_output(hostile, tmp_path, monkeypatch):
    evil, _library, calib = hostile
    marker = tmp_path / "marker"
    monkeypatch.setenv(MARKER_ENV, str(marker))
    before = (evil / "genai_config.json").read_bytes()
    result = run_cli("run", str(evil / "model.onnx"), "--data", str(calib), "-o", str(tmp_path / "out"),
                     "--scheme", "W4A16", "--group-size", "32", "-q")
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "out" / "genai_config.json").read_text())
    options = written["model"]["decoder"]["session_options"]
    assert "custom_ops_library" not in options and "enable_profiling" not in options
    assert options == {"log_id": "onnxruntime-genai", "provider_options": []}  # what the builder wrote stays
    assert written["model"]["decoder"]["filename"] == "model.onnx"
    lines = [line for line in result.output.splitlines() if "left out of -o's genai_config.json" in line]
    assert len(lines) == 1 and lines[0].startswith("warning: "), result.output
    assert "model.decoder.session_options.custom_ops_library" in lines[0]
    assert "model.decoder.session_options.enable_profiling" in lines[0]
    assert not (tmp_path / "out" / "libmarker.so").exists() and not marker.exists()
    assert (evil / "genai_config.json").read_bytes() == before  # the input is never modified


def test_bench_loads_no_library_a_model_folder_names(hostile, tmp_path, monkeypatch):
    og = pytest.importorskip("onnxruntime_genai")
    evil, library, calib = hostile
    marker = tmp_path / "marker"
    monkeypatch.setenv(MARKER_ENV, str(marker))
    handed = []  # the genai_config.json of every folder onnxruntime-genai is asked to open
    real_config = og.Config

    def config(path):
        handed.append(json.loads((Path(path) / "genai_config.json").read_text()))
        return real_config(path)

    monkeypatch.setattr(og, "Config", config)
    model = str(evil / "model.onnx")
    result = run_cli("bench", model, model, "--data", str(calib), *FAST)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["genai_loop"]["measured"], report["genai_loop"]  # the loop ran, without the library
    assert not marker.exists()
    assert len(handed) == 2 and all("custom_ops_library" not in json.dumps(c) for c in handed)
    assert all("enable_profiling" not in json.dumps(c) for c in handed)
    assert not list(evil.parent.glob("profile*"))  # onnxruntime wrote no profile
    notes = [n for n in report["notes"] if "custom_ops_library" in n]
    assert len(notes) == 2 and "--allow-custom-ops" in notes[0], report["notes"]  # one line per model folder

    other = tmp_path / "other.so"
    other.write_bytes(library.read_bytes())
    wrong = run_cli("bench", model, model, "--data", str(calib), *FAST, "--allow-custom-ops", str(other))
    assert wrong.exit_code == 2 and not marker.exists(), wrong.output
    errors = [line for line in wrong.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "names 'libmarker.so', another library" in errors[0], wrong.output

    # asked by the flag, naming the library the config names: loaded (the marker shows loading is seen)
    handed.clear()
    allowed = run_cli("bench", model, model, "--data", str(calib), *FAST, "--allow-custom-ops",
                      str(library))
    assert allowed.exit_code == 0, allowed.output
    assert json.loads(allowed.output)["genai_loop"]["measured"]
    assert marker.read_text() == "loaded\n"
    assert [c["model"]["decoder"]["session_options"]["custom_ops_library"] for c in handed] == ["libmarker.so"] * 2
