"""``graphcal run MODEL --data D --size-budget MB`` (or ``--target-kl NATS``): the best model within a budget, in one run.

The steps, in order (each a call of what `run` and `eval` already do, inside one command):

1. **The forms.** The low form is what the run's flags ask for; with none of the config flags given, the
   settings that measured best on a real LLM (docs/genai.md): the whole model (lm_head and the embedding,
   one table where tied) in int4 with zero points, groups of 64, GPTQ (:data:`DEFAULTS`). The high form is
   the same run with int8 weights (:data:`HIGH_SCHEME`, the same group size) rounded to nearest, or float
   where the low form's weights are 8 bits already.
2. **Held out.** The last ``--mix-samples`` calibration samples are set aside (graphcal.data.held_out):
   both forms are calibrated on the samples before them, and the mix is chosen and measured on them.
3. **Both forms written** into a temporary folder beside ``-o`` (removed at the end, on errors, Ctrl-C and
   SIGTERM): a low run, then a high run (no data pass at int8: round to nearest reads no data).
4. **The choice** (graphcal.evaluation.mixing, as ``eval LOW --fallback HIGH --size-budget MB --per-layer``):
   layer by layer, units ranked by the next-token KL divergence from fp32 they remove per byte (the token
   loss where the data has ``labels``; the first output's SQNR for a model without logits), at eval's
   optimization level (ORT_ENABLE_BASIC: onnxruntime fuses no Q/DQ inside the switches' branches).
5. **The mix written** into ``-o`` from the two forms written (graphcal.budget.write, graph.splice): the low
   form with the chosen layers' nodes and weights taken from the high form, as the switches measured them:
   nothing is calibrated again. Where the high form is float (or the run writes k/v scales), the low run
   runs again with the mix's flags instead (``--ignore``).
6. **Measured as written**: the written model against fp32 on the held-out samples (eval of ``-o``): the
   KL and size reported are the written model's, next to what the choice predicted.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from graphcal.config import Options
from graphcal.config.options import with_keywords
from graphcal.data import data_paths
from graphcal.data.held_out import held_out_split, hold_out
from graphcal.errors import UsageError
from graphcal.output import MODEL_FILE
from graphcal.output.folder import missing_parents
from graphcal.output.process import on_abort, torchrun_rank
from graphcal.output.slot import reserve_output

log = logging.getLogger("graphcal")

#: the low form when no config flag is given: what measured best on SmolLM2-135M (docs/genai.md)
DEFAULTS = dict(scheme="W4A16_ASYM", group_size=64, algorithm="gptq", lm_head=True,
                scheme_for=("Embedding=W4A16_ASYM",))
HIGH_SCHEME = "W8A16"
DEFAULT_MIX_SAMPLES = 4
#: the flags that define the low form: with none given, :data:`DEFAULTS` apply
CONFIG_FIELDS = ("scheme", "targets", "ignore", "observer", "kv_cache", "recipe", "smoothquant", "smoothing_strength",
                 "algorithm", "block_size", "dampening_frac", "actorder", "gptq_order", "duo_scaling", "n_grid",
                 "awq_samples", "awq_clip", "group_size", "scheme_for", "lm_head", "rotate", "rotation_type")
ALGORITHM_FIELDS = ("algorithm", "block_size", "dampening_frac", "actorder", "gptq_order", "duo_scaling", "n_grid",
                    "awq_samples", "awq_clip", "smoothquant", "smoothing_strength")


@dataclass(frozen=True)
class Goal:
    """What the mix must meet: a size on disk (bytes) or a mean next-token KL (nats)."""

    size_budget_bytes: int | None = None
    target_kl: float | None = None

    def check(self) -> None:
        if (self.size_budget_bytes is None) == (self.target_kl is None):
            raise UsageError("give one of --size-budget and --target-kl")
        if self.size_budget_bytes is not None and self.size_budget_bytes <= 0:
            raise UsageError("--size-budget is the model files' size in MB (more than 0)")
        if self.target_kl is not None and not self.target_kl >= 0:
            raise UsageError(f"--target-kl is a mean KL divergence in nats (0 or more), got {self.target_kl!r}")

    @classmethod
    def from_flags(cls, size_budget_mb: float | None, target_kl: float | None) -> Goal:
        """The goal of run's (and inspect's) ``--size-budget MB`` / ``--target-kl NATS``, checked."""
        if size_budget_mb is None and target_kl is None:
            raise UsageError("--mix-samples is for --size-budget or --target-kl; give one of them")
        goal = cls(round(size_budget_mb * 1e6) if size_budget_mb is not None else None, target_kl)
        goal.check()
        return goal

    def check_fits(self, low_bytes: int) -> None:
        """A budget under the low form's expected size (``low_bytes``) refused: no mix fits."""
        if self.size_budget_bytes is not None and low_bytes > self.size_budget_bytes:
            raise UsageError(f"{self.text} is under the low form's expected size, {low_bytes / 1e6:.1f} MB: no mix "
                             "fits; give a larger budget or a lower form (--scheme, --group-size)")

    @property
    def text(self) -> str:
        if self.size_budget_bytes is not None:
            return f"--size-budget {self.size_budget_bytes / 1e6:g} MB"
        return f"--target-kl {self.target_kl:g}"


