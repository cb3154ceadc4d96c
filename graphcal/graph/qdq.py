"""Write Q/DQ into a copy of the model from calibrated qparams (compressed-tensors conventions).

Every number follows compressed-tensors: weights are quantized with its own ``quantize`` and the
stored tensor is exactly what it computes; activation subgraphs redo its dynamic-scale math op
for op. Forms written (before -> after):

Weights (stored quantized; any Transpose/Cast/Reshape path is folded in and removed)::

    MatMul(x, W[in, out])  ->  MatMul(x, DequantizeLinear(Wq[in, out], scale, zero_point?, axis, block_size?))

- tensor: scalar scale; channel: scale [out], per-axis (opset 13);
- group / tensor_group: scale [in/G, out], blocked along ``in`` (opset 21);
- block [bh, bw]: the block scales expanded per output row, scale [in/bw, out], blocked along ``in``
  (ONNX blocks along one axis only; the expansion is exact and costs 1/bw of the weight in scales);
- tensor_group with fp8 scales (NVFP4): a two-level chain, as NVIDIA's exporter writes it::

      DequantizeLinear(Wq fp4, DequantizeLinear(scale fp8, 1/global_scale), axis, block_size=16)  (opset 23)

- MX (fp4 with uint8 exponent scales, group 32): scales stored as float8e8m0 (opset 24).

Gemm with transB=1 keeps ``[out, in]`` (axis 0 per channel, axis 1 for blocks). int4 and fp4 are
packed two per byte; zero points are written only for asymmetric schemes.

Activations::

    MatMul(x, .)  ->  MatMul(DequantizeLinear(QuantizeLinear(x, s, zp), s, zp), .)

- static tensor: calibrated scale (and zero point when asymmetric); one pair per activation
  and qparams, shared by q/k/v-style consumers;
- dynamic token / group / tensor_group ("local"): computed at run time over rows of width
  H (token) or G (group)::

      x -> Reshape[-1, W] -> scale = f(ReduceMax(Abs)) -> Q/DQ(axis=0) -> Reshape(Shape(x))

  with f = amax / half_range, 0 -> eps (compressed-tensors' symmetric rule); for NVFP4
  f = Cast_fp8(amax / 6 * global_scale) with 0 -> 0.125, divided by global_scale;
- dynamic tensor, and token on a 2-D input (compressed-tensors keeps dims 0 and 1, so
  nothing is left per token): per tensor.

The opset is raised only as far as the scheme needs (onnx's version converter), and the IR
version to the lowest onnx pairs with that opset, within what onnxruntime loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from graphcal.errors import GraphcalError
from graphcal.graph.io import MAX_ORT_IR, default_opset
from graphcal.graph.targets import torch_weight
from graphcal.types import QParams, QuantizedKV, QuantizedTarget, Target
from graphcal.types import enum_value as _name


RUNTIMES = ("onnxruntime", "tensorrt")


def emit_qdq(model: onnx.ModelProto, items: list[QuantizedTarget], runtime: str = "onnxruntime",
             kv_items: list[QuantizedKV] = ()) -> onnx.ModelProto:
    """A new model with every item's weight stored quantized and its activations Q/DQ'd, in the
    forms ``runtime`` builds ("onnxruntime": standard ONNX; "tensorrt": what TensorRT takes);
    ``kv_items`` get static Q/DQ on the key/value states entering attention. ``model`` is not
    modified (see :class:`QDQWriter` to write in place, one weight at a time)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    writer = QDQWriter(copy, items_opset(items, kv_items, runtime), runtime)
    for item in items:
        writer.quantize_weight(item)
    for item in items:
        writer.quantize_input(item)
    for kv in kv_items:
        writer.quantize_kv(kv)
    return writer.finish()


def items_opset(items: list[QuantizedTarget], kv_items: list[QuantizedKV] = (), runtime: str = "onnxruntime") -> int:
    """The opset a model with these targets needs (never below 13)."""
    return max([required_opset(item, runtime) for item in items]
               + [required_kv_opset(kv.args, runtime) for kv in kv_items] + [13])


