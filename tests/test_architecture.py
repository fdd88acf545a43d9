"""The house (docs/architecture.md): imports point down the floors, no circles, a light core."""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "retrain"

# The floors of docs/architecture.md; a module may import its own floor or a lower one.
FLOORS = {
    1: ["config", "config_paths", "config_file", "schema", "overrides", "toml_io", "errors",
        "environments.answers", "environments.protocol", "advantages", "control",
        "control.backpressure", "control.usl", "control.drift", "control.oom_ceiling",
        "control.roofline", "control.goodput", "control.bound", "control.work",
        "control.concurrency",
        "control.gradnoise", "control.stepcost", "control.capacity", "campaign.matrix",
        "campaign.plan", "ray_address", "seeds"],
    2: ["backends", "backends.base", "backends.local", "backends.local_sampling",
        "backends.local_checkpoint", "backends.local_cache", "backends.local_device",
        "backends.local_lora", "backends.local_loss", "backends.stop_strings",
        "backends.local_compile", "backends.tinker",
        "backends.tinker_wire",
        "backends.tinker_rate_limit", "backends.tinker_pending", "backends.tinker_overload",
        "backends.tinker_slot_lease",
        "slots", "slots_ray", "slot_semaphore",
        "environments", "environments.tasks", "environments.rewards", "environments.scorer",
        "environments.kinds", "environments.task_kind", "environments.python_kind",
        "environments.guess_number", "environments.ledger", "environments.host",
        "environments.tools", "environments.tools.*", "environments.adapters",
        "environments.adapters.*",
        "models", "cpu", "machine", "machine.measure", "machine.peaks", "machine.__main__",
        "runlog", "safejson"],
    3: ["trainer", "step_row", "stop_request", "offpolicy", "checkpoint", "run_lock", "eval",
        "trackers", "progress", "environments.rollout"],
    4: ["campaign", "campaign.runner", "campaign.concurrency", "campaign.run_records",
        "campaign.report", "campaign.executor", "campaign.ray_executor", "campaign.ray_cluster",
        "campaign.manifest"],
    5: ["cli", "__main__", "launch", "explain", "explain_warnings", "status", "status_view",
        "plot", "plot_concurrency", "figures", "templates", "docgen", "render", "serve",
        "serve.*",
        "results", "results.*"],
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
        if module in names or any(n.endswith(".*") and module.startswith(n[:-1])
                                  for n in names):
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
    for name in FLOORS[1]:
        top = {d.split(".")[0] for d in _imports(modules[name], name, top_level_only=True)}
        assert not top & HEAVY, (name, top & HEAVY)
