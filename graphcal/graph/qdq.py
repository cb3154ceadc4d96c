"""Write Q/DQ into a copy of the model from calibrated qparams (compressed-tensors conventions).

Forms written (before -> after):

Types: symmetric int8 (opset 13) and fp8 e4m3fn (opset 19); a model below the opset a scheme
needs is converted with onnx's version converter, and IR is set to what onnxruntime loads.

- weight, per-tensor or per-channel int8 / fp8::

      MatMul(x, W[in, out])  ->  MatMul(x, DequantizeLinear(Wq int8 [in, out], scale[out], zp, axis=1))

  (Gemm with transB=1 keeps [out, in] and axis=0). Any Transpose/Cast/Reshape between the
  weight and the node is folded into the stored tensor; unused nodes and initializers go.
- static per-tensor activation::

      MatMul(x, .)  ->  MatMul(DequantizeLinear(QuantizeLinear(x, s, zp), s, zp), .)

  one Q/DQ pair per activation and qparams, shared by q/k/v-style consumers.
- dynamic per-token activation, computed at run time as compressed-tensors does
  (scale = max|x| over the hidden dim / 127.5 for int8, / 448 for fp8; 0 -> eps)::

      x[..., H] -> Reshape[-1, H] -> Q/DQ(axis=0, scale = Where(amax==0, eps, ReduceMax(Abs)/127.5)) -> Reshape(Shape(x))

  A 2-D activation (Gemm input) is quantized per tensor, exactly as compressed-tensors'
  token strategy does for 2-D inputs (it keeps dims 0 and 1, so nothing is left per token).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from graphcal.errors import GraphcalError
from graphcal.graph.io import MAX_ORT_IR, default_opset
from graphcal.graph.targets import torch_weight
from graphcal.types import QParams, QuantizedTarget, Target

# IR version onnxruntime accepts for each opset (onnx's own table, capped at what ORT loads).
_IR_FOR_OPSET = {13: 7, 14: 7, 15: 8, 16: 8, 17: 8, 18: 8, 19: 9, 20: 9, 21: 10}


def emit_qdq(model: onnx.ModelProto, items: list[QuantizedTarget]) -> onnx.ModelProto:
    """A new model with every item's weight stored quantized and its activations Q/DQ'd."""
    need = max([required_opset(item) for item in items] + [13])
    out = onnx.ModelProto()
    out.CopyFrom(model)
    if default_opset(out) < need:
        out = _upgrade_opset(out, need)
    writer = _Writer(out)
    for item in items:
        writer.quantize_weight(item)
        writer.quantize_input(item)
    writer.finish()
    return out


def required_opset(item: QuantizedTarget) -> int:
    """The lowest opset that expresses this target's scheme; raises for what is not written yet."""
    scheme = item.scheme
    if scheme.output_activations is not None:
        raise GraphcalError(f"{item.target.name}: output_activations are not written to ONNX yet")
    opsets = [_weight_opset(scheme.weights, item.target.name)]
    if scheme.input_activations is not None:
        opsets.append(_input_opset(scheme.input_activations, item.target.name))
    return max(opsets)


@dataclass(frozen=True)
class _QType:
    """How one compressed-tensors type is stored in ONNX."""

    onnx_type: int
    torch_dtype: torch.dtype
    half_range: float  # compressed-tensors' symmetric divisor: (qmax - qmin) / 2
    opset: int  # lowest opset whose Q/DQ take this type


_QTYPES = {
    ("int", 8): _QType(TensorProto.INT8, torch.int8, 127.5, 13),
    ("float", 8): _QType(TensorProto.FLOAT8E4M3FN, torch.float8_e4m3fn, 448.0, 19),
}


def _qtype(args) -> _QType | None:
    if not args.symmetric:
        return None  # asymmetric zero points: written with the other forms of issue 4
    return _QTYPES.get((args.type, args.num_bits))