@dataclass
class BudgetResult:
    """What the run chose and wrote: the final run's result, the mix, and the written model measured."""

    final: object  # graphcal.calibration.result.CalibrationResult of the written mix
    mix: object  # graphcal.evaluation.mixing.Mix: the units, their gains and the choice
    measured: object  # graphcal.evaluation.report.EvalReport of the written model on the held-out samples
    goal: Goal
    low_label: str
    high_label: str
    defaults: bool  # the low form is DEFAULTS (no config flag given)
    held_out: int
    calibrated_on: int
    seconds: dict[str, float]

    @property
    def rank(self) -> int:
        return self.final.rank

    @property
    def warnings(self) -> list[str]:
        return self.final.warnings

    @property
    def measured_kl(self) -> float | None:
        return self.measured.next_token.kl if self.measured.next_token is not None else None

    def summary_lines(self) -> list[str]:
        mix, plan = self.mix, self.mix.plan
        by = {"kl": "next-token KL", "token loss": "token loss", "sqnr": "output SQNR"}[mix.measure]
        lines = [f"{self.goal.text}: low form {self.low_label}"
                 + (" (graphcal's defaults for a budget: the settings that measured best on a real LLM)"
                    if self.defaults else "") + f", high form {self.high_label}",
                 f"chose on {self.held_out} held-out samples (calibrated on the {self.calibrated_on} before them) "
                 f"by {by}, layer by layer: {len(mix.chosen)} of {len(plan.units)} units in the high form"
                 + (f" ({', '.join(mix.chosen[:6])}{', ...' if len(mix.chosen) > 6 else ''})" if mix.chosen else "")]
        written = self.final.model_bytes
        predicted = f"predicted {mix.bytes / 1e6:.1f} MB"
        if mix.kl is not None:
            predicted += f", KL {mix.kl:.4g}"
            lines.append(f"low form: {plan.base_bytes / 1e6:.1f} MB, KL {mix.low_loss.kl:.4g} nats against fp32")
        measured = f"written {written / 1e6:.1f} MB" + (f", KL {self.measured_kl:.4g}" if self.measured_kl is not None
                                                          else f", output SQNR {self.measured.outputs[0].sqnr_db:.1f} dB")
        lines.append(f"the mix: {predicted}; {measured} (the written model on the held-out samples)")
        if not mix.reached:
            lines.append("the target was not reached: every unit worth its bytes is in the high form")
        lines.append("time: " + ", ".join(f"{k} {v:.0f} s" for k, v in self.seconds.items()))
        return lines + self.final.summary_lines()

    def as_dict(self) -> dict:
        out = self.final.as_dict()
        out["budget"] = {"goal": self.goal.text, "low": self.low_label, "high": self.high_label,
                         "defaults": self.defaults, "held_out": self.held_out, "calibrated_on": self.calibrated_on,
                         "mix": self.mix.as_dict(), "written_bytes": self.final.model_bytes,
                         "measured_kl": self.measured_kl, "measured_sqnr_db": self.measured.outputs[0].sqnr_db,
                         "seconds": self.seconds}
        return out