def required_opset(item: QuantizedTarget, runtime: str = "onnxruntime") -> int:
    """The lowest opset that expresses this target's scheme; raises for what has no ONNX form here,
    or, for ``runtime="tensorrt"``, for what TensorRT does not build."""
    scheme = item.scheme
    where = item.target.name
    if runtime not in RUNTIMES:
        raise GraphcalError(f"unknown target runtime {runtime!r}; choose one of: {', '.join(RUNTIMES)}")
    if scheme.output_activations is not None:
        raise GraphcalError(f"{where}: output_activations are not written to ONNX (quantize the next layer's input instead)")
    if scheme.weights is None:
        raise GraphcalError(f"{where}: the scheme has no weights entry; graphcal writes weight-quantized MatMul/Gemm only")
    opsets = [_weight_opset(scheme.weights, where)]
    if scheme.input_activations is not None:
        opsets.append(_input_opset(scheme.input_activations, where))
    if runtime == "tensorrt":
        problem = tensorrt_problem(scheme)
        if problem:
            raise GraphcalError(f"{where}: --target tensorrt: {problem}")
    return max(opsets)


def required_kv_opset(args, runtime: str = "onnxruntime") -> int:
    """The opset for static Q/DQ on key/value states (per tensor, or per kv head on axis 1)."""
    qtype = _qtype(args, "kv-cache scheme", "key/value states")
    if args.dynamic is not False or _name(args.strategy) not in ("tensor", "attn_head"):
        raise GraphcalError("kv-cache scheme: key/value states are written as static tensor or attn_head Q/DQ only")
    if qtype.opset > 19 and _name(args.type) == "float":
        raise GraphcalError("kv-cache scheme: fp4 key/value states have no ONNX form here; use fp8 or int8")
    if runtime == "tensorrt" and (not args.symmetric or _name(args.strategy) != "tensor" or args.num_bits != 8):
        raise GraphcalError("kv-cache scheme: --target tensorrt: TensorRT takes int8/fp8 key/value states "
                            "per tensor, symmetric")
    return qtype.opset


def runtime_notes(items: list[QuantizedTarget], runtime: str) -> list[str]:
    """Warnings about what the chosen runtime can execute of the written model."""
    fp4 = sorted({_name(i.scheme.weights.type) + "4" for i in items
                  if i.scheme.weights is not None and i.scheme.weights.num_bits == 4 and _name(i.scheme.weights.type) == "float"})
    if runtime == "onnxruntime" and fp4:
        return ["onnxruntime 1.31 has no float4 (or e8m0) Q/DQ kernels: the written model is standard ONNX "
                "(opset 23+, checked with onnx.reference) for runtimes that have them; for TensorRT use --target tensorrt"]
    return []


def tensorrt_problem(scheme) -> str | None:
    """Why TensorRT (10.x explicit quantization) cannot build this scheme, or None when it can.

    TensorRT takes symmetric quantization only; int8/fp8 weights per tensor or per channel with
    static per-tensor activations; int4 weight-only in blocks of 64 or 128; fp4 as NVFP4 (groups
    of 16 with fp8 scales and a global scale), activations dynamic per block of 16.
    """
    w, a = scheme.weights, scheme.input_activations
    if any(args is not None and not args.symmetric for args in (w, a)):
        return "TensorRT takes symmetric quantization only (zero points must be 0); use a symmetric scheme"
    kind = (_name(w.type), w.num_bits)
    if kind in (("int", 8), ("float", 8)) and _name(w.strategy) not in ("tensor", "channel"):
        return f"TensorRT takes int8/fp8 weights per tensor or per channel, not per {_name(w.strategy)}"
    if kind == ("int", 4):
        if _name(w.strategy) != "group" or w.group_size not in (64, 128):
            return "TensorRT takes int4 weights in blocks of 64 or 128 (strategy group)"
        if a is not None:
            return "TensorRT takes int4 as weight-only quantization; drop the input activations (W4A16)"
    if kind == ("float", 4):
        if is_mx(w) or _name(w.strategy) != "tensor_group" or w.group_size != 16 or not _fp8_scales(w):
            return "TensorRT takes fp4 as NVFP4 only (tensor_group, groups of 16, fp8 scales)"
    if a is not None:
        akind = (_name(a.type), a.num_bits)
        if akind == ("float", 4):
            if not (a.dynamic == "local" and _name(a.strategy) == "tensor_group" and a.group_size == 16):
                return "TensorRT takes fp4 activations as NVFP4, dynamic per block of 16"
        elif a.dynamic is not False or _name(a.strategy) != "tensor":
            return ("TensorRT takes int8/fp8 activations per tensor with a static scale, not "
                    f"{'dynamic ' if a.dynamic else ''}{_name(a.strategy)}; use W8A8_STATIC or FP8")
    return None