def _weight_opset(args, where: str) -> int:
    if args is None:
        raise GraphcalError(f"{where}: schemes without weight quantization are not written yet")
    qtype = _qtype(args)
    if qtype is not None and args.strategy in ("tensor", "channel"):
        return qtype.opset
    raise GraphcalError(
        f"{where}: weights {args.type}{args.num_bits} (symmetric={args.symmetric}) with strategy {args.strategy} "
        "are not written to ONNX yet (supported: symmetric int8/fp8 tensor or channel)"
    )


def _input_opset(args, where: str) -> int:
    qtype = _qtype(args)
    if qtype is not None:
        if args.dynamic is False and args.strategy == "tensor":
            return qtype.opset
        if args.dynamic is True and args.strategy in ("token", "tensor"):
            return qtype.opset
    raise GraphcalError(
        f"{where}: input activations {args.type}{args.num_bits} {args.strategy} dynamic={args.dynamic} "
        "are not written to ONNX yet (supported: symmetric int8/fp8, static tensor or dynamic token/tensor)"
    )


class _Writer:
    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.graph = model.graph
        self.opset = default_opset(model)
        self.nodes_before: dict[str, list[onnx.NodeProto]] = {}  # target node name -> nodes to insert before it
        self.inits: list[onnx.TensorProto] = []
        self.shared: dict[tuple, str] = {}  # (activation, qparams key) -> dequantized tensor name
        self.detached: set[str] = set()  # weight-path node outputs / initializers that may be dead now
        self.names = {n.name for n in self.graph.node} | {t.name for t in self.graph.initializer}
        self.node_by_name = {n.name: n for n in self.graph.node}

    # -- weights -----------------------------------------------------------------------------
    def quantize_weight(self, item: QuantizedTarget) -> None:
        from compressed_tensors.quantization.lifecycle.forward import quantize

        t, args = item.target, item.scheme.weights
        qtype = _qtype(args)
        qp = item.qparams["weight"]
        w = torch.from_numpy(torch_weight(self.model, t))
        q = quantize(w, qp.scale.to(w.dtype), qp.zero_point, args, dtype=qtype.torch_dtype)
        axis = 1 if t.layout == "in_out" else 0
        stored = q.T.contiguous() if t.layout == "in_out" else q.contiguous()
        scale = _onnx_scale(qp.scale, args.strategy, w.dtype)
        wq = self._const_q(f"{t.name}.weight_quantized", stored, qtype)
        s = self._const(f"{t.name}.weight_scale", scale)
        z = self._const_q(f"{t.name}.weight_zero_point", torch.zeros(scale.shape, dtype=qtype.torch_dtype), qtype)
        dq_out = self._unique(f"{t.name}.weight_dequantized")
        attrs = {"axis": axis} if scale.ndim == 1 else {}
        self._add(t, helper.make_node(
            "DequantizeLinear", [wq, s, z], [dq_out], name=self._unique(f"{t.name}/weight/DequantizeLinear"), **attrs
        ))
        node = self.node_by_name[t.node]
        old = node.input[1]
        node.input[1] = dq_out
        self.detached.add(old)
        self.detached.add(t.weight)

    # -- activations -------------------------------------------------------------------------
    def quantize_input(self, item: QuantizedTarget) -> None:
        args = item.scheme.input_activations
        if args is None:
            return
        t = item.target
        qtype = _qtype(args)
        if args.dynamic is True:
            key = (t.activation, "dynamic", args.model_dump_json())
            if key not in self.shared:
                self.shared[key] = self._dynamic(t, args.strategy, qtype)
        else:
            qp = item.qparams["input"]
            key = (t.activation, "static", args.model_dump_json(), qp.scale.numpy().tobytes())
            if key not in self.shared:
                self.shared[key] = self._static(t, qp, qtype)
        self.node_by_name[t.node].input[0] = self.shared[key]

    def _static(self, t: Target, qp: QParams, qtype: _QType) -> str:
        dtype = self._act_dtype(t)
        s = self._const(f"{t.name}.input_scale", _onnx_scale(qp.scale, "tensor", dtype))
        z = self._const_q(f"{t.name}.input_zero_point", torch.zeros((), dtype=qtype.torch_dtype), qtype)
        q = self._unique(f"{t.activation}_quantized")
        dq = self._unique(f"{t.activation}_dequantized")
        self._add(t, helper.make_node("QuantizeLinear", [t.activation, s, z], [q], name=self._unique(f"{t.name}/input/QuantizeLinear")))
        self._add(t, helper.make_node("DequantizeLinear", [q, s, z], [dq], name=self._unique(f"{t.name}/input/DequantizeLinear")))
        return dq

    def _dynamic(self, t: Target, strategy: str, qtype: _QType) -> str:
        """Per-token (3-D and up) or per-tensor (2-D, and strategy tensor) dynamic Q/DQ."""
        dtype = self._act_dtype(t)
        rank = self._act_rank(t)
        per_token = strategy == "token" and (rank is None or rank >= 3)
        base = f"{t.name}/input"
        x = t.activation
        if per_token:
            shape2d = self._const(f"{t.name}.input_2d_shape", np.array([-1, t.in_features], dtype=np.int64))
            x = self._op(t, "Reshape", [x, shape2d], f"{base}/Reshape")
        absx = self._op(t, "Abs", [x], f"{base}/Abs")
        amax = self._reduce_max(t, absx, [1] if per_token else None, f"{base}/ReduceMax")
        half_range = self._const(f"{t.name}.input_half_range", np.array(qtype.half_range, dtype=dtype))
        raw = self._op(t, "Div", [amax, half_range], f"{base}/Div")
        zero = self._const(f"{t.name}.input_zero", np.array(0, dtype=dtype))
        eps = self._const(f"{t.name}.input_eps", np.array(np.finfo(np.float32).eps, dtype=dtype))
        is_zero = self._op(t, "Equal", [raw, zero], f"{base}/Equal")
        scale = self._op(t, "Where", [is_zero, eps, raw], f"{base}/Where")
        if per_token:  # a zero point per token, of the quantized type
            shape_of = self._op(t, "Shape", [scale], f"{base}/ScaleShape")
            zeros = self._unique(f"{base}/zeros")
            self._add(t, helper.make_node(
                "ConstantOfShape", [shape_of], [zeros], name=self._unique(f"{base}/ConstantOfShape"),
                value=numpy_helper.from_array(np.zeros(1, dtype=np.float32)),
            ))
            zp = self._op(t, "Cast", [zeros], f"{base}/ZeroPoint", to=qtype.onnx_type)
            attrs = {"axis": 0}
        else:
            zp = self._const_q(f"{t.name}.input_zero_point", torch.zeros((), dtype=qtype.torch_dtype), qtype)
            attrs = {}
        q = self._op(t, "QuantizeLinear", [x, scale, zp], f"{base}/QuantizeLinear", **attrs)
        dq = self._op(t, "DequantizeLinear", [q, scale, zp], f"{base}/DequantizeLinear", **attrs)
        if not per_token:
            return dq
        shape = self._op(t, "Shape", [t.activation], f"{base}/Shape")
        return self._op(t, "Reshape", [dq, shape], f"{base}/Restore")

    def _reduce_max(self, t: Target, x: str, axes: list[int] | None, name: str) -> str:
        if axes is None:
            return self._op(t, "ReduceMax", [x], name, keepdims=0)
        if self.opset >= 18:
            ax = self._const(f"{t.name}.input_reduce_axes", np.array(axes, dtype=np.int64))
            return self._op(t, "ReduceMax", [x, ax], name, keepdims=0)
        return self._op(t, "ReduceMax", [x], name, axes=axes, keepdims=0)

    # -- plumbing ----------------------------------------------------------------------------
    def _op(self, t: Target, op: str, inputs: list[str], name: str, **attrs) -> str:
        out = self._unique(name + "_output")
        self._add(t, helper.make_node(op, inputs, [out], name=self._unique(name), **attrs))
        return out

    def _add(self, t: Target, node: onnx.NodeProto) -> None:
        self.nodes_before.setdefault(t.node, []).append(node)

    def _const(self, name: str, array: np.ndarray) -> str:
        name = self._unique(name)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def _const_q(self, name: str, values: torch.Tensor, qtype: _QType) -> str:
        """An initializer of a quantized type (int8, or fp8 stored as raw bytes)."""
        name = self._unique(name)
        raw = values.contiguous().view(torch.uint8).numpy().tobytes()
        self.inits.append(helper.make_tensor(name, qtype.onnx_type, list(values.shape), raw, raw=True))
        return name

    def _unique(self, name: str) -> str:
        candidate, i = name, 1
        while candidate in self.names:
            candidate = f"{name}_{i}"
            i += 1
        self.names.add(candidate)
        return candidate

    def _value_type(self, name: str):
        for v in list(self.graph.value_info) + list(self.graph.input) + list(self.graph.output):
            if v.name == name:
                return v.type.tensor_type
        if not hasattr(self, "_inferred"):
            try:
                self._inferred = {v.name: v.type.tensor_type for v in onnx.shape_inference.infer_shapes(self.model).graph.value_info}
            except Exception:
                self._inferred = {}
        return self._inferred.get(name)

    def _act_dtype(self, t: Target) -> np.dtype:
        tt = self._value_type(t.activation)
        if tt is not None and tt.elem_type:
            return np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        return np.dtype(np.float32)

    def _act_rank(self, t: Target) -> int | None:
        if t.op_type == "Gemm":
            return 2
        tt = self._value_type(t.activation)
        if tt is not None and tt.HasField("shape"):
            return len(tt.shape.dim)
        return None

    def finish(self) -> None:
        new_nodes = []
        for node in self.graph.node:
            new_nodes.extend(self.nodes_before.get(node.name, []))
            new_nodes.append(node)
        del self.graph.node[:]
        self.graph.node.extend(new_nodes)
        self.graph.initializer.extend(self.inits)
        _drop_dead_weight_paths(self.graph, self.detached)