@dataclass(frozen=True)
class BudgetPlan:
    """What a budget run will do, before any pass (inspect's dry run of it)."""

    goal: Goal
    low: Options
    high: Options | None
    defaults: bool
    mix_samples: int
    calibrate_on: int | None  # the samples before the held-out ones (None: no data given)

    def line(self, low_bytes: int) -> str:
        """The plan's line; a budget under the low form's expected size (``low_bytes``) refused, as run refuses it."""
        self.goal.check_fits(low_bytes)
        held = (f"the last {self.mix_samples} samples held out, calibrated on the {self.calibrate_on} before them"
                if self.calibrate_on is not None else f"the last {self.mix_samples} samples of --data held out")
        return (f"{self.goal.text}: the plan above is the low form"
                + (" (graphcal's defaults for a budget)" if self.defaults else "")
                + f"; high form {HIGH_SCHEME + ' (round to nearest)' if self.high is not None else 'float'} where the "
                  f"choice takes it, layer by layer by next-token KL; {held}")


def budget_plan(options: Options, size_budget_mb: float | None, target_kl: float | None, mix_samples: int,
                data=None) -> BudgetPlan:
    """The budget run's plan from run's flags (refused in one line as run refuses them), the data split where given."""
    goal = Goal.from_flags(size_budget_mb, target_kl)
    low, high, defaults = budget_options(options)
    calibrate_on = held_out_split(data, mix_samples, options.num_samples)[0] if data is not None else None
    return BudgetPlan(goal, low, high, defaults, mix_samples, calibrate_on)


def budget_options(options: Options) -> tuple[Options, Options | None, bool]:
    """(the low form's options, the high form's (None: float), whether the low form is graphcal's
    defaults): refused in one line where a recipe is given (its modifiers name one form)."""
    if options.recipe is not None:
        raise UsageError("--size-budget and --target-kl build the low and high forms from flags; a recipe names one "
                         "form: give its scheme and algorithm as flags, or run the recipe and mix with `graphcal eval`")
    defaults = all(getattr(options, name) is None for name in CONFIG_FIELDS)
    low = replace(options, **DEFAULTS) if defaults else options
    from graphcal.config import resolve  # lazy: the schemes load compressed-tensors

    config = resolve(low)
    bits = {s.weights.num_bits for s in config.groups.values() if s.weights is not None}
    if not bits:
        raise UsageError("--size-budget mixes weight forms, and the scheme quantizes no weights")
    if min(bits) >= 8:
        return low, None, defaults  # the high form: float
    high_for = tuple(f"{entry.partition('=')[0]}={HIGH_SCHEME}" for entry in low.scheme_for or ())
    high = replace(low, scheme=HIGH_SCHEME, scheme_for=high_for or None,
                   **{name: None for name in ALGORITHM_FIELDS})
    return low, high, defaults


def calibrate_within(model: str | Path, data, output_dir: str | Path, options: Options | None = None, *,
                     goal: Goal, mix_samples: int = DEFAULT_MIX_SAMPLES, **keywords) -> BudgetResult:
    """The model within ``goal``: both forms calibrated on all but the last ``mix_samples`` samples,
    the mix chosen and measured on those, and written to ``output_dir`` (see the module's steps)."""
    from graphcal.evaluation import EvalOptions, evaluate  # lazy: onnxruntime and torch, for the choice

    goal.check()
    if torchrun_rank() is not None:
        raise UsageError("--size-budget and --target-kl run in one process (both forms, then the choice on one session); "
                         "run them without torchrun")
    if mix_samples < 1:
        raise UsageError(f"--mix-samples must be 1 or more, got {mix_samples}")
    options = with_keywords(options, keywords)
    low, high, defaults = budget_options(options)
    out = Path(output_dir)
    with reserve_output(out, [Path(model), *data_paths(data)]) as slot:  # -o checked and locked before any pass
        _check_fits(model, low, goal)
        held = hold_out(data, mix_samples, options.num_samples)
        work = Path(tempfile.mkdtemp(prefix=f".{out.name}.graphcal-mix-", dir=missing_parents(slot.path)[0]))
        with on_abort(lambda: shutil.rmtree(work, ignore_errors=True)):
            try:
                final, mix, seconds, low_label = _forms_and_mix(model, data, out, low, high, goal, held, work, slot)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    start = time.perf_counter()
    measured = evaluate(model, out / MODEL_FILE, held.arrays, EvalOptions(batch_size=options.batch_size,
                                                                          device=options.device))
    seconds["measured"] = time.perf_counter() - start
    final.seconds = sum(seconds.values())
    final.scheme = f"{low_label}, mixed with {HIGH_SCHEME if high is not None else 'float'}"
    return BudgetResult(final, mix, measured, goal, low_label,
                        f"{HIGH_SCHEME} (round to nearest)" if high is not None else "float", defaults,
                        held.count, held.calibrate_on, seconds)


