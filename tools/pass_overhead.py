#!/usr/bin/env python
"""The activation pass's cost per batch against plain inference, side by side in one process.

    python tools/pass_overhead.py                                  # tiny-llama, 256 samples of 32 tokens, CPU
    python tools/pass_overhead.py --model bench-decoder --samples 512 --device cuda
    python tools/pass_overhead.py --observer mse                   # or histogram_mse, percentile, entropy

Three things run over the same batches, interleaved ``--repeat`` times (the best of each is kept):

- ``floor``: the model in a plain onnxruntime session (ORT_ENABLE_BASIC, ``session.run``), as
  tools/bench.py's floor;
- ``tapped``: graphcal's tapped graph for the scheme (graph.taps.build_tapped, as the pass builds it)
  run through graphcal's runtime (IOBinding, taps handed to torch), the taps discarded: what the
  extra outputs and in-graph reductions cost;
- ``pass``: graphcal's whole activation pass (calibration.activations.run_activation_pass) with the
  scheme's observers, nothing else of a run (no weight pass, no writing).

Each is timed over every batch and over the first ``--base`` batches: the difference, per batch,
is what each further batch costs (the issue's "each sample past the first 64"), without the fixed
costs (sessions opened, the pass's set-up). Then the pass runs once more, untimed, and counts per batch the host syncs (``Tensor.item``, ``__bool__``,
``__float__``, ``__int__``, ``tolist``, ``cpu``, ``numpy`` called on a tensor) and the torch
(aten) ops the pass launches. Data: seeded random token ids (tools/lib/synthetic.make_data).
The bench decoder is made by ``tools/make_models.py --bench-decoder DIR`` (``--decoder-dir``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: model name -> (path, vocabulary, sequence length); None: made in --decoder-dir
MODELS = {"tiny-llama": (REPO / "models" / "tiny-llama" / "model.onnx", 256, 32),
          "bench-decoder": (None, 1024, 512)}
#: Tensor methods that bring a value to the host (a device sync on CUDA)
SYNCS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu", "numpy")


@contextlib.contextmanager
def count_syncs(counts: Counter):
    """Count, in ``counts`` by method name, every call of a :data:`SYNCS` method of a tensor."""
    import torch

    saved = {name: getattr(torch.Tensor, name) for name in SYNCS}
    own = {name for name in SYNCS if name in vars(torch.Tensor)}  # the others are torch._C.TensorBase's

    def wrap(name, method):
        def counted(self, *args, **kwargs):
            counts[name] += 1
            return method(self, *args, **kwargs)
        return counted

    for name, method in saved.items():
        setattr(torch.Tensor, name, wrap(name, method))
    try:
        yield counts
    finally:
        for name, method in saved.items():
            if name in own:
                setattr(torch.Tensor, name, method)
            else:
                delattr(torch.Tensor, name)


def count_ops(counts: Counter):
    """A TorchDispatchMode counting, in ``counts``, every aten op dispatched under it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    return Ops()


