"""The click options and the config resolution that several verbs share: run and inspect take the same
options (CONFIG_OPTIONS, PASS_OPTIONS), so they are listed once here and cannot drift apart."""

from __future__ import annotations

import math
from pathlib import Path

import click

from graphcal.errors import shown


class Refused(click.BadParameter):
    """A flag's value refused at parse time, shown as graphcal's errors are: one ``error:`` line
    naming the flag (exit 2), without click's usage lines."""

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", file=file, err=True)


class OneLineUsage(click.UsageError):
    """click's own refusals (an unknown flag, a missing argument, a bad choice or count), shown as
    graphcal's errors are: one ``error:`` line (exit 2), without click's usage lines."""

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", file=file, err=True)


def _in_one_line(parse, ctx, *args):
    """``parse(ctx, *args)``, click's own refusals turned into :class:`OneLineUsage`."""
    try:
        return parse(ctx, *args)
    except click.UsageError as e:
        if isinstance(e, (Refused, OneLineUsage)):
            raise
        raise OneLineUsage(e.format_message(), ctx) from None


class OneLineCommand(click.Command):
    """A verb whose command-line refusals are one line (:class:`OneLineUsage`)."""

    def parse_args(self, ctx, args):
        return _in_one_line(super().parse_args, ctx, args)


class OneLineGroup(click.Group):
    """The verbs' group: an unknown verb or group flag is refused in one line, and its verbs are
    :class:`OneLineCommand`."""

    command_class = OneLineCommand

    def parse_args(self, ctx, args):
        return _in_one_line(super().parse_args, ctx, args)

    def resolve_command(self, ctx, args):
        return _in_one_line(super().resolve_command, ctx, args)


class OneLine:
    """Mixed into a click type: its refusals are :class:`Refused` (one ``error:`` line, exit 2)."""

    def fail(self, message, param=None, ctx=None):
        raise Refused(message, ctx, param)


class OneOf(OneLine, click.Choice):
    """click.Choice, refused in one line."""


class Index(OneLine, click.IntRange):
    """An integer from 0, refused in one line."""

    name = "integer"

    def __init__(self):
        super().__init__(min=0)


class AccuracyLevel(OneLine, click.ParamType):
    """--matmulnbits' value: an accuracy level 0..4, or ``off``."""

    name = "0..4|off"

    def convert(self, value, param, ctx):
        if value == "off" or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 4):
            return value
        if isinstance(value, str) and value in ("0", "1", "2", "3", "4"):
            return int(value)
        self.fail(f"{value!r} is not an accuracy level 0..4 or off", param, ctx)


class Number(click.ParamType):
    """A number flag's value, refused at parse time in one ``error:`` line (:class:`Refused`) when it is not a
    finite number from ``low`` to ``high`` (an ``open`` end excluded; None: unbounded): NaN, inf,
    ``1e400`` and values past the range a flag means never reach the command."""

    name = "number"

    def __init__(self, low: float | None = None, high: float | None = None, *, low_open: bool = False,
                 high_open: bool = False):
        self.low, self.high, self.low_open, self.high_open = low, high, low_open, high_open

    def convert(self, value, param, ctx):
        try:
            number = float(value.strip() if isinstance(value, str) else value)
        except (TypeError, ValueError):
            raise Refused(f"{shown(str(value))!r} is not a number", ctx, param) from None
        if not math.isfinite(number):
            raise Refused(f"{shown(str(value))!r} is not a finite number", ctx, param)
        too_low = self.low is not None and (number <= self.low if self.low_open else number < self.low)
        too_high = self.high is not None and (number >= self.high if self.high_open else number > self.high)
        if too_low or too_high:
            raise Refused(f"{number:g} is out of range: it must be {self.range_text()}", ctx, param)
        return number

    def range_text(self) -> str:
        ends = []
        if self.low is not None:
            ends.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            ends.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        return " and ".join(ends) or "finite"


def options(*options):
    """Apply click options in the order listed (a shared list, so commands cannot drift apart)."""
    def apply(command):
        for option in reversed(options):
            command = option(command)
        return command

    return apply


def data_option(required: bool):
    return click.option("--data", "-d", required=required, type=click.Path(path_type=Path),
                        help="Calibration data: an .npz keyed by the model's input names (first dim = samples), "
                             "or a folder of .npz files." + ("" if required else " inspect checks its headers "
                                                             "against the model's inputs, reading no samples."))


def output_option(required: bool):
    return click.option("--output", "-o", required=required, type=click.Path(file_okay=False, path_type=Path),
                        help="Folder for model.onnx, quantization_config.json and qparams.safetensors."
                             + ("" if required else " inspect checks that run could write there."))