def _forms_and_mix(model, data, out: Path, low: Options, high: Options | None, goal: Goal, held, work: Path, slot):
    """Both forms into ``work``, the mix chosen on the held-out samples and written into ``slot`` (``-o``):
    (the written run's result, the Mix, seconds by step, the low form's scheme)."""
    from graphcal.calibration.pipeline import calibrate  # lazy: torch, onnxruntime and compressed-tensors
    from graphcal.config import resolve  # lazy: the schemes load compressed-tensors
    from graphcal.evaluation import EvalOptions, evaluate  # lazy: onnxruntime and torch, for the choice

    low = replace(low, num_samples=held.calibrate_on)  # both forms on the samples before the held-out ones
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    low_result = calibrate(model, data, work / "low", low)
    seconds["low form"] = time.perf_counter() - start
    fallback = high_result = None
    if high is not None:
        start = time.perf_counter()
        high_result = calibrate(model, data, work / "high", replace(high, num_samples=held.calibrate_on))
        fallback = work / "high" / MODEL_FILE
        seconds["high form"] = time.perf_counter() - start
    start = time.perf_counter()
    report = evaluate(model, work / "low" / MODEL_FILE, held.arrays,
                      EvalOptions(fallback=fallback, size_budget_bytes=goal.size_budget_bytes, target_kl=goal.target_kl,
                                  per_layer=True, time_limit_s=None, batch_size=low.batch_size, device=low.device))
    mix = report.mix
    seconds["choice"] = time.perf_counter() - start
    start = time.perf_counter()
    final_options = _with_flags(mix.flags(), low)
    config = resolve(final_options)
    if high_result is not None and config.kv_cache is None:  # the two forms spliced: nothing calibrated again
        from graphcal.budget.write import write_mix  # lazy: the writer loads torch (safetensors) and onnx

        layers = {name: mix.plan.fp32_layers[name] for unit in mix.chosen for name in mix.plan.by_name[unit].layers}
        final = write_mix(work, Path(model), low_result, high_result, config, layers, slot)
    else:  # float layers (or k/v scales): the run again, with the mix's flags
        slot.release()
        final = calibrate(model, data, out, final_options)
    seconds["mix written"] = time.perf_counter() - start
    return final, mix, seconds, low_result.scheme


def _check_fits(model, low: Options, goal: Goal) -> None:
    """A budget under the low form's expected size (graphcal.calibration.sizing: from shapes, no weight read)
    refused before any pass."""
    if goal.size_budget_bytes is None:
        return
    from graphcal.calibration.report import inspect_model  # lazy: the plan loads onnx and compressed-tensors
    from graphcal.config import resolve  # lazy: the schemes load compressed-tensors

    goal.check_fits(inspect_model(model, resolve(low), target=low.target).expected_size)


def _with_flags(flags: list[str], low: Options) -> Options:
    """The low form's options with the mix's flags (``--scheme-for X`` / ``--ignore X`` pairs) added."""
    scheme_for, ignore = list(low.scheme_for or ()), None
    for flag, value in zip(flags[::2], flags[1::2]):
        if flag == "--scheme-for":
            scheme_for.append(value)
        else:
            ignore = [*(ignore or []), value]
    return replace(low, scheme_for=tuple(scheme_for) or None,
                   ignore=tuple(ignore) if ignore is not None else low.ignore)
