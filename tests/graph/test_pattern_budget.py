"""Strangers' module-name patterns share one matching budget per run (graph.names): many slow-but-allowed
regexes are refused in one line once the run's budget is spent, however many patterns there are, and a
big recipe of cheap patterns still selects what compressed-tensors' match_name selects, matching each
pattern once per name. Through the CLI (inspect and run share the selection) on the shipped tiny llama."""

from __future__ import annotations

import json

import pytest

from graphcal.errors import UsageError
from graphcal.graph import names
from graphcal.graph.names import NameMatcher, one_budget
from tests.helpers import run_cli

# ~50 ms a pattern over the tiny llama's names: overlapping alternatives, allowed by the nesting check
SLOW = r"re:model\.layers\.\d\.(.|\w)*\d{i}$"



def _recipe(tmp_path, ignore: list[str]):
    lines = ["QuantizationModifier:", "  scheme: W8A8", "  targets: [Linear]", "  ignore:"]
    lines += [f"    - {json.dumps(p)}" for p in ignore]
    path = tmp_path / "recipe.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


class _Counting:
    """Counts the regex matches graph.names runs (each (pattern, name) it matches)."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, str]] = []
        real = names._compiled

        def compiled(text, where):
            regex = real(text, where)
            calls = self.calls

            class Spy:
                def match(self, name, timeout=None):
                    calls.append((text, name))
                    return regex.match(name, timeout=timeout)

            return Spy()

        monkeypatch.setattr(names, "_compiled", compiled)


@pytest.mark.parametrize("via", ["recipe", "--ignore"])
def test_many_slow_patterns_are_refused_once_the_runs_budget_is_spent(llama_dir, tmp_path, monkeypatch, via):
    """300 patterns each well under any per-pattern limit: the run's one budget ends them, in one line."""
    monkeypatch.setattr(names, "RUN_BUDGET_S", 0.2)
    counting = _Counting(monkeypatch)
    slow = [SLOW.format(i=i) for i in range(300)]
    flags = ["--recipe", _recipe(tmp_path, slow)] if via == "recipe" else [a for p in slow for a in ("--ignore", p)]
    result = run_cli("inspect", llama_dir / "model.onnx", *flags)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "took over 0.2 s in all" in lines[0] and "simplify them" in lines[0], lines[0]
    tried = {pattern for pattern, _ in counting.calls}
    assert 0 < len(tried) < len(slow), len(tried)  # refused before every pattern was matched


def test_many_cheap_patterns_select_as_compressed_tensors_does_matching_each_once(llama_dir, tmp_path, monkeypatch):
    from compressed_tensors.utils.match import match_name as ct_match_name

    counting = _Counting(monkeypatch)
    cheap = [rf"re:model\.layers\.{i}\.mlp\.(gate|up)_proj$" for i in range(0, 600, 2)]  # layers 0 and 2 hit
    cheap += ["model.layers.1.self_attn.v_proj", r"re:.*o_proj", r"re:lm_head"]
    result = run_cli("inspect", llama_dir / "model.onnx", "--recipe", _recipe(tmp_path, cheap), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    modules = [t["module"] for t in report["targets"]]
    want = {m for m in modules if any(ct_match_name(m, p) for p in cheap)}
    assert 0 < len(want) < len(modules)
    assert {t["module"] for t in report["targets"] if t["status"] != "quantized"} == want
    assert len(counting.calls) == len(set(counting.calls))  # each pattern once per name, however many asked


def test_more_patterns_than_a_run_may_match_are_refused(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(names, "MAX_PATTERNS", 50)
    ignore = [f"model.layers.{i}.mlp.up_proj" for i in range(60)]
    result = run_cli("inspect", llama_dir / "model.onnx", "--recipe", _recipe(tmp_path, ignore))
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "more than 50 module-name patterns" in lines[0], result.output


def test_matchers_of_one_run_draw_on_one_budget(monkeypatch):
    """Two selections of one run (the targets, then SmoothQuant's mappings) share the run's budget."""
    monkeypatch.setattr(names, "RUN_BUDGET_S", 0.0)
    with one_budget() as budget:
        first, second = NameMatcher("targets/ignore"), NameMatcher("SmoothQuant mappings")
        assert first.budget is budget and second.budget is budget
        assert first("q_proj", "q_proj")  # exact names cost no budget
        with pytest.raises(UsageError, match="took over 0 s in all"):
            second("model.layers.0.mlp", r"re:.*mlp")
