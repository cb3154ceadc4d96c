"""The house's import contract, checked on every run: no import cycle between graphcal's modules
(in-function imports count), the layers (graph/, observers/ and the algorithms' math never import a
stage or a command), and every in-function import saying why it is one."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "graphcal"

#: modules that know nothing of stages, commands or outputs (their imports stay below them); algorithms/ is
#: pure math and graph folds, below calibration/ (the transform units, calibration/transforms/, use it)
LEAVES = ("graphcal.graph", "graphcal.observers", "graphcal.algorithms",
          "graphcal.types", "graphcal.errors", "graphcal.limits")
#: what a leaf may never import: the stages, the pipeline, the commands and what they write
ABOVE = ("graphcal.calibration", "graphcal.cli", "graphcal.evaluation", "graphcal.bench", "graphcal.export",
         "graphcal.output")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, ast.stmt, bool]]:
    """(imported graphcal module, the statement, whether it sits inside a function) for each import."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in names:
            while target and target not in modules:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("graphcal"):
                found.append((target, node, id(node) in nested))
                break
        else:
            found.append(("", node, id(node) in nested))  # a third-party or stdlib import
    return found


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _graph():
    modules = _modules()
    imports = {m: _imports(m, p, modules) for m, p in modules.items()}
    # a package's __init__ re-exporting its own modules is its public face, not a dependency back
    edges = {m: {t for t, _, _ in found if t and not (modules[m].name == "__init__.py" and t.startswith(m + "."))}
             for m, found in imports.items()}
    return modules, imports, edges


def test_no_import_cycle():
    _, _, edges = _graph()
    assert _cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_layers_graph_observers_and_math_import_no_stage_or_command():
    _, imports, _ = _graph()
    broken = [f"{m} imports {t}" for m, found in imports.items() if m.startswith(LEAVES)
              for t, _, _ in found if t.startswith(ABOVE)]
    assert broken == []


def test_only_the_cli_imports_the_cli():
    _, imports, _ = _graph()
    assert [m for m, found in imports.items() if not m.startswith("graphcal.cli") and m != "graphcal.__main__"
            and any(t.startswith("graphcal.cli") for t, _, _ in found)] == []


def test_every_in_function_import_says_why():
    """An import inside a function is one on purpose (a heavy or optional dependency kept off the
    start-up path); the line, the one above it, or the first of its run of imports says why."""
    modules, imports, _ = _graph()
    silent = []
    for m, found in imports.items():
        lines = modules[m].read_text().splitlines()
        for _, node, nested in found:
            if not nested:
                continue
            first = node.lineno
            while first > 1 and lines[first - 2].strip().startswith(("import ", "from ")):
                first -= 1  # the run of imports this one belongs to
            said = any("#" in lines[k - 1] for k in range(first, node.end_lineno + 1))
            said = said or (first > 1 and lines[first - 2].strip().startswith("#"))
            if not said:
                silent.append(f"{modules[m].relative_to(PACKAGE.parent)}:{node.lineno}")
    assert sorted(set(silent)) == []


def test_the_command_line_starts_without_torch_onnx_or_numpy():
    """`graphcal --help` (and every verb's parsing) imports only click and graphcal's light modules:
    torch, onnx, numpy and onnxruntime load when a command runs, not when the CLI is imported."""
    import subprocess
    import sys

    heavy = ("torch", "onnx", "numpy", "onnxruntime", "compressed_tensors")
    code = ("import sys, graphcal.cli; from click.testing import CliRunner; "
            "r = CliRunner().invoke(graphcal.cli.cli, ['--help']); assert r.exit_code == 0, r.output; "
            f"print(','.join(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent)
    assert out.stdout.strip() == "", f"import graphcal.cli loaded {out.stdout.strip()}"


def _private_imports(name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """``from <another graphcal module> import _x`` in ``path`` (module ``name``), one entry each."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(parts + ([base] if base else []))
        if base in modules and base != name:
            found += [f"{name} <- {base}.{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__") and f"{base}.{a.name}" not in modules]
    return found


def test_no_module_imports_a_private_name_from_another():
    """A name shared between modules is public (no leading underscore) and lives in one place."""
    modules = _modules()
    assert [f for m, p in modules.items() for f in _private_imports(m, p, modules)] == []


def test_the_private_import_finder_finds_one(tmp_path):
    path = tmp_path / "b.py"
    path.write_text("from graphcal.a import _hidden, shown\nfrom .a import _other\nfrom graphcal.a import __all__\n")
    modules = {"graphcal.a": tmp_path / "a.py", "graphcal.b": path}
    assert _private_imports("graphcal.b", path, modules) == ["graphcal.b <- graphcal.a._hidden", "graphcal.b <- graphcal.a._other"]


#: tools that open onnxruntime sessions of their own on purpose: plain sessions are the floors they time
PLAIN_SESSIONS = ("tools/bench.py", "tools/infer_baseline.py", "tools/lib/perplexity.py", "tools/pass_overhead.py")


def _tools_reimplementing() -> list[str]:
    """What a tool computes that the package (or tools/lib) has: the genai builder's command line, SQNR by
    hand (log10), an onnxruntime session outside the timing floors, a log() of its own."""
    root = PACKAGE.parent
    found = []
    for path in sorted((root / "tools").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value == "onnxruntime_genai.models.builder":
                found.append(f"{rel}:{node.lineno} the builder's command (graphcal.export.genai.builder_command)")
            elif isinstance(node, ast.Attribute) and node.attr == "log10":
                found.append(f"{rel}:{node.lineno} SQNR by hand (graphcal.evaluation.agreement)")
            elif isinstance(node, ast.Attribute) and node.attr == "InferenceSession" and rel not in PLAIN_SESSIONS:
                found.append(f"{rel}:{node.lineno} a session of its own (graphcal.runtime, graphcal.bench.session)")
            elif isinstance(node, ast.FunctionDef) and node.name == "log" and rel != "tools/lib/report.py":
                found.append(f"{rel}:{node.lineno} a log() of its own (tools.lib.report.log)")
    return found


def test_tools_use_the_package_instead_of_their_own_copies():
    assert _tools_reimplementing() == []
