"""Input activations Q/DQ'd in front of the target node, with calibrated or run-time scales.

The run-time subgraphs redo compressed-tensors' dynamic-scale math op for op::

    MatMul(x, .)  ->  MatMul(DequantizeLinear(QuantizeLinear(x, s, zp), s, zp), .)

- static tensor: calibrated scale (and zero point when asymmetric); one pair per activation
  and qparams, shared by q/k/v-style consumers (see :func:`input_key`);
- dynamic token / group / tensor_group ("local"): computed at run time over rows of width
  H (token) or G (group)::

      x -> Reshape[-1, W] -> scale = f(ReduceMax(Abs)) -> Q/DQ(axis=0) -> Reshape(Shape(x))

  with f = amax / half_range, 0 -> eps (compressed-tensors' symmetric rule); for NVFP4
  f = Cast_fp8(amax / 6 * global_scale) with 0 -> 0.125, divided by global_scale;
- dynamic tensor, and token on a 2-D input (compressed-tensors keeps dims 0 and 1, so
  nothing is left per token): per tensor;
- NVFP4 for TensorRT: TensorRT's ``trt::TRT_FP4DynamicQuantize``, as NVIDIA's exporter writes it.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
from onnx import helper, numpy_helper

from graphcal.arrays import to_numpy
from graphcal.errors import GraphcalError
from graphcal.graph.qdq.edits import Edits
from graphcal.graph.qdq.policy import FP8, InputForm, QType, TargetRuntime, qtype_of
from graphcal.types import QParams, Target
from graphcal.types import enum_value as _name

TRT_DOMAIN = "trt"  # TensorRT's custom ops (TRT_FP4DynamicQuantize)
FP8_SCALE_EPS = 0.125  # compressed-tensors' eps for fp8 scales (_get_dtype_eps)


def input_key(t: Target, args, qp: QParams | None) -> tuple:
    """Inputs with the same key share one Q/DQ: the same activation, args and qparams."""
    if args.dynamic is False:
        return (t.activation, "static", args.model_dump_json(), to_numpy(qp.scale).tobytes(),
                qp.zero_point.to(torch.float32).numpy().tobytes())
    gs = _global_scale(args, qp)
    return (t.activation, "dynamic", args.model_dump_json(), None if gs is None else to_numpy(gs).tobytes())


def input_dq(edits: Edits, t: Target, args, qp: QParams | None, target_runtime: TargetRuntime, form: InputForm = InputForm.QDQ
             ) -> tuple[str, str | None]:
    """Build the Q/DQ of the target's input: returns the tensor that replaces the node's A input,
    and for the row-normalized form the scale the node's output must be multiplied by."""
    qtype = qtype_of(args, t.name, "input activations")
    if form is InputForm.ROWNORM:
        return _row_normalized(edits, t, args, qtype)
    return _input_dq(edits, t, args, qp, target_runtime, qtype, form), None


def _input_dq(edits: Edits, t: Target, args, qp: QParams | None, target_runtime: TargetRuntime, qtype: QType, form: InputForm) -> str:
    if args.dynamic is False:
        if form is InputForm.CAST_MUL:
            return _static_cast_mul(edits, t, qp, qtype)
        return _static(edits, t, args, qp, qtype, unsigned=form is InputForm.UINT8)
    gs = _global_scale(args, qp)
    if gs is not None and target_runtime is TargetRuntime.TENSORRT:
        return _tensorrt_fp4(edits, t, args, gs)
    return _dynamic(edits, t, args, qtype, gs)


def _global_scale(args, qp: QParams | None) -> torch.Tensor | None:
    """The static global scale of dynamic tensor_group (NVFP4) activations."""
    return qp.global_scale if qp is not None and args.dynamic == "local" else None