@dataclass(frozen=True)
class _QType:
    """How one compressed-tensors type is stored in ONNX."""

    onnx_type: int
    np_dtype: np.dtype  # numpy / ml_dtypes type that onnx.numpy_helper packs
    half_range: float  # compressed-tensors' symmetric divisor: (qmax - qmin) / 2
    opset: int  # lowest opset whose Q/DQ take this type


_QTYPES = {
    ("int", 8): _QType(TensorProto.INT8, np.dtype(np.int8), 127.5, 13),
    ("int", 4): _QType(TensorProto.INT4, np.dtype(ml_dtypes.int4), 7.5, 21),
    ("float", 8): _QType(TensorProto.FLOAT8E4M3FN, np.dtype(ml_dtypes.float8_e4m3fn), 448.0, 19),
    ("float", 4): _QType(TensorProto.FLOAT4E2M1, np.dtype(ml_dtypes.float4_e2m1fn), 6.0, 23),
}
_FP8 = _QTYPES["float", 8]
_BLOCKED_OPSET = 21  # block_size on Q/DQ
_E8M0_OPSET = 24  # float8e8m0 scales
TRT_DOMAIN = "trt"  # TensorRT's custom ops (TRT_FP4DynamicQuantize)
FP8_SCALE_EPS = 0.125  # compressed-tensors' eps for fp8 scales (_get_dtype_eps)
SUPPORTED = "int4/int8 (sym or asym), fp8 e4m3, fp4 e2m1"


def _qtype(args, where: str, what: str) -> _QType:
    qtype = _QTYPES.get((_name(args.type), args.num_bits))
    if qtype is None:
        raise GraphcalError(f"{where}: {what} {_name(args.type)}{args.num_bits} has no ONNX Q/DQ form here (supported: {SUPPORTED})")
    if not args.symmetric and _name(args.type) == "float":
        raise GraphcalError(f"{where}: {what} asymmetric float quantization has no ONNX form (float Q/DQ zero points must be 0)")
    return qtype


def is_mx(args) -> bool:
    """MX formats: float elements, groups of 32, power-of-two scales kept as uint8 exponents."""
    from compressed_tensors.quantization.utils import should_generate_mx_scales

    return should_generate_mx_scales(args)


def _fp8_scales(args) -> bool:
    return args.scale_dtype == torch.float8_e4m3fn


def _weight_opset(args, where: str) -> int:
    qtype = _qtype(args, where, "weights")
    strategy = _name(args.strategy)
    if strategy in ("tensor", "channel"):
        return qtype.opset
    if strategy == "group":
        return max(qtype.opset, _E8M0_OPSET if is_mx(args) else _BLOCKED_OPSET)
    if strategy in ("block", "tensor_group"):
        return max(qtype.opset, _BLOCKED_OPSET)
    raise GraphcalError(f"{where}: weights with strategy {strategy} have no ONNX form (use tensor, channel, group, "
                        "tensor_group or block)")


def _input_opset(args, where: str) -> int:
    qtype = _qtype(args, where, "input activations")
    strategy, dynamic = _name(args.strategy), args.dynamic
    if dynamic is False:
        if strategy == "tensor":
            return qtype.opset
        raise GraphcalError(f"{where}: static input activations with strategy {strategy} are not written to ONNX "
                            "(static activations are per tensor; use dynamic token or group)")
    if not args.symmetric:
        raise GraphcalError(f"{where}: dynamic asymmetric input activations are not written to ONNX yet (use symmetric)")
    if dynamic is True and strategy in ("token", "tensor", "group"):
        if is_mx(args):
            raise GraphcalError(f"{where}: dynamic MX activations (run-time e8m0 scales) are not written to ONNX yet; "
                                "use MXFP4A16")
        return qtype.opset
    if dynamic == "local" and strategy == "tensor_group" and _fp8_scales(args):
        return qtype.opset
    raise GraphcalError(f"{where}: dynamic={dynamic} input activations with strategy {strategy} are not written to ONNX")


