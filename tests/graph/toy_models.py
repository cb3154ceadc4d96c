"""Toy models built with onnx.helper for the graph tests: decoders whose module names carry no layer number
(or interleave), each saved with calibration data beside it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphcal.runtime import run_model

H, FF = 128, 256


def save_with_calib(nodes, inits, folder: Path, outputs=("y",)) -> Path:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", H])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["b", "s", H]) for o in outputs],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "model.onnx")
    rng = np.random.default_rng(1)
    np.savez(folder / "calib.npz", x=(rng.standard_normal((16, 8, H)) * np.linspace(0.2, 2, H)).astype(np.float32))
    return folder / "model.onnx"


def toy_decoder(folder: Path, sublayers) -> Path:
    """Two pre-norm-free decoder layers: q/k/v (one input) -> attention -> o_proj -> residual, then
    gate/up (one input) -> SiLU-gated -> down_proj -> residual. ``sublayers``: per layer the module
    path of its attention and of its MLP; node names follow torch's legacy exporter
    (``/encoder/self_attn/q_proj/MatMul`` is module ``encoder.self_attn.q_proj``)."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def weight(name, shape):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name))
        return name

    def node(op, inputs, out, scope, **attrs):
        nodes.append(helper.make_node(op, inputs, [out], name="/" + scope.replace(".", "/") + "/" + op + f"_{len(nodes)}",
                                      **attrs))
        return out

    def linear(x, module, shape):
        w = weight(f"{module}.w", shape)
        nodes.append(helper.make_node("MatMul", [x, w], [f"{module}.out"], name="/" + module.replace(".", "/") + "/MatMul"))
        return f"{module}.out"

    scale = "attn_scale"
    inits.append(numpy_helper.from_array(np.array(1 / np.sqrt(H), np.float32), scale))
    h = "x"
    for attn, mlp in sublayers:
        q, k, v = (linear(h, f"{attn}.{p}", (H, H)) for p in ("q_proj", "k_proj", "v_proj"))
        kt = node("Transpose", [k], f"{attn}.kt", attn, perm=[0, 2, 1])
        s = node("Mul", [node("MatMul", [q, kt], f"{attn}.qk", attn), scale], f"{attn}.s", attn)
        a = node("MatMul", [node("Softmax", [s], f"{attn}.p", attn, axis=-1), v], f"{attn}.a", attn)
        h = node("Add", [h, linear(a, f"{attn}.o_proj", (H, H))], f"{attn}.h", attn)
        g, u = linear(h, f"{mlp}.gate_proj", (H, FF)), linear(h, f"{mlp}.up_proj", (H, FF))
        act = node("Mul", [node("Mul", [g, node("Sigmoid", [g], f"{mlp}.sg", mlp)], f"{mlp}.silu", mlp), u],
                   f"{mlp}.act", mlp)
        h = node("Add", [h, linear(act, f"{mlp}.down_proj", (FF, H))], f"{mlp}.h", mlp)
    nodes.append(helper.make_node("Identity", [h], ["y"], name="/out/Identity"))
    return save_with_calib(nodes, inits, folder)


def outputs_on_calib(model_path: Path, folder: Path) -> np.ndarray:
    x = np.load(folder / "calib.npz")["x"][:8]
    return run_model(str(model_path), {"x": x})["y"]