def _static(edits: Edits, t: Target, args, qp: QParams, qtype: QType, unsigned: bool = False) -> str:
    """A calibrated scale and zero point. ``unsigned``: int8 written as uint8 with the zero point
    moved by 128, the same numbers (clamp [-128, 127] + 128 is clamp [0, 255]); onnxruntime fuses a
    uint8 input Q/DQ into MatMulIntegerToFloat even when q/k/v share it (its int8 -> uint8 rewrite
    takes a Q with a single DQ only)."""
    dtype = edits.dtype_of(t.activation)
    s = edits.const(f"{t.name}.input_scale", qp.scale.detach().to(torch.float32).numpy().astype(dtype).reshape(()))
    zp = qtype.array(qp.zero_point if not args.symmetric else torch.zeros(())).reshape(())
    if unsigned:
        zp = (zp.astype(np.int16) + UINT8_SHIFT).astype(np.uint8)
    z = edits.const(f"{t.name}.input_zero_point", zp)
    return edits.qdq(t.node, t.activation, s, z, f"{t.name}/input")


UINT8_SHIFT = 128


def _static_cast_mul(edits: Edits, t: Target, qp: QParams, qtype: QType) -> str:
    """Static symmetric fp8 by plain ops, the values QuantizeLinear/DequantizeLinear give::

        Div(x, s) -> Cast(fp8, saturate) -> Cast(float) -> Mul(s)

    (QuantizeLinear to fp8 is exactly a saturating, round-to-nearest-even cast of x / s)."""
    dtype = edits.dtype_of(t.activation)
    s = edits.const(f"{t.name}.input_scale", qp.scale.detach().to(torch.float32).numpy().astype(dtype).reshape(()))
    return fp8_rounded(edits, t.node, t.activation, s, dtype, f"{t.name}/input")


def fp8_rounded(edits: Edits, anchor: str, x: str, scale: str, dtype: np.dtype, label: str) -> str:
    """``x`` quantized to fp8 and back with a constant ``scale`` (zero point 0), by plain ops:
    Div -> Cast(fp8, saturate) -> Cast(float) -> Mul. The values of QuantizeLinear ->
    DequantizeLinear, with no Q/DQ pair for onnxruntime's fusions to move or mis-fuse."""
    x = edits.op(anchor, "Div", [x, scale], f"{label}/Div")
    x = edits.op(anchor, "Cast", [x], f"{label}/CastFp8", to=FP8.onnx_type, saturate=1)
    x = edits.op(anchor, "Cast", [x], f"{label}/Cast", to=helper.np_dtype_to_tensor_dtype(dtype))
    return edits.op(anchor, "Mul", [x, scale], f"{label}/Mul")


def _row_normalized(edits: Edits, t: Target, args, qtype: QType) -> tuple[str, str]:
    """Dynamic per-token (or per-tensor) symmetric int8 in the form onnxruntime runs as
    MatMulIntegerToFloat::

        s = where(amax == 0, eps, amax / 127.5)     (amax = ReduceMax(Abs(x)) per row, or whole)
        MatMul(x, W) -> MatMul(DQ(Q(x / s, 1, u8 128)), W) * s

    Q(x / s, 1) rounds x / s exactly as compressed-tensors' quantize does, so the integers are
    compressed-tensors' own; the scale moves after the integer product (the caller multiplies the
    node's output by the returned ``s``). Returns (input replacement, scale)."""
    dtype = edits.dtype_of(t.activation)
    base = f"{t.name}/input"
    x = t.activation
    absx = edits.op(t.node, "Abs", [x], f"{base}/Abs")
    per_row = (_rank(edits, t) or 3) >= 3 and _name(args.strategy) == "token"
    if per_row:
        amax = _reduce_max(edits, t, absx, [-1], f"{base}/ReduceMax", keepdims=1)
    else:
        amax = _reduce_max(edits, t, absx, None, f"{base}/ReduceMax")
    scale = _symmetric_scale(edits, t, amax, qtype, dtype, base)
    rows = edits.op(t.node, "Div", [x, scale], f"{base}/Normalize")
    one = edits.const(f"{t.name}.input_unit_scale", np.array(1, dtype=dtype))
    z = edits.const(f"{t.name}.input_zero_point", np.array(UINT8_SHIFT, dtype=np.uint8))
    return edits.qdq(t.node, rows, one, z, f"{t.name}/input"), scale