class QDQWriter:
    """Writes Q/DQ into ``model`` in place: weights one at a time (so a caller can read each
    weight once, observe it, quantize it and let it go), then activations, then ``finish()``.
    A model below ``opset`` is converted first (``self.model`` is then the converted copy)."""

    def __init__(self, model: onnx.ModelProto, opset: int, runtime: str = "onnxruntime", types: dict | None = None,
                 base_dir: str | None = None):
        from graphcal.graph.io import value_types

        self.types = value_types(model) if types is None else types  # activation dtypes and ranks
        if default_opset(model) < opset:
            model = _upgrade_opset(model, opset)
        self.model = model
        self.runtime = runtime
        self.base_dir = base_dir  # folder of the model's external data, for weights not yet read
        self.graph = model.graph
        self.opset = default_opset(model)
        self.nodes_before: dict[str, list[onnx.NodeProto]] = {}  # target node name -> nodes to insert before it
        self.inits: list[onnx.TensorProto] = []
        self.shared: dict[tuple, str] = {}  # (activation, qparams key) -> dequantized tensor name
        self.detached: set[str] = set()  # weight-path node outputs / initializers that may be dead now
        self.names = {n.name for n in self.graph.node} | {t.name for t in self.graph.initializer}
        self.node_by_name = {n.name: n for n in self.graph.node}
        self.custom_domains: set[str] = set()

    # -- weights -----------------------------------------------------------------------------
    def quantize_weight(self, item: QuantizedTarget, weight: torch.Tensor | None = None) -> None:
        """Store the item's weight quantized behind DequantizeLinear; ``weight`` is its torch
        [out, in] value when the caller has read it already."""
        from compressed_tensors.quantization.lifecycle.forward import quantize

        t, args = item.target, item.scheme.weights
        qtype = _qtype(args, t.name, "weights")
        qp = item.qparams["weight"]
        w = weight if weight is not None else torch.from_numpy(torch_weight(self.model, t, self.base_dir))  # [out, in]
        strategy = _name(args.strategy)
        q = quantize(w, qp.scale.to(w.dtype), qp.zero_point, args, global_scale=qp.global_scale)
        # TensorRT's NVFP4 weights are blocked along the last axis of [out, in] (NVIDIA's exporter
        # form); a MatMul then reads them through a Transpose.
        transpose = self.runtime == "tensorrt" and qtype is _QTYPES["float", 4] and t.layout == "in_out"
        layout = _WeightLayout(t, strategy, args, "out_in" if transpose else t.layout)
        stored = self._const(f"{t.name}.weight_quantized", layout.weight(_as_qtype(q, qtype)))
        scale = self._weight_scale(t, args, qp, w.dtype, layout)
        inputs = [stored, scale]
        if not args.symmetric:
            inputs.append(self._const(f"{t.name}.weight_zero_point", layout.param(_as_qtype(qp.zero_point, qtype))))
        attrs = layout.attrs()
        if is_mx(args):
            attrs["output_dtype"] = helper.np_dtype_to_tensor_dtype(_np_dtype(w.dtype))
        dq_out = self._unique(f"{t.name}.weight_dequantized")
        self._add(t, helper.make_node(
            "DequantizeLinear", inputs, [dq_out], name=self._unique(f"{t.name}/weight/DequantizeLinear"), **attrs
        ))
        if transpose:
            dq_out = self._op(t, "Transpose", [dq_out], f"{t.name}/weight/Transpose", perm=[1, 0])
        node = self.node_by_name[t.node]
        old = node.input[1]
        node.input[1] = dq_out
        self.detached.add(old)
        self.detached.add(t.weight)

    def _weight_scale(self, t: Target, args, qp: QParams, dtype: torch.dtype, layout: _WeightLayout) -> str:
        """The DQ scale input: a constant, or for fp8-scaled tensor groups the DQ(fp8 scale, 1/global) chain."""
        scale = qp.scale.detach().to(torch.float32)
        if is_mx(args):  # powers of two, stored as e8m0 exponents
            return self._const(f"{t.name}.weight_scale", layout.param(scale.numpy().astype(ml_dtypes.float8_e8m0fnu)))
        if qp.global_scale is not None and _fp8_scales(args):
            fp8 = self._const(f"{t.name}.weight_scale", layout.param(scale.numpy().astype(_FP8.np_dtype)))
            inv = (1.0 / qp.global_scale.detach().to(torch.float64)).to(dtype).reshape(())
            inv_name = self._const(f"{t.name}.weight_global_scale_inverse", inv.numpy())
            out = self._unique(f"{t.name}.weight_scale_dequantized")
            self._add(t, helper.make_node("DequantizeLinear", [fp8, inv_name], [out],
                                          name=self._unique(f"{t.name}/weight_scale/DequantizeLinear")))
            return out
        if qp.global_scale is not None:  # effective scale as compressed-tensors computes it: scale / global_scale
            scale = scale / qp.global_scale.detach().to(torch.float32)
        return self._const(f"{t.name}.weight_scale", layout.param(scale.to(dtype).numpy()))

    # -- activations -------------------------------------------------------------------------
    def quantize_input(self, item: QuantizedTarget) -> None:
        args = item.scheme.input_activations
        if args is None:
            return
        t = item.target
        qtype = _qtype(args, t.name, "input activations")
        qp = item.qparams.get("input")
        if args.dynamic is False:
            key = (t.activation, "static", args.model_dump_json(), qp.scale.numpy().tobytes(),
                   qp.zero_point.to(torch.float32).numpy().tobytes())
            if key not in self.shared:
                self.shared[key] = self._static(t, args, qp, qtype)
        else:
            gs = qp.global_scale if qp is not None and args.dynamic == "local" else None
            key = (t.activation, "dynamic", args.model_dump_json(), None if gs is None else gs.numpy().tobytes())
            if key not in self.shared:
                if gs is not None and self.runtime == "tensorrt":
                    self.shared[key] = self._tensorrt_fp4(t, args, gs)
                else:
                    self.shared[key] = self._dynamic(t, args, qtype, gs)
        self.node_by_name[t.node].input[0] = self.shared[key]

    def _static(self, t: Target, args, qp: QParams, qtype: _QType) -> str:
        dtype = self._act_dtype(t)
        s = self._const(f"{t.name}.input_scale", qp.scale.detach().to(torch.float32).numpy().astype(dtype).reshape(()))
        zp = qp.zero_point if not args.symmetric else torch.zeros(())
        z = self._const(f"{t.name}.input_zero_point", _as_qtype(zp, qtype).reshape(()))
        return self._qdq_pair(t.node, t.activation, s, z, f"{t.name}/input")

    def _qdq_pair(self, anchor: str, x: str, s: str, z: str, label: str, **attrs) -> str:
        """QuantizeLinear -> DequantizeLinear of ``x`` with constant scale/zero point, placed before
        node ``anchor``; returns the dequantized tensor's name."""
        q = self._unique(f"{x}_quantized")
        dq = self._unique(f"{x}_dequantized")
        self.nodes_before.setdefault(anchor, []).extend([
            helper.make_node("QuantizeLinear", [x, s, z], [q], name=self._unique(f"{label}/QuantizeLinear"), **attrs),
            helper.make_node("DequantizeLinear", [q, s, z], [dq], name=self._unique(f"{label}/DequantizeLinear"), **attrs),
        ])
        return dq

    def _dynamic(self, t: Target, args, qtype: _QType, global_scale: torch.Tensor | None) -> str:
        """Run-time scales over rows of width H (token) or G (group), or over the whole tensor."""
        dtype = self._act_dtype(t)
        strategy = _name(args.strategy)
        width = None
        if strategy == "token" and (self._act_rank(t) or 3) >= 3:
            width = t.in_features
        elif strategy in ("group", "tensor_group"):
            width = args.group_size
            if t.in_features % width:
                raise GraphcalError(f"{t.name}: group size {width} does not divide the input's {t.in_features} "
                                    "features; choose a group size that does, or ignore this layer")
        base = f"{t.name}/input"
        x = t.activation
        if width is not None:
            shape2d = self._const(f"{t.name}.input_rows_shape", np.array([-1, width], dtype=np.int64))
            x = self._op(t, "Reshape", [x, shape2d], f"{base}/Reshape")
        absx = self._op(t, "Abs", [x], f"{base}/Abs")
        amax = self._reduce_max(t, absx, [1] if width is not None else None, f"{base}/ReduceMax")
        half_range = self._const(f"{t.name}.input_half_range", np.array(qtype.half_range, dtype=dtype))
        raw = self._op(t, "Div", [amax, half_range], f"{base}/Div")
        zero = self._const(f"{t.name}.input_zero", np.array(0, dtype=dtype))
        if global_scale is not None:  # NVFP4: local scales times the global one, rounded to fp8, then divided back
            gs = self._const(f"{t.name}.input_global_scale", global_scale.detach().to(torch.float32).numpy().astype(dtype).reshape(()))
            raw = self._op(t, "Mul", [raw, gs], f"{base}/MulGlobal")
            hi = self._const(f"{t.name}.input_fp8_max", np.array(_FP8.half_range, dtype=dtype))
            lo = self._const(f"{t.name}.input_fp8_min", np.array(-_FP8.half_range, dtype=dtype))
            raw = self._op(t, "Clip", [raw, lo, hi], f"{base}/ClipFp8")
            raw = self._op(t, "Cast", [raw], f"{base}/CastFp8", to=_FP8.onnx_type)
            raw = self._op(t, "Cast", [raw], f"{base}/CastBack", to=helper.np_dtype_to_tensor_dtype(dtype))
            eps = self._const(f"{t.name}.input_eps", np.array(FP8_SCALE_EPS, dtype=dtype))
            is_zero = self._op(t, "Equal", [raw, zero], f"{base}/Equal")
            stored = self._op(t, "Where", [is_zero, eps, raw], f"{base}/Where")
            scale = self._op(t, "Div", [stored, gs], f"{base}/DivGlobal")
        else:
            eps = self._const(f"{t.name}.input_eps", np.array(np.finfo(dtype).eps, dtype=dtype))
            is_zero = self._op(t, "Equal", [raw, zero], f"{base}/Equal")
            scale = self._op(t, "Where", [is_zero, eps, raw], f"{base}/Where")
        if width is not None:  # one zero point per row, of the quantized type
            zp = self._row_zero_points(t, scale, qtype, base)
            attrs = {"axis": 0}
        else:
            zp = self._const(f"{t.name}.input_zero_point", np.zeros((), dtype=qtype.np_dtype))
            attrs = {}
        q = self._op(t, "QuantizeLinear", [x, scale, zp], f"{base}/QuantizeLinear", **attrs)
        dq = self._op(t, "DequantizeLinear", [q, scale, zp], f"{base}/DequantizeLinear", **attrs)
        if width is None:
            return dq
        shape = self._op(t, "Shape", [t.activation], f"{base}/Shape")
        return self._op(t, "Reshape", [dq, shape], f"{base}/Restore")

    def _tensorrt_fp4(self, t: Target, args, global_scale: torch.Tensor) -> str:
        """NVFP4 activations as TensorRT builds them (NVIDIA's exporter form)::

            x -> trt::TRT_FP4DynamicQuantize(x, 1/global_scale; axis=-1, block_size=16, scale_type=fp8)
              -> (x fp4, block scales fp8) -> DequantizeLinear(scales, 1/global_scale)
              -> DequantizeLinear(x fp4, ., axis=-1, block_size=16)

        TensorRT computes the block scales at run time as compressed-tensors does:
        fp8(amax / 6 * global_scale), each applied divided by global_scale.
        """
        dtype = self._act_dtype(t)
        base = f"{t.name}/input"
        inv = self._const(f"{t.name}.input_global_scale_inverse",
                          (1.0 / global_scale.detach().to(torch.float64)).to(torch.float32).numpy().astype(dtype).reshape(()))
        xq, sq = self._unique(f"{base}/fp4"), self._unique(f"{base}/fp4_scales")
        self._add(t, helper.make_node(
            "TRT_FP4DynamicQuantize", [t.activation, inv], [xq, sq], name=self._unique(f"{base}/TRT_FP4DynamicQuantize"),
            domain=TRT_DOMAIN, axis=-1, block_size=args.group_size, scale_type=_FP8.onnx_type,
        ))
        self.custom_domains.add(TRT_DOMAIN)
        scales = self._op(t, "DequantizeLinear", [sq, inv], f"{base}/ScaleDequantizeLinear")
        return self._op(t, "DequantizeLinear", [xq, scales], f"{base}/DequantizeLinear", axis=-1, block_size=args.group_size)

    def quantize_kv(self, kv: QuantizedKV) -> None:
        """Static Q/DQ on the key and value states, as compressed-tensors fake-quantizes them at the cache."""
        per_head = _name(kv.args.strategy) == "attn_head"
        qtype = _qtype(kv.args, kv.state.name, "key/value states")
        for base, tensor in (("k", kv.state.key), ("v", kv.state.value)):
            consumers = [n for n in self.graph.node if tensor in n.input]
            if not consumers:
                continue
            qp = kv.qparams[base]
            scale = qp.scale.detach().to(torch.float32).numpy().astype(self._dtype_of(tensor))
            scale = scale.reshape(-1) if per_head else scale.reshape(())
            zp = qp.zero_point if not kv.args.symmetric else torch.zeros(scale.shape)
            first = consumers[0].name
            if not first:
                raise GraphcalError(f"{kv.state.name}: the node reading {tensor!r} has no name; cannot place its Q/DQ")
            s = self._const(f"{kv.state.name}.{base}_scale", scale)
            z = self._const(f"{kv.state.name}.{base}_zero_point", _as_qtype(zp, qtype).reshape(scale.shape))
            attrs = {"axis": 1} if per_head else {}
            dq = self._qdq_pair(first, tensor, s, z, f"{kv.state.name}/{base}", **attrs)
            for node in consumers:
                for i, name in enumerate(node.input):
                    if name == tensor:
                        node.input[i] = dq

    def _dtype_of(self, tensor: str) -> np.dtype:
        tt = self._value_type(tensor)
        if tt is not None and tt.elem_type:
            return np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        return np.dtype(np.float32)

    def _row_zero_points(self, t: Target, scale: str, qtype: _QType, base: str) -> str:
        shape_of = self._op(t, "Shape", [scale], f"{base}/ScaleShape")
        zeros = self._unique(f"{base}/zeros")
        self._add(t, helper.make_node(
            "ConstantOfShape", [shape_of], [zeros], name=self._unique(f"{base}/ConstantOfShape"),
            value=numpy_helper.from_array(np.zeros(1, dtype=np.float32)),
        ))
        return self._op(t, "Cast", [zeros], f"{base}/ZeroPoint", to=qtype.onnx_type)

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
        """An initializer; ml_dtypes arrays (int4, fp4, fp8, e8m0) are packed by onnx.numpy_helper."""
        name = self._unique(name)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def _unique(self, name: str) -> str:
        candidate, i = name, 1
        while candidate in self.names:
            candidate = f"{name}_{i}"
            i += 1
        self.names.add(candidate)
        return candidate

    def _value_type(self, name: str):
        return self.types.get(name)

    def _act_dtype(self, t: Target) -> np.dtype:
        return self._dtype_of(t.activation)

    def _act_rank(self, t: Target) -> int | None:
        if t.op_type == "Gemm":
            return 2
        tt = self._value_type(t.activation)
        if tt is not None and tt.HasField("shape"):
            return len(tt.shape.dim)
        return None

    def finish(self) -> onnx.ModelProto:
        """Place the new nodes, drop what nothing reads any more; returns the model."""
        new_nodes = []
        for node in self.graph.node:
            new_nodes.extend(self.nodes_before.get(node.name, []))
            new_nodes.append(node)
        del self.graph.node[:]
        self.graph.node.extend(new_nodes)
        self.graph.initializer.extend(self.inits)
        _drop_dead_weight_paths(self.graph, self.detached)
        have = {o.domain for o in self.model.opset_import}
        for domain in sorted(self.custom_domains - have):
            self.model.opset_import.append(helper.make_opsetid(domain, 1))
        return self.model


