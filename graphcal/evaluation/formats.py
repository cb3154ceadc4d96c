"""eval's reports as people read them: the text table and the self-contained HTML page (JSON is EvalReport.as_dict)."""

from __future__ import annotations

import html
import math
import shlex

from graphcal.evaluation.report import EvalReport


def _fmt_db(value: float) -> str:
    return "exact" if value == math.inf else f"{value:.1f}"


def format_text(report: EvalReport) -> str:
    level = f", ORT_ENABLE_{report.level.upper()}" if report.runner == "onnxruntime" else ""
    provider = f" {report.provider}" if report.provider is not None else ""
    lines = [f"compared on {report.samples} samples in {report.batches} batches ({report.runner}{provider}{level})", "",
             "output                SQNR (dB)  cosine     max abs error  max abs fp32"]
    for a in report.outputs:
        lines.append(f"{a.name:<21} {_fmt_db(a.sqnr_db):>9}  {a.cosine:.6f}   {a.max_abs_err:.3e}      {a.max_abs_ref:.3g}")
    if report.next_token is not None:
        lines.append(_next_token_line(report.next_token))
    alone = report.isolated
    width = max([len(a.name) for a in report.layers] + [50])
    lines += ["", f"{'layer (MatMul/Gemm output)':<{width}}  SQNR (dB)  max abs error"
              + ("  alone (dB)" if alone is not None else "")]
    for i, a in enumerate(report.layers):
        lines.append(f"{a.name:<{width}}  {_fmt_db(a.sqnr_db):>9}  {a.max_abs_err:.3e}"
                     + (f"  {_fmt_db(alone[i].sqnr_db):>10}" if alone is not None else ""))
    if alone is not None:
        lines.append("SQNR: the quantized model's own output at the layer (errors of earlier layers included); "
                     "alone: the layer's own error, its input taken from fp32")
    if report.layers:
        which = "on their own" if alone is not None else "cumulative; --isolated ranks by each layer's own error"
        lines += ["", f"worst layers ({which}): "
                  + ", ".join(f"{a.name} ({_fmt_db(a.sqnr_db)} dB)" for a in report.worst())]
        flags = report.suggested_flags()
        if flags:
            lines.append(f"{', '.join(report.suggested_ignore())}: more than 6 dB under the median layer; to keep "
                         "them in float, run with: " + " ".join(shlex.quote(f) for f in flags))
            smooth = report.suggested_smoothquant()
            if smooth:
                lines.append("or keep them quantized and smooth their inputs first (SmoothQuant, exact in float; "
                             "this model was made without it for them): run with " + " ".join(smooth))
        else:
            lines.append("no layer is more than 6 dB under the median layer")
    if report.sensitivity is not None:
        lines += _sensitivity_text(report)
    if report.mix is not None:
        lines += _mix_text(report)
    if report.skipped_layers:
        lines.append(f"not compared (node missing or renamed in the quantized model): {', '.join(report.skipped_layers)}")
    return "\n".join(lines)


def _next_token_line(loss) -> str:
    """The logits' next-token KL against fp32 (and the token loss, with labels), one line."""
    line = f"{loss.name}: next-token KL from fp32 {loss.kl:.4g} nats (mean over {loss.positions} positions)"
    if loss.labelled:
        line += f"; token loss {loss.loss:.4f} (fp32 {loss.ref_loss:.4f}) over {loss.tokens} labels"
    return line


def _sensitivity_text(report: EvalReport) -> list[str]:
    sens = report.sensitivity
    first = report.outputs[0]
    width = max([len(k) for k in sens.alone] + [28])
    lines = ["", f"sensitivity: {first.name} with only these layers quantized (the rest in float), most harmful first",
             f"{'layers':<{width}}  count  SQNR (dB)  cosine"]
    for k in sens.ranked():
        a = sens.alone[k][0]
        lines.append(f"{k:<{width}}  {len(sens.kinds.get(k, [k])):>5}  {_fmt_db(a.sqnr_db):>9}  {a.cosine:.6f}")
    lines.append(f"now (as quantized): {_fmt_db(first.sqnr_db)} dB, cosine {first.cosine:.6f}; in float instead:")
    for o in sens.options:
        a = o.outputs[0]
        lines.append(f"  {' + '.join(o.kinds)} ({len(o.layers)} layers): {_fmt_db(a.sqnr_db)} dB, cosine {a.cosine:.6f}")
    advice = sens.advice(first.sqnr_db)
    if advice is None:
        lines.append("no kind of layer is worth keeping in float")
    else:
        a = advice.outputs[0]
        lines.append(f"advice: keep {' + '.join(advice.kinds)} in float ({len(advice.layers)} layers; expected "
                     f"{_fmt_db(a.sqnr_db)} dB, cosine {a.cosine:.6f}): run with "
                     + " ".join(shlex.quote(f) for f in sens.flags(advice)))
    return lines


_MEASURES = {"kl": "next-token KL from fp32 (nats)", "token loss": "token loss over fp32's (nats)",
             "sqnr": "output noise (SQNR)"}


