"""The house (docs/architecture.md): imports point down the floors, no circles, a light core."""

from __future__ import annotations

import ast
import functools
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "retrain"
BENCH = ROOT.parent / "bench"

# The floors of docs/architecture.md; a module may import its own floor or a lower one.
# "pkg.*" places every module of a package; a named module of it overrides that.
FLOORS = {
    1: ["errors", "config", "config.*", "algorithms", "algorithms.*", "control", "control.*",
        "environments.answers", "environments.protocol", "campaign.matrix", "campaign.plan",
        "campaign.ray_address", "campaign.race", "campaign.race_plan", "results.stats",
        "run.seeds", "run.at_k", "bill", "bill.*"],
    2: ["backends", "backends.*", "slots", "slots.*", "environments", "environments.*",
        "machine", "machine.*", "runfiles", "runfiles.*", "results.run_rows",
        "results.run_figures", "results.spent", "distributed", "distributed.*"],
    3: ["run", "run.*", "environments.rollout"],
    4: ["campaign", "campaign.*"],
    5: ["cli", "cli.*", "__main__", "serve", "serve.*", "results", "results.*"],
}
HEAVY = {"torch", "transformers", "peft", "tinker", "ray", "numpy", "rich", "typer",
         "starlette", "uvicorn", "matplotlib"}


@functools.cache
def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name or "__init__"] = path
    return out


def _floor(module: str) -> int:
    for floor, names in FLOORS.items():
        if module in names:
            return floor
    for floor, names in FLOORS.items():
        if any(n.endswith(".*") and module.startswith(n[:-1]) for n in names):
            return floor
    raise AssertionError(f"retrain/{module}: add it to a floor in docs/architecture.md "
                         "and in FLOORS here")


def _imports(path: Path, module: str, top_level_only: bool = False) -> set[str]:
    """Dotted names `path` imports: `from a import b` gives a.b where that is a module, else a.
    With top_level_only, only the imports at module level (not inside functions)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    package = module.rsplit(".", 1)[0] if "." in module and path.name != "__init__.py" \
        else module
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(["retrain", *up, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub.removeprefix("retrain.") in _modules() else base)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        deps = {d.removeprefix("retrain.") for d in _imports(path, name)
                if d.startswith("retrain.")}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def test_every_module_has_a_floor_and_imports_point_down():
    graph = _graph()
    upward = [f"{m} (floor {_floor(m)}) imports {d} (floor {_floor(d)})"
              for m, deps in graph.items() if m != "__init__" for d in deps
              if _floor(d) > _floor(m)]
    assert not upward, upward


def test_no_import_circles():
    graph, seen, stack, circles = _graph(), set(), [], []

    def visit(m: str) -> None:
        if m in stack:
            circles.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for d in sorted(graph[m]):
            visit(d)
        stack.pop()

    sys.setrecursionlimit(10_000)
    for m in sorted(graph):
        visit(m)
    assert not circles, circles


def test_the_core_imports_nothing_heavy_at_module_level():
    modules = _modules()
    for name in [m for m in modules if m != "__init__" and _floor(m) == 1]:
        top = {d.split(".")[0] for d in _imports(modules[name], name, top_level_only=True)}
        assert not top & HEAVY, (name, top & HEAVY)


# The top of retrain/ holds only packages (docs/architecture.md: folders are floors).
TOP_FILES = {"__init__.py", "__main__.py", "errors.py"}
MAX_LINES = 450
MAX_FUNCTION_LINES = 60


def test_the_top_of_the_package_holds_only_packages():
    loose = sorted(p.name for p in ROOT.iterdir()
                   if p.suffix == ".py" and p.name not in TOP_FILES)
    folders = [p for p in ROOT.iterdir() if p.is_dir() and p.name != "__pycache__"]
    not_packages = sorted(p.name for p in folders if not (p / "__init__.py").is_file())
    assert not loose, f"move these into a package of docs/architecture.md: {loose}"
    assert not not_packages, f"folders without an __init__.py: {not_packages}"


def test_every_package_says_what_it_holds():
    silent = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("__init__.py")
                    if p.parent != ROOT and not ast.get_docstring(ast.parse(p.read_text())))
    assert not silent, f"give these packages a docstring: {silent}"




def test_rooms_fit_on_a_screen():
    long_files, long_functions = [], []
    for name, path in _modules().items():
        text = path.read_text()
        if text.count("\n") > MAX_LINES:
            long_files.append(f"retrain/{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}.{node.name}: {size} lines")
    assert not long_files, f"split these (at most {MAX_LINES} lines): {long_files}"
    assert not long_functions, \
        f"split these (at most {MAX_FUNCTION_LINES} lines): {long_functions}"


# A prefix that several modules share is a room the folder should show (issue 52): at most
# MAX_PREFIXED modules of one package start with the same `word_` (`_private` ones aside).
MAX_PREFIXED = 3


def test_a_shared_name_prefix_is_a_package_not_a_family_of_modules():
    crowded = []
    for package in sorted({p.parent for top in (ROOT, BENCH) for p in top.rglob("*.py")}):
        words = Counter(p.stem.split("_")[0] for p in package.glob("*.py")
                        if not p.stem.startswith("_") and "_" in p.stem)
        crowded += [f"{package.relative_to(ROOT.parent)}/{word}_*.py: {n} modules"
                    for word, n in sorted(words.items()) if n > MAX_PREFIXED]
    assert not crowded, f"give each of these a subpackage named after the prefix: {crowded}"