class _WeightLayout:
    """Where a weight's per-tensor / per-channel / per-block parameters go in ONNX.

    compressed-tensors holds them in torch's [out, in] orientation: scalar (tensor), [out, 1]
    (channel), [out, in/G] (group, tensor_group) or [out/bh, in/bw] (block). ONNX blocks along
    one axis only, so block scales are expanded per output row to [out, in/bw]; the node's B
    input is [in, out] for MatMul, so everything but the scalar is transposed there.
    """

    def __init__(self, t: Target, strategy: str, args, stored: str):
        self.t, self.strategy, self.stored = t, strategy, stored
        self.block = None
        if strategy in ("group", "tensor_group"):
            self.block = args.group_size
        elif strategy == "block":
            self.rows, self.block = args.block_structure

    def weight(self, array: np.ndarray) -> np.ndarray:
        """The quantized weight, torch [out, in], as the node's B input takes it."""
        return array.T if self.stored == "in_out" else array

    def param(self, array: np.ndarray) -> np.ndarray:
        """A scale or zero point in compressed-tensors' shape, laid out for DequantizeLinear."""
        if self.strategy == "tensor":
            return array.reshape(())
        if self.strategy == "channel":
            return array.reshape(-1)
        array = array.reshape(array.shape[0], -1)
        if self.strategy == "block":
            array = np.repeat(array, self.rows, axis=0)[: self.t.out_features]
        return self.weight(array)

    def attrs(self) -> dict:
        if self.strategy == "tensor":
            return {}
        if self.strategy == "channel":
            return {"axis": 1 if self.stored == "in_out" else 0}
        return {"axis": 0 if self.stored == "in_out" else 1, "block_size": self.block}