def _dynamic(edits: Edits, t: Target, args, qtype: QType, global_scale: torch.Tensor | None) -> str:
    """Run-time scales over rows of width H (token) or G (group), or over the whole tensor."""
    dtype = edits.dtype_of(t.activation)
    strategy = _name(args.strategy)
    width = None
    if strategy == "token" and (_rank(edits, t) or 3) >= 3:
        width = t.in_features
    elif strategy in ("group", "tensor_group"):
        width = args.group_size
        if t.in_features % width:
            raise GraphcalError(f"{t.name}: group size {width} does not divide the input's {t.in_features} "
                                "features; choose a group size that does, or ignore this layer")
    base = f"{t.name}/input"
    x = t.activation
    if width is not None:
        shape2d = edits.const(f"{t.name}.input_rows_shape", np.array([-1, width], dtype=np.int64))
        x = edits.op(t.node, "Reshape", [x, shape2d], f"{base}/Reshape")
    absx = edits.op(t.node, "Abs", [x], f"{base}/Abs")
    amax = _reduce_max(edits, t, absx, [1] if width is not None else None, f"{base}/ReduceMax")
    scale = _symmetric_scale(edits, t, amax, qtype, dtype, base, global_scale)
    if width is not None:  # one zero point per row, of the quantized type
        zp = _row_zero_points(edits, t, scale, qtype, base)
        attrs = {"axis": 0}
    else:
        zp = edits.const(f"{t.name}.input_zero_point", np.zeros((), dtype=qtype.np_dtype))
        attrs = {}
    q = edits.op(t.node, "QuantizeLinear", [x, scale, zp], f"{base}/QuantizeLinear", **attrs)
    dq = edits.op(t.node, "DequantizeLinear", [q, scale, zp], f"{base}/DequantizeLinear", **attrs)
    if width is None:
        return dq
    shape = edits.op(t.node, "Shape", [t.activation], f"{base}/Shape")
    return edits.op(t.node, "Reshape", [dq, shape], f"{base}/Restore")


def _symmetric_scale(edits: Edits, t: Target, amax: str, qtype: QType, dtype: np.dtype, base: str,
                     global_scale: torch.Tensor | None = None) -> str:
    """compressed-tensors' symmetric run-time scale from ``amax``: amax / half_range, 0 -> eps;
    with NVFP4's ``global_scale``: fp8(amax / 6 * global_scale), 0 -> 0.125, divided by global_scale."""
    half_range = edits.const(f"{t.name}.input_half_range", np.array(qtype.half_range, dtype=dtype))
    raw = edits.op(t.node, "Div", [amax, half_range], f"{base}/Div")
    zero = edits.const(f"{t.name}.input_zero", np.array(0, dtype=dtype))
    if global_scale is not None:  # NVFP4: local scales times the global one, rounded to fp8, then divided back
        gs = edits.const(f"{t.name}.input_global_scale", global_scale.detach().to(torch.float32).numpy().astype(dtype).reshape(()))
        raw = edits.op(t.node, "Mul", [raw, gs], f"{base}/MulGlobal")
        hi = edits.const(f"{t.name}.input_fp8_max", np.array(FP8.half_range, dtype=dtype))
        lo = edits.const(f"{t.name}.input_fp8_min", np.array(-FP8.half_range, dtype=dtype))
        raw = edits.op(t.node, "Clip", [raw, lo, hi], f"{base}/ClipFp8")
        raw = edits.op(t.node, "Cast", [raw], f"{base}/CastFp8", to=FP8.onnx_type)
        raw = edits.op(t.node, "Cast", [raw], f"{base}/CastBack", to=helper.np_dtype_to_tensor_dtype(dtype))
        eps = edits.const(f"{t.name}.input_eps", np.array(FP8_SCALE_EPS, dtype=dtype))
        is_zero = edits.op(t.node, "Equal", [raw, zero], f"{base}/Equal")
        stored = edits.op(t.node, "Where", [is_zero, eps, raw], f"{base}/Where")
        scale = edits.op(t.node, "Div", [stored, gs], f"{base}/DivGlobal")
    else:
        eps = edits.const(f"{t.name}.input_eps", np.array(ml_dtypes.finfo(dtype).eps, dtype=dtype))
        is_zero = edits.op(t.node, "Equal", [raw, zero], f"{base}/Equal")
        scale = edits.op(t.node, "Where", [is_zero, eps, raw], f"{base}/Where")
    return scale