def _onnx_scale(scale: torch.Tensor, strategy: str, dtype) -> np.ndarray:
    """compressed-tensors scale -> ONNX scale: scalar for per-tensor, 1-D [out] for per-channel."""
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype if isinstance(dtype, torch.dtype) else np.dtype(dtype)
    array = scale.detach().to(torch.float32).numpy().astype(np_dtype)
    return array.reshape(()) if strategy == "tensor" else array.reshape(-1)


def _drop_dead_weight_paths(graph: onnx.GraphProto, detached: set[str]) -> None:
    """Remove weight-path nodes and initializers that nothing reads any more."""
    changed = True
    while changed:
        used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
        dead = [n for n in graph.node if all(o not in used for o in n.output) and set(n.output) & detached]
        for n in dead:
            detached.update(i for i in n.input if i)
            graph.node.remove(n)
        changed = bool(dead)
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output} | {i.name for i in graph.input}
    keep = [t for t in graph.initializer if t.name in used or t.name not in detached]
    if len(keep) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(keep)


def _upgrade_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    from onnx import version_converter

    try:
        upgraded = version_converter.convert_version(model, opset)
    except Exception as e:
        raise GraphcalError(
            f"the scheme needs opset {opset} but the model (opset {default_opset(model)}) could not be converted: "
            f"{str(e).strip().splitlines()[0]}; re-export the model at opset {opset}"
        ) from e
    upgraded.ir_version = min(max(upgraded.ir_version, _IR_FOR_OPSET.get(opset, MAX_ORT_IR)), MAX_ORT_IR)
    return upgraded
