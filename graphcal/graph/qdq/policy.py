"""What the Q/DQ writer can write, for which target runtime, at which opset.

Every rule here is checked before calibration (``items_opset``, ``required_kv_opset``), so a
scheme with no ONNX form, or one the target runtime does not build, ends with a one-line error
naming it. Also here: how each compressed-tensors type is stored in ONNX (:class:`QType`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import torch
from onnx import TensorProto

from graphcal.errors import GraphcalError
from graphcal.types import QuantizedTarget
from graphcal.types import enum_value as _name


class TargetRuntime(enum.StrEnum):
    """The runtime a QDQ model is written for.

    - ``onnxruntime``: compressed-tensors' numbers in the forms onnxruntime's optimizer turns into
      its fast kernels, and that load at its default ORT_ENABLE_ALL (see :func:`ort_form`);
    - ``tensorrt``: only what TensorRT builds;
    - ``qdq``: compressed-tensors' operations written literally as standard ONNX Q/DQ, for other
      runtimes and readers (onnx.reference runs every form).

    ``TargetRuntime("tensorrt")`` converts a command-line string; an unknown one is a GraphcalError.
    """

    ONNXRUNTIME = "onnxruntime"
    TENSORRT = "tensorrt"
    QDQ = "qdq"

    @classmethod
    def _missing_(cls, value):
        raise GraphcalError(f"unknown target runtime {value!r}; choose one of: {', '.join(cls)}")


@dataclass(frozen=True)
class QType:
    """How one compressed-tensors type is stored in ONNX."""

    onnx_type: int
    np_dtype: np.dtype  # numpy / ml_dtypes type that onnx.numpy_helper packs
    half_range: float  # compressed-tensors' symmetric divisor: (qmax - qmin) / 2
    opset: int  # lowest opset whose Q/DQ take this type

    def array(self, values: torch.Tensor) -> np.ndarray:
        """Values already on the quantized grid (compressed-tensors' output) as this storage type."""
        array = values.detach().to(torch.float32).numpy()
        if self.np_dtype.kind in "iu" or self.np_dtype == np.dtype(ml_dtypes.int4):
            array = np.rint(array).astype(np.int8)
        return array.astype(self.np_dtype)


_QTYPES = {
    ("int", 8): QType(TensorProto.INT8, np.dtype(np.int8), 127.5, 13),
    ("int", 4): QType(TensorProto.INT4, np.dtype(ml_dtypes.int4), 7.5, 21),
    ("float", 8): QType(TensorProto.FLOAT8E4M3FN, np.dtype(ml_dtypes.float8_e4m3fn), 448.0, 19),
    ("float", 4): QType(TensorProto.FLOAT4E2M1, np.dtype(ml_dtypes.float4_e2m1fn), 6.0, 23),
}
FP8 = _QTYPES["float", 8]
FP4 = _QTYPES["float", 4]
_SUPPORTED = "int4/int8 (sym or asym), fp8 e4m3, fp4 e2m1"
_BLOCKED_OPSET = 21  # block_size on Q/DQ
_E8M0_OPSET = 24  # float8e8m0 scales


def qtype_of(args, where: str, what: str) -> QType:
    """The storage type of ``args``; raises for a type or asymmetry ONNX Q/DQ cannot express."""
    qtype = _QTYPES.get((_name(args.type), args.num_bits))
    if qtype is None:
        raise GraphcalError(f"{where}: {what} {_name(args.type)}{args.num_bits} has no ONNX Q/DQ form here (supported: {_SUPPORTED})")
    if not args.symmetric and _name(args.type) == "float":
        raise GraphcalError(f"{where}: {what} asymmetric float quantization has no ONNX form (float Q/DQ zero points must be 0)")
    return qtype


def is_mx(args) -> bool:
    """MX formats: float elements, groups of 32, power-of-two scales kept as uint8 exponents."""
    # lazy: compressed-tensors takes seconds to import; only this path needs it
    from compressed_tensors.quantization.utils import should_generate_mx_scales

    return should_generate_mx_scales(args)


def fp8_scales(args) -> bool:
    """Whether the scales are stored as fp8 (NVFP4's local scales)."""
    return args.scale_dtype == torch.float8_e4m3fn


def items_opset(items: list[QuantizedTarget], target_runtime: TargetRuntime | str = TargetRuntime.ONNXRUNTIME) -> int:
    """The opset a model with these targets needs (never below 13)."""
    target_runtime = TargetRuntime(target_runtime)
    return max([required_opset(item, target_runtime) for item in items] + [13])


def required_opset(item: QuantizedTarget, target_runtime: TargetRuntime | str = TargetRuntime.ONNXRUNTIME) -> int:
    """The lowest opset that expresses this target's scheme; raises for what has no ONNX form here,
    or, for TensorRT, for what TensorRT does not build."""
    target_runtime = TargetRuntime(target_runtime)
    scheme = item.scheme
    where = item.target.name
    if item.target.op_type == "Gather":
        return _lookup_opset(item, target_runtime)
    if scheme.output_activations is not None:
        raise GraphcalError(f"{where}: output_activations are not written to ONNX (quantize the next layer's input instead)")
    if scheme.weights is None:
        raise GraphcalError(f"{where}: the scheme has no weights entry; graphcal writes weight-quantized MatMul/Gemm only")
    opsets = [_weight_opset(scheme.weights, where)]
    if scheme.input_activations is not None:
        opsets.append(_input_opset(scheme.input_activations, where))
    if target_runtime is TargetRuntime.TENSORRT:
        problem = tensorrt_problem(scheme)
        if problem:
            raise GraphcalError(f"{where}: --target tensorrt: {problem}")
    return max(opsets)


def _lookup_opset(item: QuantizedTarget, target_runtime: TargetRuntime) -> int:
    """An embedding lookup's opset; raises for a scheme it has no form for (lookups take weight-only
    integer schemes on onnxruntime: GatherBlockQuantized; DequantizeLinear -> Gather elsewhere)."""
    scheme, where = item.scheme, item.target.name
    if scheme.input_activations is not None or scheme.output_activations is not None:
        raise GraphcalError(f"{where}: an embedding lookup's input is token ids, so its scheme must be weight-only: "
                            "give the lookups one of their own, e.g. --scheme-for Embedding=W8A16")
    if scheme.weights is None:
        raise GraphcalError(f"{where}: the scheme has no weights entry")
    w = scheme.weights
    strategy = _name(w.strategy)
    if strategy not in ("tensor", "channel", "group"):
        raise GraphcalError(f"{where}: an embedding table is quantized per tensor, per channel (row) or in groups "
                            f"along the hidden dimension, not per {strategy}")
    if target_runtime is TargetRuntime.ONNXRUNTIME:
        if (_name(w.type), w.num_bits) not in (("int", 4), ("int", 8)):
            raise GraphcalError(f"{where}: onnxruntime's GatherBlockQuantized takes int4/int8 tables, not "
                                f"{_name(w.type)}{w.num_bits}; use --target qdq for DequantizeLinear -> Gather")
        if strategy == "group" and not (w.group_size >= 16 and w.group_size & (w.group_size - 1) == 0):
            raise GraphcalError(f"{where}: GatherBlockQuantized takes blocks of 16 or more, a power of two; "
                                f"group size {w.group_size}")
        return 13
    if target_runtime is TargetRuntime.TENSORRT:
        problem = tensorrt_problem(scheme)
        if problem:
            raise GraphcalError(f"{where}: --target tensorrt: {problem}")
    return _weight_opset(w, where)


def required_kv_opset(args, target_runtime: TargetRuntime | str = TargetRuntime.ONNXRUNTIME) -> int:
    """The opset for static Q/DQ on key/value states (per tensor, or per kv head on axis 1)."""
    target_runtime = TargetRuntime(target_runtime)
    qtype = qtype_of(args, "kv-cache scheme", "key/value states")
    if args.dynamic is not False or _name(args.strategy) not in ("tensor", "attn_head"):
        raise GraphcalError("kv-cache scheme: key/value states are written as static tensor or attn_head Q/DQ only")
    if qtype.opset > 19 and _name(args.type) == "float":
        raise GraphcalError("kv-cache scheme: fp4 key/value states have no ONNX form here; use fp8 or int8")
    if target_runtime is TargetRuntime.TENSORRT and (not args.symmetric or _name(args.strategy) != "tensor" or args.num_bits != 8):
        raise GraphcalError("kv-cache scheme: --target tensorrt: TensorRT takes int8/fp8 key/value states "
                            "per tensor, symmetric")
    return qtype.opset


def runtime_notes(items: list[QuantizedTarget], target_runtime: TargetRuntime | str) -> list[str]:
    """Warnings about what the chosen runtime can execute of the written model."""
    fp4 = any(_is_fp4(i.scheme.weights) for i in items if i.scheme.weights is not None)
    if TargetRuntime(target_runtime) is TargetRuntime.QDQ and fp4:
        return ["onnxruntime 1.31 has no float4 (or e8m0) Q/DQ kernels: the written model is standard ONNX "
                "(opset 23+, checked with onnx.reference) for runtimes that have them; for TensorRT use --target tensorrt"]
    return []


class WeightForm(enum.StrEnum):
    """How a weight reaches its MatMul/Gemm."""

    DQ = "dq"  # DequantizeLinear of the stored weight
    CAST_MUL = "cast_mul"  # fp8 initializer -> Cast(float) -> Mul(scale): onnxruntime folds it at load
    MATMULNBITS = "matmulnbits"  # the node becomes com.microsoft.MatMulNBits with packed weights
    GATHER_BLOCK = "gather_block"  # an embedding lookup becomes com.microsoft.GatherBlockQuantized


class InputForm(enum.StrEnum):
    """How an input activation is quantized."""

    NONE = "none"  # weight-only
    QDQ = "qdq"  # QuantizeLinear -> DequantizeLinear, compressed-tensors' ops written literally
    UINT8 = "uint8"  # static int8 as uint8 with zero point + 128 (same numbers; onnxruntime fuses it)
    ROWNORM = "rownorm"  # per-token int8 on rows divided by their scale, scale re-applied after the MatMul
    KERNEL = "kernel"  # MatMulNBits accuracy level 4 quantizes the activation itself (per block of K, max/127)
    CAST_MUL = "cast_mul"  # static fp8: QuantizeLinear -> Cast(float) -> Mul(scale), no DequantizeLinear


@dataclass(frozen=True)
class Form:
    """What is written for one target, and what onnxruntime makes of it (``kernel``, for notes)."""

    weight: WeightForm
    input: InputForm
    kernel: str


MATMULNBITS_BITS = (4, 8)
ACCURACY_LEVELS = (0, 1, 2, 3, 4)


class PreferredLevel(int):
    """A MatMulNBits accuracy level written only where a weight-only integer layer can take it, the other
    layers keeping their form: an onnxruntime-genai model's default (the builder's own format). A plain int
    (``--matmulnbits LEVEL``) asks MatMulNBits of every integer layer and refuses one it cannot take."""


def choose_form(item: QuantizedTarget, target_runtime: TargetRuntime | str, matmulnbits: int | None = None) -> Form:
    """The form written for ``item``; raises for a combination with no form. ``matmulnbits`` is
    the MatMulNBits accuracy level asked for (None: write DequantizeLinear; a :class:`PreferredLevel`:
    MatMulNBits where the layer is weight-only and MatMulNBits takes it)."""
    target_runtime = TargetRuntime(target_runtime)
    w, a = item.scheme.weights, item.scheme.input_activations
    where = item.target.name
    wkind = (_name(w.type), w.num_bits)
    if item.target.op_type == "Gather":  # an embedding lookup (weight-only: _lookup_opset)
        if target_runtime is TargetRuntime.ONNXRUNTIME:
            return Form(WeightForm.GATHER_BLOCK, InputForm.NONE, f"GatherBlockQuantized {w.num_bits}-bit (embedding)")
        return Form(WeightForm.DQ, InputForm.NONE, "as the runtime builds it")
    if target_runtime is not TargetRuntime.ONNXRUNTIME:
        if matmulnbits is not None:
            raise GraphcalError("--matmulnbits writes onnxruntime's com.microsoft.MatMulNBits: use it with --target "
                                "onnxruntime")
        return Form(WeightForm.DQ, InputForm.NONE if a is None else InputForm.QDQ, "as the runtime builds it")
    if _is_fp4(w) or (a is not None and _is_fp4(a)):
        raise GraphcalError(f"{where}: onnxruntime 1.31 has no float4 kernels (not even Cast), so a fp4 model does "
                            "not load there; use --target qdq (standard ONNX, opset 23+, for runtimes with fp4) or "
                            "--target tensorrt")
    if matmulnbits is not None and wkind[0] == "int":
        if not isinstance(matmulnbits, PreferredLevel):
            return _matmulnbits_form(item, matmulnbits)
        if a is None:  # the builder format by default: weight-only layers MatMulNBits takes, the rest as they are
            try:
                return _matmulnbits_form(item, matmulnbits)
            except GraphcalError:
                pass
    if wkind[0] == "float":  # fp8: onnxruntime has no fp8 kernel on CPU and mis-fuses fp8 Q/DQ around MatMul
        weight = WeightForm.CAST_MUL
        if a is None:
            return Form(weight, InputForm.NONE, "float MatMul (fp8 weight expanded to fp32 at load)")
        return Form(weight, _fp8_input(a), "float MatMul after fp8 quantization of the input, slower than fp32 "
                    "(no CPU fp8 kernel; the fp8 rounding runs as extra ops; weight expanded at load)")
    if a is None:
        bits = "4" if w.num_bits == 4 else "8"
        return Form(WeightForm.DQ, InputForm.NONE,
                    f"MatMulNBits {bits}-bit (at onnxruntime's default accuracy level 4 it quantizes the input to "
                    "int8 per block of K)")
    integer_kernel = (_name(a.type), a.num_bits) == ("int", 8) and w.num_bits == 8 and _name(w.strategy) in (
        "tensor", "channel")
    if not integer_kernel:  # no integer kernel takes it; a weight DQ beside an input DQ could be mis-fused
        return Form(WeightForm.CAST_MUL, _fp8_input(a) if _name(a.type) == "float" else InputForm.QDQ,
                    "float MatMul after run-time Q/DQ of the input, slower than fp32 (weight expanded to fp32 at "
                    "load)"
                    + ("; for int4 weights with int8 inputs --matmulnbits is fast" if w.num_bits == 4 else ""))
    kernel = "QGemm (u8 x s8)" if item.target.op_type == "Gemm" else "MatMulIntegerToFloat (u8 x s8)"
    if a.dynamic is False:
        return Form(WeightForm.DQ, InputForm.UINT8, kernel)
    if _name(a.strategy) in ("token", "tensor"):
        return Form(WeightForm.DQ, InputForm.ROWNORM, f"{kernel} + Mul by the per-token scale")
    return Form(WeightForm.CAST_MUL, InputForm.QDQ, f"float MatMul after run-time Q/DQ per {_name(a.strategy)}, "
                "slower than fp32 (weight expanded to fp32 at load)")


def _fp8_input(args) -> InputForm:
    """Static fp8 inputs are written without DequantizeLinear: onnxruntime's Q/DQ propagation moves
    a static fp8 Q/DQ pair above a Transpose or Reshape, which have no fp8 kernel (the model then
    fails to load at ORT_ENABLE_ALL)."""
    return InputForm.CAST_MUL if args.dynamic is False else InputForm.QDQ


def _matmulnbits_form(item: QuantizedTarget, level: int) -> Form:
    w, a = item.scheme.weights, item.scheme.input_activations
    where = item.target.name
    if level not in ACCURACY_LEVELS:
        raise GraphcalError(f"--matmulnbits: the accuracy level must be 0..4, got {level}")
    if w.num_bits not in MATMULNBITS_BITS:
        raise GraphcalError(f"{where}: MatMulNBits takes 4- or 8-bit integer weights, not {w.num_bits}-bit")
    strategy = _name(w.strategy)
    if strategy == "group" and not _pow2_block(w.group_size):
        raise GraphcalError(f"{where}: MatMulNBits takes blocks of 16..256, a power of two; group size {w.group_size}")
    if strategy == "block" and not _pow2_block(w.block_structure[1]):
        raise GraphcalError(f"{where}: MatMulNBits takes blocks of 16..256 along the input, a power of two; "
                            f"block {w.block_structure}")
    if strategy not in ("tensor", "channel", "group", "block"):
        raise GraphcalError(f"{where}: MatMulNBits has no form for weights per {strategy}")
    kernel = f"MatMulNBits {w.num_bits}-bit, accuracy level {level}"
    if a is None:
        return Form(WeightForm.MATMULNBITS, InputForm.NONE,
                    kernel + (" (input quantized to int8 per block of K by the kernel)" if level == 4 else ""))
    if _name(a.type) != "int" or a.num_bits != 8 or a.dynamic is False or not a.symmetric:
        raise GraphcalError(f"{where}: --matmulnbits: MatMulNBits quantizes inputs only dynamically to symmetric "
                            "int8 (accuracy level 4); this scheme's input activations need Q/DQ: drop --matmulnbits")
    if level != 4:
        raise GraphcalError(f"{where}: --matmulnbits {level} keeps the input in float, but the scheme quantizes "
                            "it to int8: use --matmulnbits 4 (the kernel quantizes it per block of K) or drop "
                            "--matmulnbits")
    return Form(WeightForm.MATMULNBITS, InputForm.KERNEL,
                kernel + " (the kernel quantizes the input to int8 per block of K with max/127, close to but not "
                "compressed-tensors' per-token max/127.5)")


def _pow2_block(size) -> bool:
    return size is not None and 16 <= size <= 256 and size & (size - 1) == 0


def _is_fp4(args) -> bool:
    return _name(args.type) == "float" and args.num_bits == 4


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
        if is_mx(w) or _name(w.strategy) != "tensor_group" or w.group_size != 16 or not fp8_scales(w):
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


def _weight_opset(args, where: str) -> int:
    qtype = qtype_of(args, where, "weights")
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
    qtype = qtype_of(args, where, "input activations")
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
    if dynamic == "local" and strategy == "tensor_group" and fp8_scales(args):
        return qtype.opset
    raise GraphcalError(f"{where}: dynamic={dynamic} input activations with strategy {strategy} are not written to ONNX")


def form_notes(items: list[QuantizedTarget], target_runtime: TargetRuntime | str, matmulnbits: int | None = None) -> list[str]:
    """One line per kernel: how many targets onnxruntime runs on it (checks every form: raises
    where there is none). Empty for other runtimes."""
    counts: dict[str, int] = {}
    for item in items:
        form = choose_form(item, target_runtime, matmulnbits)
        counts[form.kernel] = counts.get(form.kernel, 0) + 1
    if TargetRuntime(target_runtime) is not TargetRuntime.ONNXRUNTIME:
        return []
    notes = [f"{n} layer{'s' if n != 1 else ''}: {kernel}" for kernel, n in counts.items()]
    if any(not kernel.startswith(("MatMulNBits", "GatherBlockQuantized")) for kernel in counts):
        notes.append("on onnxruntime's CUDA provider only MatMulNBits runs quantized: int8/fp8 activation Q/DQ "
                     "run in float there, slower than fp32 (docs/speed.md); for GPUs use --target tensorrt")
    return notes
