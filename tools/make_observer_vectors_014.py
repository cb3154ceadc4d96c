"""Test vectors for the observers and GPTQ options llm-compressor 0.13-0.14 added, made by llm-compressor itself.

What it computes, with llm-compressor 0.14.0.1's own code on small fixed tensors (CPU, eager, one torch thread):

* observers (``llmcompressor.observers``): the qparams (scale, zero point, global scale) of
  ``memoryless_mse``, ``mse`` and ``imatrix_mse`` with ``expand`` 1.0 and 1.5 over the tensor, channel,
  group, block and tensor_group (NVFP4) strategies, fp32 and bf16 weights; ``mse`` / ``memoryless_mse``
  on activations over several batches (``mse`` moving-averages the searched range);
  ``nvfp4_expanded_mse`` (and its alias ``fouroversix``) and ``nvfp4_expanded_imatrix`` with their
  defaults and with ``expand`` 1.5, on NVFP4 and int4 group weights; ``imatrix_mse`` fed its
  activations in several batches through the forward pre-hook llm-compressor attaches to the Linear
  (the single pass: the weight is observed after the batches), and the same split over two gloo
  ranks (``torch.multiprocessing``, CPU) whose importance sums and counts are all-reduced before the
  weight is observed; the errors an out-of-range ``expand`` gives;
* GPTQ (``llmcompressor.modifiers.gptq.gptq_quantize.quantize_weight``): the rounded weight and the
  loss for a fixed weight and a Hessian accumulated by llm-compressor's ``accumulate_hessian``, on the
  grid of the weight observer, with ``actorder`` static/weight/None on block strategies (divisible
  and not) and on tensor_group; the ``GPTQModifier``'s resolution of a modifier-level ``actorder``
  against a scheme's (``resolve_quantization_config``), errors included, and what ``group`` does.

Tensors are written exactly: float tensors as the int32 bit patterns of their fp32 values (bf16 and
fp8 values are exact in fp32), with their dtype and shape. The output is a Python module
(``tests/observers/llmc014_vectors.py``) read by ``tests/observers/test_llmc014_vectors.py`` and
``tests/algorithms/test_gptq_actorder.py``; the tests do not need llm-compressor.

Usage (a separate virtual environment: llm-compressor pins its own compressed-tensors and transformers)::

    python3 -m venv /tmp/lc
    /tmp/lc/bin/pip install torch==2.13.0 && /tmp/lc/bin/pip install llmcompressor==0.14.0.1
    /tmp/lc/bin/python tools/make_observer_vectors_014.py > tests/observers/llmc014_vectors.py

It takes a minute or two on a CPU. Reference material only: this file runs llm-compressor, it is not
imported by graphcal or its tests.
"""

from __future__ import annotations

import copy
import os
import pprint
import sys
import warnings

import torch

INPUT_FEATURES, OUTPUT_FEATURES = 32, 8


# ---------------------------------------------------------------------------------------------- tensors
def encode(t: torch.Tensor | None):
    """An exact, printable form of a tensor: dtype, shape and the int32 bits of its fp32 values (or ints)."""
    if t is None:
        return None
    dtype = str(t.dtype).removeprefix("torch.")
    if t.is_floating_point():
        return {"dtype": dtype, "shape": list(t.shape), "bits": t.detach().float().contiguous().view(torch.int32).flatten().tolist()}
    return {"dtype": dtype, "shape": list(t.shape), "ints": t.detach().flatten().tolist()}