def _mix_text(report: EvalReport) -> list[str]:
    mix = report.mix
    plan = mix.plan
    goal = (f"within {plan.budget_bytes / 1e6:.3g} MB" if plan.budget_bytes is not None
            else f"to a KL of {plan.target_kl:.4g} nats" if plan.target_kl is not None else f"to {plan.target_db:.1f} dB")
    high = "float" if plan.high == "float" else f"{plan.high}'s form"
    width = max([len(u.name) for u in plan.units] + [24])
    low_kl = f", KL {mix.low_loss.kl:.4g}" if mix.low_loss is not None else ""
    lines = ["", f"mixed precision {goal}: units of layers promoted to {high}, one at a time, every other layer "
             f"as quantized ({_fmt_db(mix.low[0].sqnr_db)} dB{low_kl} at {plan.base_bytes / 1e6:.3g} MB)",
             f"ranked by {_MEASURES[mix.measure]} removed per byte"
             + ("" if mix.measure != "sqnr" or plan.logits is not None
                else f" ({report.outputs[0].name}: the model has no logits output)"),
             f"{'layers':<{width}}  count  MB added  {report.outputs[0].name} SQNR (dB)"
             + ("  KL removed" if mix.low_loss is not None else "")
             + ("  loss removed" if mix.measure == "token loss" else "") + "  chosen"]
    low = mix.low[0].noise
    for u in sorted(plan.units, key=lambda u: -mix.value(u)):
        removed = mix.noise_removed.get(u.name, mix.gains[u.name])
        promoted = 10 * math.log10(1 / (low - removed)) if 0 < low - removed else math.inf
        unit = mix.unit_dict(u)
        kl = f"  {unit['kl_removed']:>10.4g}" if "kl_removed" in unit else ""
        loss = f"  {unit['loss_removed']:>12.4g}" if mix.measure == "token loss" else ""
        lines.append(f"{u.name:<{width}}  {len(u.layers):>5}  {u.cost / 1e6:>8.2f}  {_fmt_db(promoted):>20}{kl}{loss}  "
                     f"{'yes' if u.name in mix.chosen else ''}")
    a = mix.outputs[0] if mix.outputs else mix.low[0]
    short = (f"a KL of {plan.target_kl:.4g}" if plan.target_kl is not None
             else f"{plan.target_db:.1f} dB" if plan.target_db is not None else "")
    state = "" if mix.reached else f" (short of {short}: every unit worth its bytes promoted)"
    kl = f", KL {mix.kl:.4g} nats" if mix.kl is not None else ""
    mixed = mix.loss or mix.low_loss
    loss = f", token loss {mixed.loss:.4f} (fp32 {mixed.ref_loss:.4f})" if mixed is not None and mixed.labelled else ""
    lines.append(f"chosen: {len(mix.chosen)} of {len(plan.units)} units, {mix.bytes / 1e6:.3g} MB, measured "
                 f"{_fmt_db(a.sqnr_db)} dB, cosine {a.cosine:.6f}{kl}{loss}{state}")
    flags = mix.flags()
    if flags:
        lines.append("to write it, add to the command that wrote the quantized model: "
                     + " ".join(shlex.quote(f) for f in flags))
    else:
        lines.append("nothing to add: the quantized model as it is")
    return lines


def format_html(report: EvalReport, title: str) -> str:
    """A self-contained page: the tables and an SVG bar chart of per-layer SQNR."""
    finite = [a.sqnr_db for a in report.layers if math.isfinite(a.sqnr_db)]
    top = max(finite + [1.0])
    bar_h, label_w, chart_w = 16, 340, 420
    height = bar_h * len(report.layers) + 30
    bars = []
    for i, a in enumerate(report.layers):
        value = a.sqnr_db if math.isfinite(a.sqnr_db) else top
        width = max(value, 0) / top * chart_w
        y = 20 + i * bar_h
        bars.append(f'<text x="{label_w - 6}" y="{y + 12}" text-anchor="end" font-size="11">{html.escape(a.name)}</text>'
                    f'<rect x="{label_w}" y="{y + 2}" width="{width:.1f}" height="{bar_h - 4}" fill="#4a7ab5"/>'
                    f'<text x="{label_w + width + 4:.1f}" y="{y + 12}" font-size="11">{_fmt_db(a.sqnr_db)}</text>')
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + chart_w + 60}" height="{height}">'
           f'<text x="{label_w}" y="12" font-size="12">per-layer SQNR (dB), higher is closer to fp32</text>'
           + "".join(bars) + "</svg>")
    rows = "".join(f"<tr><td>{html.escape(a.name)}</td><td>{_fmt_db(a.sqnr_db)}</td><td>{a.cosine:.6f}</td>"
                   f"<td>{a.max_abs_err:.3e}</td></tr>" for a in report.outputs)
    ignore = report.suggested_ignore()
    advice = (" ".join(f"--ignore {html.escape(n)}" for n in ignore) if ignore
              else "no layer is more than 6 dB under the median layer")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head><body>"
            f"<h1>{html.escape(title)}</h1><p>{report.samples} samples, {report.runner}"
            f"{' ' + html.escape(report.provider) if report.provider is not None else ''}</p>"
            f"<h2>Outputs</h2><table border='1' cellpadding='4'><tr><th>output</th><th>SQNR (dB)</th><th>cosine</th>"
            f"<th>max abs error</th></tr>{rows}</table><h2>Layers</h2>{svg}"
            f"<p>Worst: {', '.join(html.escape(a.name) for a in report.worst())}</p><p>{advice}</p></body></html>")
