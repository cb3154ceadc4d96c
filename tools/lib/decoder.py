"""Random-weight Llama-style decoders of real shapes, written tensor by tensor with numpy and onnx alone.

The graph is the one torch's legacy exporter writes for a transformers ``LlamaForCausalLM`` with eager
attention (models/tiny-llama): the same ops at opset 17, node names by module scope
(``/model/layers.0/self_attn/q_proj/MatMul``), initializers named as the exporter names them
(``model.embed_tokens.weight``, ``model.layers.0.input_layernorm.weight``, ``onnx::MatMul_N`` for the
transposed Linear weights), inputs ``input_ids``/``attention_mask``, output ``logits``; graphcal finds its
blocks and residual stream as it does in an export. The shape-computing subgraphs are shorter than the
exporter's (constant Reshape targets with 0 and -1, positions from ``Shape(input_ids)``), and in float16
and bfloat16 the attention scores are cast to float32 before the mask is added (a float16 mask of its
minimum would overflow to -inf). bfloat16 weights are ml_dtypes' bfloat16 (onnx's own dependency), rounded
to nearest even from the float32 draw.

Weights: every tensor is generated in chunks of rows (:data:`CHUNK` elements at most), each from its own
seed derived from the run's seed, the tensor's name and the chunk's index, and written at its offset in
``model.onnx.data``; the ModelProto holds external-data references only. Peak memory is a chunk or two,
whatever the model's size. Scales: Linear weights normal / sqrt(fan_in), the embedding normal / sqrt(hidden),
norm scales 1 + 0.02 normal. With ``tie``, lm_head is the embedding transposed (a second initializer, as the
exporter's constant folding writes it).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17  # tiny-llama's (tools/lib/synthetic.OPSET)
IR_VERSION = 8
CHUNK = 1 << 22  # elements generated and written at once (16 MB in float32)
ALIGN = 4096  # every tensor starts at a multiple of this in the data file
DATA_NAME = "model.onnx.data"
# bfloat16: ml_dtypes' numpy type (onnx's own dependency, which numpy_helper reads and writes bf16 tensors with)
DTYPES = {"float32": (np.float32, TensorProto.FLOAT), "float16": (np.float16, TensorProto.FLOAT16),
          "bfloat16": (ml_dtypes.bfloat16, TensorProto.BFLOAT16)}


@dataclass(frozen=True)
class DecoderShape:
    """A Llama decoder's widths."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tie: bool = False
    rope_theta: float = 10000.0
    eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def check(self) -> None:
        """ValueError (one line) when the widths make no decoder."""
        for field in ("hidden", "layers", "intermediate", "heads", "kv_heads", "vocab"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be at least 1, got {getattr(self, field)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not a multiple of kv-heads {self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"the head width {self.head_dim} (hidden / heads) must be even for rotary embeddings")


PRESETS = {
    "bench": DecoderShape(1024, 8, 2816, 16, 4, 1024),  # tools.builders.build_bench_decoder
    "1.5b": DecoderShape(2048, 30, 5632, 32, 4, 32000),  # tools.builders.build_large_decoder
    "3b": DecoderShape(3072, 28, 8192, 24, 8, 128256, tie=True, rope_theta=500000.0, eps=1e-5),  # Llama-3.2-3B
    "llama3-8b": DecoderShape(4096, 32, 14336, 32, 8, 128256, rope_theta=500000.0, eps=1e-5),  # Llama-3-8B
}


@dataclass(frozen=True)
class Weight:
    """One initializer: its name, shape, how it is drawn (``std`` of a normal, plus ``mean``), and the
    tensor it is the transpose of (``tied_to``: written while that one is)."""

    name: str
    shape: tuple[int, ...]
    std: float
    mean: float = 0.0
    tied_to: str = ""


# -- the graph ------------------------------------------------------------------------------------

class _Graph:
    """Nodes named as torch's legacy exporter names them: ``{scope}/{Op}``, ``{scope}/{Op}_1``, ...;
    outputs ``{name}_output_0``."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.weights: list[Weight] = []
        self._count: dict[tuple[str, str], int] = {}

    def op(self, scope: str, op: str, inputs: list[str], output: str | None = None, **attrs) -> str:
        k = self._count.get((scope, op), 0)
        self._count[(scope, op)] = k + 1
        name = f"{scope}/{op}" + (f"_{k}" if k else "")
        out = output or f"{name}_output_0"
        self.nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    def const(self, scope: str, value) -> str:
        return self.op(scope, "Constant", [], value=numpy_helper.from_array(np.asarray(value)))

    def linear(self, scope: str, x: str, fan_in: int, fan_out: int, std: float | None = None, output: str | None = None,
               tied_to: str = "") -> str:
        """``x @ W`` with W ``[fan_in, fan_out]`` (torch's Linear weight, transposed by the exporter)."""
        name = f"onnx::MatMul_{len(self.nodes)}"
        self.weights.append(Weight(name, (fan_in, fan_out), std if std is not None else fan_in ** -0.5, tied_to=tied_to))
        return self.op(scope, "MatMul", [x, name], output)

    def norm_weight(self, name: str, hidden: int) -> str:
        self.weights.append(Weight(name, (hidden,), 0.02, mean=1.0))
        return name


def build(shape: DecoderShape, dtype: str = "float32") -> tuple[onnx.ModelProto, list[Weight]]:
    """The decoder's ModelProto without its initializers, and the initializers to write, in file order."""
    shape.check()
    np_dtype, onnx_dtype = DTYPES[dtype]
    half = onnx_dtype != TensorProto.FLOAT  # float16 and bfloat16: the same graph, the mask and softmax in float32
    g = _Graph()
    i64 = np.int64
    embed = "model.embed_tokens.weight"
    g.weights.append(Weight(embed, (shape.vocab, shape.hidden), shape.hidden ** -0.5))
    h = g.op("/model/embed_tokens", "Gather", [embed, "input_ids"])

    m = "/model"  # positions 0..seq-1 (the exporter's position_ids: not shifted by padding)
    seq = g.op(m, "Gather", [g.op(m, "Shape", ["input_ids"]), g.const(m, i64(1))], axis=0)
    pos = g.op(m, "Range", [g.const(m, i64(0)), seq, g.const(m, i64(1))])
    # the causal and padding mask: 0 where query i may attend key j (j <= i, key not padding), else float32's min
    query = g.op(m, "Unsqueeze", [pos, g.const(m, np.array([1], i64))])
    key = g.op(m, "Unsqueeze", [pos, g.const(m, np.array([0], i64))])
    causal = g.op(m, "LessOrEqual", [key, query])
    padding = g.op(m, "Unsqueeze", [g.op(m, "Cast", ["attention_mask"], to=TensorProto.BOOL),
                                    g.const(m, np.array([1, 2], i64))])
    allowed = g.op(m, "And", [causal, padding])
    mask = g.op(m, "Where", [allowed, g.const(m, np.float32(0)), g.const(m, np.float32(np.finfo(np.float32).min))])

    r = "/model/rotary_emb"  # cos/sin [1, seq, head_dim] of position x inv_freq, computed in float32
    d = shape.head_dim
    inv_freq = (1.0 / shape.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d)).astype(np.float32)
    positions = g.op(r, "Cast", [g.op(r, "Unsqueeze", [pos, g.const(r, np.array([0, 2], i64))])], to=TensorProto.FLOAT)
    freqs = g.op(r, "Mul", [positions, g.const(r, inv_freq)])
    angles = g.op(r, "Concat", [freqs, freqs], axis=-1)
    cos, sin = g.op(r, "Cos", [angles]), g.op(r, "Sin", [angles])
    if half:
        cos, sin = (g.op(r, "Cast", [t], to=onnx_dtype) for t in (cos, sin))

    def rms_norm(scope: str, x: str, weight: str) -> tuple[str, str]:
        """(the normed value, the residual the layer adds to: in float32 the exporter reads the norm's Cast)."""
        x32 = g.op(scope, "Cast", [x], to=TensorProto.FLOAT)
        var = g.op(scope, "ReduceMean", [g.op(scope, "Pow", [x32, g.const(scope, np.float32(2))])], axes=[-1], keepdims=1)
        rsqrt = g.op(scope, "Div", [g.const(scope, np.float32(1)),
                                    g.op(scope, "Sqrt", [g.op(scope, "Add", [var, g.const(scope, np.float32(shape.eps))])])])
        y = g.op(scope, "Cast", [g.op(scope, "Mul", [x32, rsqrt])], to=onnx_dtype)
        return g.op(scope, "Mul", [g.norm_weight(weight, shape.hidden), y]), (x if half else x32)

    def heads(a: str, x: str, n: int) -> str:
        """[B, S, n * d] -> [B, n, S, d]."""
        return g.op(a, "Transpose", [g.op(a, "Reshape", [x, g.const(a, np.array([0, 0, -1, d], i64))], allowzero=0)],
                    perm=[0, 2, 1, 3])

    def rotate(a: str, x: str, cos4: str, sin4: str) -> str:
        """x * cos + rotate_half(x) * sin."""
        x1 = g.op(a, "Slice", [x, g.const(a, np.array([0], i64)), g.const(a, np.array([d // 2], i64)),
                               g.const(a, np.array([3], i64)), g.const(a, np.array([1], i64))])
        x2 = g.op(a, "Slice", [x, g.const(a, np.array([d // 2], i64)), g.const(a, np.array([np.iinfo(np.int64).max], i64)),
                               g.const(a, np.array([3], i64)), g.const(a, np.array([1], i64))])
        rotated = g.op(a, "Concat", [g.op(a, "Neg", [x2]), x1], axis=-1)
        return g.op(a, "Add", [g.op(a, "Mul", [x, cos4]), g.op(a, "Mul", [rotated, sin4])])

    def repeat_kv(a: str, x: str) -> str:
        """[B, kv, S, d] -> [B, heads, S, d], each kv head repeated heads / kv times in a row."""
        n_rep = shape.heads // shape.kv_heads
        if n_rep == 1:
            return x
        expanded = g.op(a, "Expand", [g.op(a, "Unsqueeze", [x, g.const(a, np.array([2], i64))]),
                                      g.const(a, np.array([1, 1, n_rep, 1, 1], i64))])
        return g.op(a, "Reshape", [expanded, g.const(a, np.array([0, shape.heads, -1, d], i64))], allowzero=0)

    q_width, kv_width = shape.heads * d, shape.kv_heads * d
    for i in range(shape.layers):
        lay = f"/model/layers.{i}"
        a = f"{lay}/self_attn"
        x, residual = rms_norm(f"{lay}/input_layernorm", h, f"model.layers.{i}.input_layernorm.weight")
        q = heads(a, g.linear(f"{a}/q_proj", x, shape.hidden, q_width), shape.heads)
        k = heads(a, g.linear(f"{a}/k_proj", x, shape.hidden, kv_width), shape.kv_heads)
        v = heads(a, g.linear(f"{a}/v_proj", x, shape.hidden, kv_width), shape.kv_heads)
        cos4 = g.op(a, "Unsqueeze", [cos, g.const(a, np.array([1], i64))])
        sin4 = g.op(a, "Unsqueeze", [sin, g.const(a, np.array([1], i64))])
        q, k = rotate(a, q, cos4, sin4), rotate(a, k, cos4, sin4)
        k, v = repeat_kv(a, k), repeat_kv(a, v)
        scores = g.op(a, "MatMul", [q, g.op(a, "Transpose", [k], perm=[0, 1, 3, 2])])
        scores = g.op(a, "Mul", [scores, g.const(a, np_dtype(d ** -0.5))])
        if half:
            scores = g.op(a, "Cast", [scores], to=TensorProto.FLOAT)
        probs = g.op(a, "Softmax", [g.op(a, "Add", [scores, mask])], axis=-1)
        if half:
            probs = g.op(a, "Cast", [probs], to=onnx_dtype)
        context = g.op(a, "Transpose", [g.op(a, "MatMul", [probs, v])], perm=[0, 2, 1, 3])
        context = g.op(a, "Reshape", [context, g.const(a, np.array([0, 0, -1], i64))], allowzero=0)
        h = g.op(lay, "Add", [residual, g.linear(f"{a}/o_proj", context, q_width, shape.hidden)])

        mlp = f"{lay}/mlp"
        x, residual = rms_norm(f"{lay}/post_attention_layernorm", h, f"model.layers.{i}.post_attention_layernorm.weight")
        gate = g.linear(f"{mlp}/gate_proj", x, shape.hidden, shape.intermediate)
        act = g.op(f"{mlp}/act_fn", "Mul", [gate, g.op(f"{mlp}/act_fn", "Sigmoid", [gate])])
        up = g.linear(f"{mlp}/up_proj", x, shape.hidden, shape.intermediate)
        down = g.linear(f"{mlp}/down_proj", g.op(mlp, "Mul", [act, up]), shape.intermediate, shape.hidden)
        h = g.op(lay, "Add", [residual, down])

    x, _ = rms_norm("/model/norm", h, "model.norm.weight")
    g.linear("/lm_head", x, shape.hidden, shape.vocab, std=shape.hidden ** -0.5, output="logits",
             tied_to=embed if shape.tie else "")

    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"]) for n in ("input_ids", "attention_mask")]
    outputs = [helper.make_tensor_value_info("logits", onnx_dtype, ["batch", "seq", shape.vocab])]
    graph = helper.make_graph(g.nodes, "main_graph", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                              producer_name="tools/make_decoder.py")
    return model, g.weights


# -- the weights ----------------------------------------------------------------------------------

def _rows(w: Weight) -> tuple[int, int]:
    return (w.shape[0], math.prod(w.shape[1:])) if len(w.shape) > 1 else (1, w.shape[0])


def chunks(w: Weight, seed: int, dtype) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, rows) of ``w`` in chunks of at most :data:`CHUNK` elements (a row at least), each drawn
    from a seed of its own: (``seed``, ``w.name``, the chunk's index)."""
    rows, cols = _rows(w)
    per = max(1, CHUNK // cols)
    key = int.from_bytes(hashlib.sha256(w.name.encode()).digest()[:8], "little")
    for c, r0 in enumerate(range(0, rows, per)):
        n = min(per, rows - r0)
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, key, c])))
        a = rng.standard_normal((n, cols), dtype=np.float32)
        a *= np.float32(w.std)
        if w.mean:
            a += np.float32(w.mean)
        yield r0, a.astype(dtype, copy=False)


def layout(weights: list[Weight], itemsize: int) -> tuple[dict[str, int], int]:
    """({name: offset}, the file's size): tensors one after another, each at a multiple of :data:`ALIGN`."""
    offsets, end = {}, 0
    for w in weights:
        start = -(-end // ALIGN) * ALIGN
        offsets[w.name] = start
        end = start + math.prod(w.shape) * itemsize
    return offsets, end


def _pwrite(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(np.ascontiguousarray(data).view(np.uint8))  # bytes: a buffer of bfloat16 is refused
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def write_data(path: Path, weights: list[Weight], seed: int, dtype: str) -> dict[str, int]:
    """Every weight drawn and written into ``path`` chunk by chunk; returns the offsets."""
    np_dtype = DTYPES[dtype][0]
    item = np.dtype(np_dtype).itemsize
    offsets, size = layout(weights, item)
    tied = {w.tied_to: w for w in weights if w.tied_to}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)  # the gaps between tensors stay zeros
        for w in weights:
            if w.tied_to:
                continue  # written with the tensor it transposes
            _, cols = _rows(w)
            for r0, block in chunks(w, seed, np_dtype):
                _pwrite(fd, block, offsets[w.name] + r0 * cols * item)
                if w.name in tied:  # its transpose [cols, rows]: this chunk is a column band of every row
                    t = tied[w.name]
                    band = np.ascontiguousarray(block.T)
                    for row in range(cols):
                        _pwrite(fd, band[row], offsets[t.name] + (row * w.shape[0] + r0) * item)
    finally:
        os.close(fd)
    return offsets


def attach(model: onnx.ModelProto, weights: list[Weight], offsets: dict[str, int], dtype: str) -> None:
    """The initializers as references into :data:`DATA_NAME` (offset and length)."""
    onnx_dtype = DTYPES[dtype][1]
    item = np.dtype(DTYPES[dtype][0]).itemsize
    for w in weights:
        t = model.graph.initializer.add()
        t.name, t.data_type = w.name, onnx_dtype
        t.dims.extend(w.shape)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", DATA_NAME), ("offset", str(offsets[w.name])), ("length", str(math.prod(w.shape) * item))):
            entry = t.external_data.add()
            entry.key, entry.value = k, v


def make_decoder(out_dir: str | os.PathLike, shape: DecoderShape, *, dtype: str = "float32", seed: int = 0,
                 force: bool = False) -> Path:
    """``out_dir/model.onnx`` and ``out_dir/model.onnx.data``: written under temporary names and renamed at
    the end, so the model is complete or absent. FileExistsError when a model.onnx is there and not ``force``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    out = Path(out_dir)
    target = out / "model.onnx"
    if target.exists() and not force:
        raise FileExistsError(f"{target} already exists (give --force to replace it)")
    model, weights = build(shape, dtype)
    out.mkdir(parents=True, exist_ok=True)
    tmp_data, tmp_model = out / f".{DATA_NAME}.partial", out / ".model.onnx.partial"
    try:
        offsets = write_data(tmp_data, weights, seed, dtype)
        attach(model, weights, offsets, dtype)
        tmp_model.write_bytes(model.SerializeToString())
        target.unlink(missing_ok=True)  # from here until the last rename there is no model.onnx
        os.replace(tmp_data, out / DATA_NAME)
        os.replace(tmp_model, target)
    finally:
        tmp_data.unlink(missing_ok=True)
        tmp_model.unlink(missing_ok=True)
    return target


def parameters(shape: DecoderShape) -> int:
    """The decoder's parameter count (a tied lm_head counted once)."""
    _, weights = build(shape)
    return sum(math.prod(w.shape) for w in weights if not w.tied_to)
