"""bench's text report: the timing table, sizes, peak memory, kernel counts and, with --layers, every layer's kernel."""

from __future__ import annotations

from graphcal.bench.report import MODELS, OPTIMIZATION, BenchReport, GenaiLoop, summarize
from graphcal.limits import format_size


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 10 else f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def _genai_lines(loop: GenaiLoop) -> list[str]:
    """onnxruntime-genai's loop: one line when skipped, else its setting and a row per model."""
    if loop.skipped is not None:
        return ["", f"{'genai loop':<16} skipped: {loop.skipped}"]
    lines = ["", f"{'genai loop':<16} onnxruntime-genai {loop.version or '?'} on {loop.provider}, greedy: a prompt of "
                 f"{loop.prompt_tokens} tokens, {loop.new_tokens} new; {loop.rounds} rounds, the order flipped every round",
             f"{'':<16} {'model':<10} {'TTFT ms':>10} {'p10-p90 ms':>19} {'ms/token':>10} {'p10-p90 ms':>19} "
             f"{'decode tokens/s':>16}"]
    for label in MODELS:
        t = getattr(loop, label).as_dict()
        per_token = "-" if t["decode_median_s"] is None else _ms(t["decode_median_s"])
        spread = "-" if t["decode_median_s"] is None else _ms(t["decode_p10_s"]) + "-" + _ms(t["decode_p90_s"])
        short = f" (only {t['generated_tokens']} generated)" if t["generated_tokens"] < loop.new_tokens else ""
        lines.append(f"{'':<16} {label:<10} {_ms(t['ttft_median_s']):>10} "
                     f"{_ms(t['ttft_p10_s']) + '-' + _ms(t['ttft_p90_s']):>19} {per_token:>10} {spread:>19} "
                     f"{_rate(t['decode_tokens_per_s']):>16}{short}")
    decode = "-" if loop.decode_ratio is None else f"{loop.decode_ratio:.2f}x"
    lines.append(f"{'':<16} {'ratio':<10} TTFT {loop.ttft_ratio:.2f}x, time per decoded token {decode}  "
                 "(quantized / reference median; below 1 = faster)")
    return lines


def format_text(report: BenchReport, layers: bool = False) -> str:
    cpus = f"{report.cpu_count} CPUs" + (f" ({report.usable_cpus} usable)" if report.usable_cpus not in
                                          (None, report.cpu_count) else "")
    lines = [f"onnxruntime {report.onnxruntime} on {report.provider}, {cpus}; default session options "
             f"({OPTIMIZATION}); {report.warmup} warm-up runs, {report.rounds} interleaved rounds",
             f"reference: {report.reference.path}", f"quantized: {report.quantized.path}", ""]
    w = max([16] + [len(shape.title) + 1 for shape in report.shapes if shape.skipped is None])
    head = f"{'shape':<{w}} {'model':<10} {'median ms':>10} {'p10-p90 ms':>19} {'min-max ms':>19} {'samples/s':>11} {'tokens/s':>11}"
    lines.append(head)
    for shape in report.shapes:
        title = shape.title
        if shape.skipped is not None:
            lines.append(f"{title:<{w}} skipped: {shape.skipped}")
            continue
        for i, label in enumerate(MODELS):
            t = getattr(shape, label).as_dict()
            lines.append(f"{title if i == 0 else '':<{w}} {label:<10} {_ms(t['median_s']):>10} "
                         f"{_ms(t['p10_s']) + '-' + _ms(t['p90_s']):>19} {_ms(t['min_s']) + '-' + _ms(t['max_s']):>19} "
                         f"{_rate(t['samples_per_s']):>11} {_rate(t['tokens_per_s']):>11}")
        lines.append(f"{'':<{w}} {'ratio':<10} {shape.ratio:>9.2f}x  (quantized / reference median; below 1 = faster)")
    if report.genai_loop is not None:
        lines += _genai_lines(report.genai_loop)
    lines.append("")
    ref, quant = report.reference, report.quantized
    lines.append(f"{'size':<16} reference {format_size(ref.size)}, quantized {format_size(quant.size)} "
                 f"({quant.size / ref.size:.2f}x)")
    if report.memory_skipped is not None:
        lines.append(f"{'peak host memory':<16} not measured ({report.memory_skipped})")
    else:
        lines.append(f"{'peak host memory':<16} " + ", ".join(
            f"{label} {format_size(m['peak_rss_bytes'])} (+{format_size(m['increase_bytes'])} over imports)"
            for label, m in (("reference", ref.memory), ("quantized", quant.memory))))
        if ref.memory["device_bytes"] is not None and quant.memory["device_bytes"] is not None:
            lines.append(f"{'GPU memory':<16} " + ", ".join(
                f"{label} {format_size(m['device_bytes'])}"
                + (f" (+{format_size(m['device_increase_bytes'])} over the CUDA context)"
                   if m["device_increase_bytes"] is not None else "")
                for label, m in (("reference", ref.memory), ("quantized", quant.memory))))
        elif report.device == "cuda":
            lines.append(f"{'GPU memory':<16} {quant.memory['device']}")
    for i, label in enumerate(MODELS):
        summary = summarize(getattr(report, label).layers, report.provider)
        text = ", ".join(f"{k}: {v}" for k, v in summary.items()) or "no weight MatMul/Gemm"
        lines.append(f"{'kernels' if i == 0 else '':<16} {label}: {text}")
    every = ref.layers + quant.layers
    if any(layer.attributes.get("accuracy_level") == 4 for layer in every):
        lines.append(f"{'':<16} acc4: MatMulNBits accuracy_level 4: on CPU the kernel quantizes activations to int8 "
                     "per block (onnxruntime's CUDA kernel ignores the level: float activations)")
    lines += [f"{'note':<16} {note}" for note in report.notes]
    if layers and ref.layers:
        width = max(len(layer.module) for layer in ref.layers)
        lines += ["", f"{'layer':<{width}}  {'reference kernel':<38}  {'quantized kernel':<46}  provider"]
        for r, q in zip(ref.layers, quant.layers):
            detail = q.kernel + (f" block {q.attributes['block_size']}" if q.kind == "matmulnbits" else "")
            lines.append(f"{r.module:<{width}}  {r.kernel:<38}  {detail:<46}  {q.provider or '-'}")
    return "\n".join(lines)