MAX_MB = 1e9  # a petabyte: more than any size or memory flag in MB can mean (and x 1e6 stays finite)

# The options that say what a run does: run and inspect take exactly these.
CONFIG_OPTIONS = (
    click.option("--scheme", "-s", default=None,
                 help="compressed-tensors preset: W8A8 (the default: int8 per-channel weights + dynamic per-token "
                      "int8 activations), W8A16, W4A16, W4A16_ASYM, W4A8, FP8, FP8_DYNAMIC, FP8_BLOCK, NVFP4A16, "
                      "NVFP4, MXFP4A16; graphcal's W8A8_STATIC (int8 static per-tensor activations, for TensorRT); "
                      "or JSON QuantizationScheme fields."),
    click.option("--targets", "targets", multiple=True,
                 help="What to quantize: module names, 're:' regexes, or Linear (every weight MatMul/Gemm; the "
                      "default). Repeatable."),
    click.option("--ignore", multiple=True,
                 help="Modules to leave in float: names or 're:' regexes (default: lm_head). Repeatable; giving it "
                      "replaces the default."),
    click.option("--scheme-for", "scheme_for", multiple=True, metavar="TARGET=SCHEME",
                 help="Another scheme for some modules, as a recipe's config_groups give one: TARGET is a module "
                      "name, a 're:' regex, Linear or Embedding (every embedding lookup, which takes weight-only "
                      "schemes), SCHEME a preset or JSON. The most specific target wins (name, then regex, then "
                      "class). Repeatable; e.g. --scheme W4A16 --scheme-for 're:.*down_proj$=W8A16' "
                      "--scheme-for Embedding=W4A16."),
    click.option("--lm-head", "lm_head", is_flag=True, default=None,
                 help="Quantize lm_head too (llm-compressor leaves it in float: it is dropped from --ignore). A "
                      "lookup tied to it (--scheme-for Embedding=...) then reads its quantized weight: one table."),
    click.option("--rotate", is_flag=False, flag_value="R1,R2", default=None, metavar="[R1|R1,R2]",
                 help="Fold rotations in first (SpinQuant's names; the flag alone: R1,R2, its default). R1 (QuaRot's "
                      "too): an orthogonal matrix (Hadamard where the hidden size allows) on the residual stream, "
                      "folded into the embedding, the weights reading and writing it and lm_head, each RMS norm's "
                      "scale into the weights after it. R2: each value head and o_proj's rows for it, around "
                      "GroupQueryAttention over a packed qkv_proj. The fp32 model's logits do not change; outlier "
                      "channels are spread. A table tied to lm_head stays tied where lm_head reads it as stored (a small "
                      "MatMul before lm_head takes the final norm's scale), else is untied (run says what that costs). "
                      "Pre-norm "
                      "decoders only (docs/rotation.md)."),
    click.option("--observer", default=None,
                 help="Observer for weights and observed activations (memoryless_minmax, static_minmax, minmax, "
                      "mse, ...; graphcal's histogram observers for per-tensor activations: percentile, entropy, "
                      "histogram_mse, whose weights take min/max or the exact MSE); default: llm-compressor's "
                      "choice for the scheme. Observer kwargs (e.g. expand) go in a JSON --scheme's "
                      "observer_kwargs, which --observer keeps."),
    click.option("--kv-cache-scheme", "kv_cache", default=None,
                 help="Quantize the key/value states entering attention (llm-compressor's kv_cache_scheme): FP8, "
                      "INT8 (static per tensor) or JSON QuantizationArgs fields, e.g. "
                      "'{\"num_bits\": 8, \"type\": \"float\", \"strategy\": \"attn_head\"}'."),
    click.option("--recipe", type=click.Path(dir_okay=False, path_type=Path), default=None,
                 help="llm-compressor recipe (YAML) holding a QuantizationModifier (scheme or config_groups, targets, "
                      "ignore, observer fields, kv_cache_scheme), optionally after a SmoothQuantModifier "
                      "(smoothing_strength, mappings, ignore, algorithm). --scheme, --targets, --ignore, --observer and "
                      "--kv-cache-scheme, --smoothquant and --smoothing-strength given on the command line override it."),
    click.option("--target", "target_runtime", type=click.Choice(["onnxruntime", "tensorrt", "qdq"]), default="onnxruntime",
                 show_default=True,
                 help="Runtime the model is for. onnxruntime: compressed-tensors' numbers in forms onnxruntime's "
                      "optimizer turns into integer kernels, loading at its default ORT_ENABLE_ALL (no fp4). "
                      "tensorrt: only what TensorRT builds (symmetric, static per-tensor int8/fp8 activations, int4 "
                      "blocks of 64/128, NVFP4 through trt::TRT_FP4DynamicQuantize). qdq: standard Q/DQ written "
                      "literally, for other runtimes and readers (fp4 included)."),
    click.option("--smoothquant", type=click.Choice(["norms", "all", "mul"]), is_flag=False, flag_value="norms",
                 default=None, metavar="[norms|all|mul]",
                 help="Smooth activation outliers into the weights first, as llm-compressor's SmoothQuantModifier "
                      "does (per input channel s = range(x)^a / (2 max|W|)^(1-a)). norms (the flag alone): fold s "
                      "into the norms and constant scales before the MatMuls (llm-compressor's q/k/v and gate/up "
                      "mappings; no node added); all: also into linear layers (up_proj -> down_proj); mul: also an "
                      "explicit Mul(x, 1/s) where no fold is exact (post-LN encoders such as BERT; one elementwise "
                      "Mul per smoothed tensor at inference). Costs one extra pass over the data."),
    click.option("--smoothing-strength", default=None, metavar="ALPHA|auto",  # checked as a recipe's (config)
                 help="SmoothQuant's migration strength a (default 0.5, llm-compressor's); implies --smoothquant. "
                      "auto (graphcal's extension): for each smoothed activation, the strength of 0.1, 0.2, ..., 1.0 "
                      "whose smoothing quantizes its layers' outputs best on a sample of the calibration rows."),
    click.option("--algorithm", type=click.Choice(["gptq", "awq", "awq+gptq"]), default=None,
                 help="How weights are rounded (default: to nearest, with the scheme's observer). gptq: "
                      "llm-compressor's GPTQModifier (each layer's rounding error corrected with its inputs' "
                      "Hessian); awq: its AWQModifier (per input channel scales searched on the parent block's "
                      "output error, folded into the norm or linear layer before; no node added); awq+gptq: both."),
    click.option("--group-size", type=click.IntRange(min=1), default=None,
                 help="Group size of the scheme's group/tensor_group weights (e.g. 64 where 128 does not divide a "
                      "layer's input features)."),
    click.option("--block-size", type=click.IntRange(min=1), default=None,
                 help="GPTQ: columns per lazy-update block (default 128)."),
    click.option("--dampening-frac", type=Number(0), default=None,
                 help="GPTQ: dampening added to the Hessian's diagonal, as a fraction of its mean (default 0.01)."),
    click.option("--actorder", type=click.Choice(["static", "weight", "none"]), default=None,
                 help="GPTQ: activation ordering (default static, llm-compressor's, unless the scheme sets one; a "
                      "value other than the scheme's is refused, as llm-compressor 0.14 refuses it; group is not "
                      "supported, as in llm-compressor 0.14)."),
    click.option("--gptq-order", type=click.Choice(["sequential", "one-pass"]), default=None,
                 help="GPTQ: sequential (the default, llm-compressor's): layer block by layer block, each block's "
                      "Hessians from the already-quantized blocks before it (two passes over the data in all); "
                      "one-pass: every Hessian from the one calibration pass over the float model (faster; every "
                      "Hessian held at once)."),
    click.option("--duo-scaling", type=click.Choice(["true", "false", "both"]), default=None,
                 help="AWQ: search scales from activation and weight means (true, the default), activations only "
                      "(false), or both grids."),
    click.option("--n-grid", type=click.IntRange(min=1), default=None,
                 help="AWQ: grid points searched per mapping (default 20)."),
    click.option("--awq-samples", type=click.IntRange(min=1), default=None, metavar="N",
                 help="AWQ: score each grid point's parent (the attention, or gate/up's MLP) on about N samples "
                      "spread over the data instead of all of them (llm-compressor's); the means and one-layer "
                      "parents still use every token. Cost: the parents run 1 + n_grid times on N samples."),
    click.option("--awq-clip/--no-awq-clip", default=None,
                 help="AWQ: after the scales, clip each layer's weights per row and group where that lowers the "
                      "layer's output error (the original AWQ's clip search, scored on every token from the input's "
                      "Gram matrix; each end of an asymmetric grid on its own; q and k included; integer channel or "
                      "group weights). Off by default, as in "
                      "llm-compressor."),
    click.option("--matmulnbits", type=AccuracyLevel(), is_flag=False, flag_value=4, default=None,
                 metavar="[LEVEL|off]",
                 help="--target onnxruntime: write integer weights as com.microsoft.MatMulNBits (as onnxruntime-genai "
                      "models have them) with this accuracy_level (default 4: the kernel quantizes the input to int8 "
                      "per block of K; 0: float input, the DequantizeLinear form's numbers). Not given, an "
                      "onnxruntime-genai model (genai_config.json beside it) has its weight-only integer layers "
                      "written so, at the level its builder writes (4 on the CPU, 0 on CUDA); off: DequantizeLinear."),
)
PASS_OPTIONS = (
    click.option("--batch-size", type=click.IntRange(min=1), default=None,
                 help="Samples per onnxruntime run (default: the model's fixed batch, else 8)."),
    click.option("--num-samples", type=click.IntRange(min=1), default=None, help="Use at most this many samples."),
    click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
                 help="Where onnxruntime and the observers run; auto picks CUDA when a GPU is usable."),
    click.option("--skip-nonfinite-weights", is_flag=True,
                 help="Leave layers whose weight holds NaN or Inf in float (with a warning) instead of failing."),
    click.option("--exclude-padding", is_flag=True,
                 help="Leave positions where the data's attention_mask is 0 (padding, as graphcal export --text "
                      "writes it) out of the activation statistics; activations not shaped [batch, seq, ...] "
                      "(key/value states, 2-D inputs) are observed whole, with a warning. Needs an attention_mask "
                      "input; the taps then leave onnxruntime whole. run always prints the share of padding."),
    click.option("--tap-limit-mb", type=Number(1, MAX_MB), default=None, metavar="MB",
                 help="At most this many MB of activations tapped whole (mse and imatrix observers, "
                      "--exclude-padding) held per batch; past it the data runs once per share of them, each pass "
                      "computing only what its share needs (default 1024)."),
    click.option("--pass", "pass_mode", type=click.Choice(["auto", "blocks", "whole-graph"]), default="auto",
                 show_default=True,
                 help="How the activation pass runs: blocks streams a decoder one layer block at a time (memory of "
                      "one block, its weights read as it runs); whole-graph runs one onnxruntime session over the "
                      "whole model; auto streams where the targets form layer blocks."),
    click.option("--cache-mb", type=Number(0, MAX_MB), default=None, metavar="MB",
                 help="The streamed pass, sequential GPTQ and AWQ: hold at most this many MB of the tensors cached between layer "
                      "blocks in memory, and the rest on disk in a temporary folder beside -o, removed at the end "
                      "(default: half the memory available when the walk starts; 0: all on disk)."),
    click.option("--ignore-memory-check", is_flag=True,
                 help="Run even when the peak memory estimated before any weight is read exceeds the memory "
                      "available (inspect shows the estimate)."),
)
# run --size-budget / --target-kl (graphcal.budget); inspect takes them too, and plans the low form they start from
BUDGET_OPTIONS = (
    click.option("--size-budget", "size_budget", type=Number(0, MAX_MB, low_open=True), default=None, metavar="MB",
                 help="Choose each layer's form within this size of model files: the low form (the flags', else int4 "
                      "with zero points in groups of 64 by GPTQ, lm_head and the embedding too) and int8 weights, "
                      "layer by layer by the next-token KL on the last --mix-samples samples, held out; writes the mix "
                      "and measures it (docs/budget.md)."),
    click.option("--target-kl", "target_kl", type=Number(0), default=None, metavar="NATS",
                 help="Instead of --size-budget: the fewest int8 layers that bring the mean next-token KL against fp32 "
                      "on the held-out samples to NATS."),
    click.option("--mix-samples", type=click.IntRange(min=1), default=None, metavar="N",
                 help="With --size-budget or --target-kl: the last N calibration samples, held out to choose and "
                      "measure the mix on  [default: 4]."),
)

DEBUG_OPTION = click.option("--debug", is_flag=True, help="Show Python tracebacks on errors.")


#: a click parameter's name -> the graphcal.Options field it sets, where the two differ
FIELD_OF_FLAG = {"target_runtime": "target"}
#: the repeatable flags: a tuple of what was given, None when none was
REPEATABLE = ("targets", "ignore", "scheme_for")


def options_from_flags(flags: dict, **more):
    """The one record (graphcal.Options) from run's and inspect's CONFIG_OPTIONS and PASS_OPTIONS, by
    click parameter name; ``more``: the fields the command sets itself (run's progress)."""
    from graphcal.config import Options  # lazy: loads torch and onnx; graphcal --help stays fast

    fields = {FIELD_OF_FLAG.get(name, name): value for name, value in flags.items()}
    for name in REPEATABLE:
        fields[name] = tuple(fields[name]) or None
    return Options(**fields, **more)