def weight(rows: int = OUTPUT_FEATURES, cols: int = INPUT_FEATURES, seed: int = 0) -> torch.Tensor:
    """A heavy-tailed weight: every 7th column 4x larger, so that shrinking the range pays on most rows."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[:, ::7] *= 4
    return w


def activations(n: int = 3, seed: int = 1, cols: int = INPUT_FEATURES) -> list[torch.Tensor]:
    """``n`` batches (2, 4, cols) whose channels differ in magnitude (0.1 to 3), so importance is not flat."""
    g = torch.Generator().manual_seed(seed)
    channel = torch.linspace(0.1, 3.0, cols)[torch.randperm(cols, generator=g)]
    return [torch.randn(2, 4, cols, generator=g) * channel * (1 + i) for i in range(n)]


TENSORS = {
    "w": weight(),
    "w_bf16": weight().to(torch.bfloat16),
    "w_gptq": weight(16, INPUT_FEATURES, seed=2),
}
BATCHES = activations()
ACT_BATCHES = [b * 0.5 + 0.1 for b in activations(seed=3)]  # activations observed by input observers

# ---------------------------------------------------------------------------------------------- args
INT8_TENSOR = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor"}
INT8_TENSOR_ASYM = {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "tensor"}
INT4_CHANNEL_ASYM = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "channel"}
INT4_GROUP = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}
INT4_GROUP_ASYM = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 16}
INT8_BLOCK = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "block", "block_structure": [4, 16]}
FP8_CHANNEL = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
NVFP4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
         "scale_dtype": "torch.float8_e4m3fn"}

WEIGHT_ARGS = {
    "int8_tensor": INT8_TENSOR,
    "int4_channel_asym": INT4_CHANNEL_ASYM,
    "int4_group": INT4_GROUP,
    "int4_group_asym": INT4_GROUP_ASYM,
    "int8_block": INT8_BLOCK,
    "fp8_channel": FP8_CHANNEL,
    "nvfp4": NVFP4,
}
BF16_ARGS = ("int4_group", "int4_channel_asym", "nvfp4")


# ---------------------------------------------------------------------------------------------- observers
def _args(fields: dict, observer: str, kwargs: dict):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(**copy.deepcopy(fields), observer=observer, observer_kwargs=dict(kwargs))


def _qparams(q: dict) -> dict:
    return {k: encode(q[k]) for k in ("scale", "zero_point", "global_scale")}


def weight_case(name: str, observer: str, args_name: str, tensor: str, kwargs: dict, batches: list[int] | None = None):
    """One weight observer's qparams; ``batches``: indices of BATCHES fed through the Linear first (imatrix)."""
    from llmcompressor.observers import Observer

    fields = WEIGHT_ARGS[args_name]
    args = _args(fields, observer, kwargs)
    w = TENSORS[tensor]
    case = {"name": name, "observer": observer, "base_name": "weight", "args": fields, "observer_kwargs": kwargs,
            "input": tensor, "batches": batches}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            obs = Observer.load_from_registry(observer, base_name="weight", args=args)
        except Exception as e:  # the error llm-compressor gives (expand below 1)
            case["error"] = f"{type(e).__name__}: {e}"
            return case
        if batches is not None:
            linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
            linear.weight.data = w.clone()
            obs.attach(linear)
            with torch.no_grad():
                for i in batches:
                    linear(BATCHES[i].to(w.dtype))
            obs.detach(linear)
        obs(w)
        case["expected"] = _qparams(obs.get_qparams())
    case["warnings"] = [str(w.message).split(".")[0] for w in caught if issubclass(w.category, UserWarning)]
    return case


def activation_case(name: str, observer: str, fields: dict, kwargs: dict):
    """An input observer over ACT_BATCHES, one call per batch (mse moving-averages the searched ranges)."""
    from llmcompressor.observers import Observer

    args = _args(fields, observer, kwargs)
    obs = Observer.load_from_registry(observer, base_name="input", args=args)
    for b in ACT_BATCHES:
        obs(b)
    return {"name": name, "observer": observer, "base_name": "input", "args": fields, "observer_kwargs": kwargs,
            "input": "act_batches", "batches": None, "expected": _qparams(obs.get_qparams())}


def observer_cases() -> list[dict]:
    cases = []
    for observer in ("memoryless_mse", "mse", "imatrix_mse"):
        for expand in (1.0, 1.5):
            for args_name in WEIGHT_ARGS:
                for tensor in ("w", "w_bf16") if args_name in BF16_ARGS else ("w",):
                    batches = [0, 1, 2] if observer == "imatrix_mse" else None
                    cases.append(weight_case(f"{observer}_x{expand}_{args_name}_{tensor}", observer, args_name, tensor,
                                             {"expand": expand}, batches))
    for observer in ("nvfp4_expanded_mse", "fouroversix", "nvfp4_expanded_imatrix"):
        batches = [0, 1, 2] if "imatrix" in observer else None
        for args_name in ("nvfp4", "int4_group", "int4_group_asym"):
            for tensor in ("w", "w_bf16"):
                cases.append(weight_case(f"{observer}_{args_name}_{tensor}", observer, args_name, tensor, {}, batches))
        cases.append(weight_case(f"{observer}_x1.5_nvfp4_w", observer, "nvfp4", "w", {"expand": 1.5}, batches))
    # imatrix fed one batch, and fed none (uniform fallback: the plain search with imatrix's defaults)
    cases.append(weight_case("imatrix_mse_one_batch_int4_group_w", "imatrix_mse", "int4_group", "w", {}, [2]))
    cases.append(weight_case("imatrix_mse_no_batches_int4_group_w", "imatrix_mse", "int4_group", "w", {}, []))
    # the kwargs of the search itself, through the same path
    cases.append(weight_case("memoryless_mse_x1.2_grid50_patience2_int4_group_w", "memoryless_mse", "int4_group", "w",
                             {"expand": 1.2, "grid": 50, "patience": 2, "maxshrink": 0.5}, None))
    # out-of-range expand: what each observer does with it
    for observer in ("memoryless_mse", "mse", "nvfp4_expanded_mse", "imatrix_mse", "nvfp4_expanded_imatrix"):
        batches = [0, 1, 2] if "imatrix" in observer else None
        cases.append(weight_case(f"{observer}_x0.9_int4_group_w", observer, "int4_group", "w", {"expand": 0.9}, batches))
    for observer in ("memoryless_mse", "mse"):
        for expand in (1.0, 1.5):
            for label, fields in (("int8_tensor", INT8_TENSOR), ("int8_tensor_asym", INT8_TENSOR_ASYM)):
                cases.append(activation_case(f"input_{observer}_x{expand}_{label}", observer, fields, {"expand": expand}))
    return cases