def _tensorrt_fp4(edits: Edits, t: Target, args, global_scale: torch.Tensor) -> str:
    """NVFP4 activations as TensorRT builds them (NVIDIA's exporter form)::

        x -> trt::TRT_FP4DynamicQuantize(x, 1/global_scale; axis=-1, block_size=16, scale_type=fp8)
          -> (x fp4, block scales fp8) -> DequantizeLinear(scales, 1/global_scale)
          -> DequantizeLinear(x fp4, ., axis=-1, block_size=16)

    TensorRT computes the block scales at run time as compressed-tensors does:
    fp8(amax / 6 * global_scale), each applied divided by global_scale.
    """
    dtype = edits.dtype_of(t.activation)
    base = f"{t.name}/input"
    inv = edits.const(f"{t.name}.input_global_scale_inverse",
                      (1.0 / global_scale.detach().to(torch.float64)).to(torch.float32).numpy().astype(dtype).reshape(()))
    xq, sq = edits.unique(f"{base}/fp4"), edits.unique(f"{base}/fp4_scales")
    edits.add(t.node, helper.make_node(
        "TRT_FP4DynamicQuantize", [t.activation, inv], [xq, sq], name=edits.unique(f"{base}/TRT_FP4DynamicQuantize"),
        domain=TRT_DOMAIN, axis=-1, block_size=args.group_size, scale_type=FP8.onnx_type,
    ))
    edits.domains.add(TRT_DOMAIN)
    scales = edits.op(t.node, "DequantizeLinear", [sq, inv], f"{base}/ScaleDequantizeLinear")
    return edits.op(t.node, "DequantizeLinear", [xq, scales], f"{base}/DequantizeLinear", axis=-1, block_size=args.group_size)


def _row_zero_points(edits: Edits, t: Target, scale: str, qtype: QType, base: str) -> str:
    shape_of = edits.op(t.node, "Shape", [scale], f"{base}/ScaleShape")
    zeros = edits.unique(f"{base}/zeros")
    edits.add(t.node, helper.make_node(
        "ConstantOfShape", [shape_of], [zeros], name=edits.unique(f"{base}/ConstantOfShape"),
        value=numpy_helper.from_array(np.zeros(1, dtype=np.float32)),
    ))
    return edits.op(t.node, "Cast", [zeros], f"{base}/ZeroPoint", to=qtype.onnx_type)


def _reduce_max(edits: Edits, t: Target, x: str, axes: list[int] | None, name: str, keepdims: int = 0) -> str:
    if axes is None:
        return edits.op(t.node, "ReduceMax", [x], name, keepdims=0)
    if edits.opset >= 18:
        ax = edits.const(f"{t.name}.input_reduce_axes", np.array(axes, dtype=np.int64))
        return edits.op(t.node, "ReduceMax", [x, ax], name, keepdims=keepdims)
    return edits.op(t.node, "ReduceMax", [x], name, axes=axes, keepdims=keepdims)


def _rank(edits: Edits, t: Target) -> int | None:
    """The input's rank: 2 for Gemm, else as the graph declares it (None when unknown)."""
    return 2 if t.op_type == "Gemm" else edits.rank_of(t.activation)