def _as_qtype(values: torch.Tensor, qtype: _QType) -> np.ndarray:
    """Values already on the quantized grid (compressed-tensors' output) as the ONNX storage type."""
    array = values.detach().to(torch.float32).numpy()
    if qtype.np_dtype.kind in "iu" or qtype.np_dtype == np.dtype(ml_dtypes.int4):
        array = np.rint(array).astype(np.int8)
    return array.astype(qtype.np_dtype)


def _np_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


def dead_weight_paths(graph: onnx.GraphProto, detached: set[str], inputs_of=None) -> tuple[list, list[str]]:
    """(nodes, initializer names) nothing reads any more once ``detached`` values lost a reader.

    A node is dead when none of its outputs is read and one of them was detached; its inputs are
    then detached in turn. ``inputs_of(node)`` gives a node's inputs (default: as in the graph),
    so a caller can ask what a rewiring would leave dead without making it.
    """
    inputs_of = inputs_of or (lambda n: list(n.input))
    detached = set(detached)
    nodes = list(graph.node)
    dead_nodes: list = []
    outputs = {o.name for o in graph.output}
    while True:
        used = {i for n in nodes for i in inputs_of(n)} | outputs
        dead = [n for n in nodes if all(o not in used for o in n.output) and set(n.output) & detached]
        if not dead:
            break
        for n in dead:
            detached.update(i for i in n.input if i)
            nodes.remove(n)
        dead_nodes += dead
    used |= {i.name for i in graph.input}
    inits = [t.name for t in graph.initializer if t.name in detached and t.name not in used]
    return dead_nodes, inits