def measure(model: Path, vocab: int, seq: int, samples: int, batch: int, device: str, scheme: str,
            observer: str | None, reduce_in_graph: bool, repeat: int, base: int) -> dict:
    import numpy as np
    import onnx
    import onnxruntime as ort
    import torch

    from graphcal.calibration.activations import run_activation_pass
    from graphcal.calibration.observe import ObserverSet
    from graphcal.calibration.prepare import prepare
    from graphcal.config import Options, resolve
    from graphcal.data import graph_inputs, load_data
    from graphcal.graph.blocks import needed_initializers
    from graphcal.graph.taps import build_tapped
    from graphcal.runtime import open_runtime
    from tools.lib.synthetic import make_data

    graph = onnx.load(str(model), load_external_data=False).graph
    weights = {i.name for i in graph.initializer}
    names = [i.name for i in graph.input if i.name not in weights]
    data = make_data(names, vocab, samples, seq, seed=4242)
    config = resolve(Options(scheme=scheme, observer=observer))
    ready = prepare(model, config, data=data, batch_size=batch, device=device, reduce_in_graph=reduce_in_graph)
    run, loaded = ready.plan, ready.loaded
    base = max(1, min(base, samples // batch - 1))  # batches of the short run the marginal cost is taken against
    calibs = {"all": ready.calib, "base": load_data({k: v[:base * batch] for k, v in data.items()},
                                                    graph_inputs(loaded.model), batch_size=batch)}
    batches = [{k: np.ascontiguousarray(v[i:i + batch]) for k, v in data.items()} for i in range(0, samples, batch)]
    counts = {"all": len(batches), "base": base}

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
    if device == "cuda" and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    floor = ort.InferenceSession(str(model), opts, providers=providers)
    if floor.get_providers()[0] != providers[0]:
        raise SystemExit(f"the floor runs on {floor.get_providers()[0]}, not {providers[0]}")

    observers = ObserverSet(run, {})
    requests = observers.requests(reduce_in_graph)
    tapped = build_tapped(loaded.model, requests, dict(loaded.types), keep_outputs=False)
    runtime = open_runtime(tapped.model, tapped.fetch, device, external_folder=run.base_dir,
                           weights=needed_initializers(tapped.model, loaded.model), priority_order=True)

    def sync():
        if device == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize()

    def run_floor(share):
        for feeds in batches[:counts[share]]:
            floor.run(None, feeds)

    def run_tapped(share):
        for feeds in batches[:counts[share]]:
            values = runtime.run({k: v for k, v in feeds.items() if k in runtime.inputs})
            del values
        sync()

    def run_pass(share):  # the whole pass: its session opened, every batch fed, the session closed
        run_activation_pass(run, loaded, ObserverSet(run, {}), calibs[share], device=device, inputs=ready.inputs,
                            reduce_in_graph=reduce_in_graph)
        sync()

    steps = {"floor": run_floor, "tapped": run_tapped, "pass": run_pass}
    times = {(label, share): [] for label in steps for share in counts}
    for step in steps.values():  # warm-up: sessions, allocators, caches
        step("base")
    for _ in range(repeat):
        for share in counts:
            for label, step in steps.items():
                start = time.perf_counter()
                step(share)
                times[label, share].append(time.perf_counter() - start)
    runtime.close()

    syncs, ops = Counter(), Counter()
    with count_syncs(syncs), count_ops(ops):  # the pass once more, untimed: what it does per batch
        run_pass("all")
    with count_syncs(base_syncs := Counter()), count_ops(base_ops := Counter()):
        run_pass("base")
    best = {key: min(v) for key, v in times.items()}
    more = counts["all"] - counts["base"]
    # each batch past the base's: its cost, without the fixed costs (sessions, the pass's set-up)
    marginal = {label: 1e3 * (best[label, "all"] - best[label, "base"]) / more for label in steps}
    return {"model": str(model), "device": device, "provider": runtime.provider, "scheme": scheme,
            "observer": observer or "default", "reduce_in_graph": reduce_in_graph, "samples": samples,
            "batch": batch, "batches": counts["all"], "base_batches": counts["base"], "taps": len(requests),
            "fetched": len(tapped.fetch),
            "seconds": {label: best[label, "all"] for label in steps},
            "vs_floor": {label: best[label, "all"] / best["floor", "all"] for label in steps},
            "ms_per_batch": marginal,
            "marginal_vs_floor": {label: v / marginal["floor"] for label, v in marginal.items()},
            "overhead_ms_per_batch": {"tapped graph": marginal["tapped"] - marginal["floor"],
                                      "pass beyond the tapped graph": marginal["pass"] - marginal["tapped"],
                                      "pass": marginal["pass"] - marginal["floor"]},
            "syncs_per_batch": (sum(syncs.values()) - sum(base_syncs.values())) / more,
            "syncs": dict(syncs - base_syncs),
            "torch_ops_per_batch": (sum(ops.values()) - sum(base_ops.values())) / more,
            "top_ops": {k: round(v / more, 1) for k, v in (ops - base_ops).most_common(8)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama", help=f"{' | '.join(MODELS)} | a path to an .onnx decoder "
                                                           "taking input_ids (and attention_mask)")
    ap.add_argument("--vocab", type=int, help="token ids below this (default: the named model's vocabulary; 256)")
    ap.add_argument("--seq", type=int, help="tokens per sample (default: the named model's; 32)")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--scheme", default="W8A8_STATIC")
    ap.add_argument("--observer", help="the activation observer (default: the scheme's, static_minmax)")
    ap.add_argument("--whole", action="store_true", help="fetch whole tensors (reduce_in_graph=False)")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved timings of each; the best is kept")
    ap.add_argument("--base", type=int, default=2, help="batches of the short run whose time is taken off, so "
                                                         "that the per-batch costs leave the fixed ones out")
    ap.add_argument("--decoder-dir", type=Path, default=Path(tempfile.gettempdir()) / "graphcal-bench-decoder")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    path, vocab, seq = MODELS.get(args.model, (Path(args.model), 256, 32))
    if args.model == "bench-decoder":
        path = args.decoder_dir / "model.onnx"
        if not path.exists():
            from tools.lib.synthetic import make_bench_decoder

            make_bench_decoder(args.decoder_dir)
    result = measure(Path(path), args.vocab or vocab, args.seq or seq, args.samples, args.batch_size, args.device,
                     args.scheme, args.observer, not args.whole, args.repeat, args.base)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    ms, ratio, over = result["ms_per_batch"], result["vs_floor"], result["overhead_ms_per_batch"]
    print(f"{result['model']} on {result['provider']}: {result['samples']} samples in {result['batches']} batches of "
          f"{result['batch']}; {result['scheme']}, observer {result['observer']}, {result['taps']} taps "
          f"({result['fetched']} outputs fetched)")
    print(f"  (per batch: each batch past the first {result['base_batches']}, fixed costs left out)")
    for label in ("floor", "tapped", "pass"):
        print(f"  {label:7s} {result['seconds'][label]:8.3f} s  {ratio[label]:5.2f}x the floor   per batch "
              f"{ms[label]:8.3f} ms  {result['marginal_vs_floor'][label]:5.2f}x the floor's")
    for label, value in over.items():
        print(f"  overhead per batch, {label}: {value:.3f} ms")
    print(f"  host syncs per batch: {result['syncs_per_batch']:.1f} {result['syncs']}")
    print(f"  torch ops per batch: {result['torch_ops_per_batch']:.1f} (most: {result['top_ops']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