# ---------------------------------------------------------------------------------------------- DDP
DDP_SPLIT = ([0, 1], [2])  # batches seen by rank 0 and rank 1


def _ddp_rank(rank: int, world: int, port: int, queue, observer: str, args_name: str, kwargs: dict) -> None:
    os.dup2(2, 1)  # llm-compressor logs to stdout (on import), where the vectors go
    import torch.distributed as dist
    from llmcompressor.observers import Observer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    w = TENSORS["w"]
    obs = Observer.load_from_registry(observer, base_name="weight", args=_args(WEIGHT_ARGS[args_name], observer, kwargs))
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    linear.weight.data = w.clone()
    obs.attach(linear)
    with torch.no_grad():
        for i in DDP_SPLIT[rank]:
            linear(BATCHES[i])
    obs.detach(linear)
    for work in obs.sync_activation_stats():  # what QuantizationMixin.sync_activation_stats does at epoch end
        work.wait()
    obs(w)
    queue.put((rank, _qparams(obs.get_qparams())))
    dist.barrier()
    dist.destroy_process_group()


def ddp_cases() -> list[dict]:
    import torch.multiprocessing as mp

    cases = []
    for i, (observer, args_name, kwargs) in enumerate([("imatrix_mse", "int4_group", {}),
                                                       ("imatrix_mse", "int4_channel_asym", {"expand": 1.5}),
                                                       ("nvfp4_expanded_imatrix", "nvfp4", {})]):
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_ddp_rank, args=(r, 2, 29400 + i, queue, observer, args_name, kwargs)) for r in range(2)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0, f"rank exited with {p.exitcode}"
        assert results[0] == results[1], "ranks disagree"
        cases.append({"name": f"ddp2_{observer}_{args_name}", "observer": observer, "base_name": "weight",
                      "args": WEIGHT_ARGS[args_name], "observer_kwargs": kwargs, "input": "w",
                      "rank_batches": [list(b) for b in DDP_SPLIT], "expected": results[0]})
    return cases


# ---------------------------------------------------------------------------------------------- GPTQ
GPTQ_ARGS = {
    "int4_block8x8": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "block", "block_structure": [8, 8]},
    "int8_block8x8_asym": {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "block",
                           "block_structure": [8, 8]},
    "int4_block6x12": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "block", "block_structure": [6, 12]},
    "fp8_block8x16": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "block_structure": [8, 16]},
    "nvfp4": NVFP4,
    "int4_group8_asym": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 8},
}


def gptq_hessian() -> torch.Tensor:
    from llmcompressor.modifiers.gptq.helpers import accumulate_hessian, make_empty_hessian

    linear = torch.nn.Linear(INPUT_FEATURES, 16, bias=False)
    hessian = make_empty_hessian(linear)
    samples = torch.zeros(1, dtype=torch.int64)
    for b in BATCHES:
        hessian, samples = accumulate_hessian(b, linear, hessian, samples)
    return hessian / samples  # prepare_batch's normalisation


def gptq_case(name: str, args_name: str, actorder, observer: str = "memoryless_minmax", blocksize: int = 16,
              percdamp: float = 0.01) -> dict:
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
    from llmcompressor.observers import Observer

    fields = dict(GPTQ_ARGS[args_name], actorder=actorder)
    args = QuantizationArgs(**copy.deepcopy(fields))
    w = TENSORS["w_gptq"]
    obs = Observer.load_from_registry(observer, base_name="weight", args=args)
    obs(w)
    q = obs.get_qparams()
    gs = None if q["global_scale"] is None else q["global_scale"].reshape(-1)[0].reshape(1)
    quantized, loss, fallback = quantize_weight(w.clone()[None], TENSORS["hessian"].clone()[None], q["scale"][None],
                                                q["zero_point"][None], gs, args, blocksize=blocksize,
                                                percdamp=percdamp)
    return {"name": name, "args": fields, "observer": observer, "blocksize": blocksize, "percdamp": percdamp,
            "qparams": _qparams(q), "weight": encode(quantized[0]), "loss": float(loss[0]),
            "rtn_fallback": bool(fallback[0])}