def _drop_dead_weight_paths(graph: onnx.GraphProto, detached: set[str]) -> None:
    """Remove weight-path nodes and initializers that nothing reads any more."""
    dead_nodes, dead_inits = dead_weight_paths(graph, detached)
    for n in dead_nodes:
        graph.node.remove(n)
    if dead_inits:
        drop = set(dead_inits)
        keep = [t for t in graph.initializer if t.name not in drop]
        del graph.initializer[:]
        graph.initializer.extend(keep)


def ir_for_opset(opset: int) -> int:
    """The lowest IR version onnx pairs with ``opset``, capped at what onnxruntime loads."""
    irs = [ir for _release, ir, op, *_ in helper.VERSION_TABLE if op >= opset]
    return min(min(irs, default=MAX_ORT_IR), MAX_ORT_IR)


def _upgrade_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """``model`` converted to ``opset`` in place: onnx's version converter runs on a hollow copy
    (weights as dims-only stubs), and its graph replaces the model's while the weights stay put,
    so a big model is never copied. Falls back to converting the whole model if the hollow one
    cannot be converted (an adapter that reads weight values)."""
    from onnx import version_converter

    from graphcal.graph.io import hollow_copy

    hollow = hollow_copy(model)
    hollow.graph.initializer.extend(
        onnx.TensorProto(name=t.name, dims=t.dims, data_type=t.data_type) for t in model.graph.initializer)
    try:
        converted = version_converter.convert_version(hollow, opset)
    except Exception:  # noqa: BLE001 -- retried below on the whole model, which reports the real error
        converted = None
    if converted is None:
        try:
            upgraded = version_converter.convert_version(model, opset)
        except Exception as e:
            raise GraphcalError(
                f"the scheme needs opset {opset} but the model (opset {default_opset(model)}) could not be converted: "
                f"{str(e).strip().splitlines()[0]}; re-export the model at opset {opset}"
            ) from e
        upgraded.ir_version = max(upgraded.ir_version, ir_for_opset(opset))
        return upgraded
    kept = {t.name for t in model.graph.initializer}
    graph = model.graph
    for name in ("node", "input", "output", "value_info"):
        field = getattr(graph, name)
        del field[:]
        field.extend(getattr(converted.graph, name))
    graph.initializer.extend(t for t in converted.graph.initializer if t.name not in kept)  # constants it added
    del model.opset_import[:]
    model.opset_import.extend(converted.opset_import)
    model.ir_version = max(converted.ir_version, ir_for_opset(opset))
    return model