def gptq_cases() -> list[dict]:
    cases = []
    for args_name in GPTQ_ARGS:
        for actorder in (None, "static", "weight"):
            cases.append(gptq_case(f"{args_name}_actorder_{actorder}", args_name, actorder))
    cases.append(gptq_case("nvfp4_expanded_mse_grid_actorder_static", "nvfp4", "static", observer="nvfp4_expanded_mse"))
    cases.append(gptq_case("int4_block8x8_actorder_static_bs8_damp0.1", "int4_block8x8", "static", blocksize=8,
                           percdamp=0.1))
    return cases


_UNSET = "<unset>"


def resolution_cases() -> list[dict]:
    """GPTQModifier(actorder=...) against a config group's weights.actorder: what resolve_quantization_config gives."""
    from llmcompressor.modifiers.gptq import GPTQModifier

    cases = []
    for strategy, fields in (("block", GPTQ_ARGS["int4_block8x8"]), ("group", INT4_GROUP), ("channel", FP8_CHANNEL)):
        for modifier in (_UNSET, None, "static", "weight", "group", "dynamic"):
            for scheme in (_UNSET, None, "static", "weight"):
                weights = dict(fields)
                if scheme != _UNSET:
                    weights["actorder"] = scheme
                kwargs = {"config_groups": {"g": {"targets": ["Linear"], "weights": weights}}}
                if modifier != _UNSET:
                    kwargs["actorder"] = modifier
                case = {"strategy": strategy, "modifier": modifier, "scheme": scheme}
                try:
                    config = GPTQModifier(**kwargs).resolve_quantization_config()
                    value = config.config_groups["g"].weights.actorder
                    case["actorder"] = None if value is None else getattr(value, "value", value)
                except Exception as e:
                    case["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if isinstance(e, ValueError) else e}"
                cases.append(case)
    return cases


def group_behaviour() -> dict:
    """What actorder group does: in a scheme, at the modifier level, and at quantize time."""
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.gptq.helpers import apply_activation_ordering

    out = {}
    for value in ("group", "dynamic", True):
        try:
            QuantizationArgs(num_bits=4, strategy="group", group_size=16, actorder=value)
            out[f"args_{value}"] = "accepted"
        except Exception as e:
            out[f"args_{value}"] = f"{type(e).__name__}: " + next(
                line.strip() for line in str(e).splitlines() if "actorder" in line and "Value error" in line)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        modifier = GPTQModifier(scheme="W4A16", actorder="group")
        config = modifier.resolve_quantization_config()
    value = config.config_groups["group_0"].weights.actorder
    out["modifier_group_resolves_to"] = getattr(value, "value", value)
    out["modifier_group_warnings"] = [str(w.message) for w in caught]
    try:
        apply_activation_ordering(torch.zeros(1, 2, 2), torch.eye(2)[None], config.config_groups["group_0"].weights.actorder)
        out["quantize_group"] = "accepted"
    except Exception as e:
        out["quantize_group"] = f"{type(e).__name__}: {e}"
    return out


# ---------------------------------------------------------------------------------------------- main
def compute() -> dict:
    import compressed_tensors
    import llmcompressor

    TENSORS["hessian"] = gptq_hessian()
    return {
        "meta": {"llmcompressor": llmcompressor.__version__, "compressed_tensors": compressed_tensors.__version__,
                 "torch": torch.__version__, "python": sys.version.split()[0], "torch_threads": 1, "device": "cpu"},
        "tensors": {k: encode(v) for k, v in TENSORS.items()},
        "batches": [encode(b) for b in BATCHES],
        "act_batches": [encode(b) for b in ACT_BATCHES],
        "observers": observer_cases(),
        "ddp": ddp_cases(),
        "gptq": gptq_cases(),
        "actorder_resolution": resolution_cases(),
        "actorder_group": group_behaviour(),
    }


def main() -> None:
    torch.set_num_threads(1)
    stdout = os.dup(1)
    os.dup2(2, 1)  # llm-compressor logs to stdout (on import too), where the vectors go
    try:
        vectors = compute()
    finally:
        sys.stdout.flush()
        os.dup2(stdout, 1)
    print('"""llm-compressor 0.14.0.1\'s own numbers for its new observers and GPTQ actorder options.\n\n'
          "Generated by tools/make_observer_vectors_014.py (see there); do not edit. Float tensors are stored as the\n"
          'int32 bits of their fp32 values."""\n')
    print("# ruff: noqa: E501")
    print("VECTORS = " + pprint.pformat(vectors, width=140, compact=True, sort_dicts=False))


if __name__ == "__main__":
    main()
