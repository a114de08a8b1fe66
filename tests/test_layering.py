"""engine/ is layered by role: a group imports only groups below it, and no modules import in a circle.

    front (engine/*.py, ray/, sim/)  ->  modes/  ->  coordinator/  ->  actors/  ->  units/  ->  worker/
    ->  config.py  ->  core/  ->  model/, transfer/, text/  ->  kernels/  ->  env.py (the PDSERVE_* variables:
    imports nothing of pdserve)

worker/ itself: processes/ (the spawned worker, its wire format)  ->  startup/ (probes, sizing, warm-up)
->  the step (worker/*.py: model runner, inputs, compute units)  ->  sampling/.

worker/ sits above core/ because a model runner runs what the schedulers built (core's plain
batches and sampling parameters); core/ never touches a tensor. model/, transfer/ and text/ are
peers: none imports another. Every import counts, including those inside functions and under
TYPE_CHECKING.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = (["pdserve", "engine"], ["pdserve", "kernels"], ["pdserve", "env"])     # the modules the layers are made of
RANKS = {"pdserve.env": -1, "pdserve.kernels": 0,
         "pdserve.engine.model": 1, "pdserve.engine.transfer": 1, "pdserve.engine.text": 1,
         "pdserve.engine.core": 2, "pdserve.engine.config": 2.5, "pdserve.engine.worker.sampling": 3,
         "pdserve.engine.worker": 4, "pdserve.engine.worker.startup": 5, "pdserve.engine.worker.processes": 6,
         "pdserve.engine.units": 6.5, "pdserve.engine.actors": 7, "pdserve.engine.coordinator": 8,
         "pdserve.engine.modes": 9, "pdserve.engine": 10}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(["pdserve", *(parts[:-1] if parts[-1] == "__init__" else parts)])


def group_of(module: str) -> str:
    """The longest group name that `module` is in."""
    return max((g for g in RANKS if module == g or module.startswith(g + ".")), key=len)


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {m for m in modules if m.split(".")[:2] in PROJECT}


def project_modules() -> dict[str, Path]:
    files = [*ROOT.glob("engine/**/*.py"), *ROOT.glob("kernels/**/*.py"), ROOT / "env.py"]
    return {module_name(f): f for f in files}


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a `from package import name` of a module counts)."""
    modules = project_modules()
    return {name: {m for m in imported_modules(path) if m in modules and m != name}
            for name, path in modules.items()}


def test_every_group_imports_only_groups_below_it():
    upward = []
    for module, imports in import_graph().items():
        group = group_of(module)
        for target in imports:
            other = group_of(target)
            if other != group and RANKS[other] >= RANKS[group]:
                upward.append(f"{module} ({group}) imports {target} ({other})")
    assert not upward, "imports against the layering:\n" + "\n".join(sorted(upward))


def test_no_modules_import_each_other_in_a_circle():
    graph, cycles = import_graph(), []
    state: dict[str, int] = {}            # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "circular imports:\n" + "\n".join(cycles)


@pytest.mark.parametrize("source, target, ok", [
    ("pdserve.engine.actors.base", "pdserve.engine.worker.model_runner", True),
    ("pdserve.engine.worker.model_runner", "pdserve.engine.actors.base", False),
    ("pdserve.engine.model.llama", "pdserve.engine.text.tokenizer", False),
    ("pdserve.kernels.store_kv", "pdserve.engine.core.batch", False),
    ("pdserve.env", "pdserve.kernels.native", False),
])
def test_the_rule_itself(source, target, ok):
    upward = RANKS[group_of(target)] >= RANKS[group_of(source)] and group_of(target) != group_of(source)
    assert upward is not ok


def test_nothing_in_the_package_imports_or_runs_the_experiments():
    """experiments/ (one-off probes, run as scripts) may import anything; nothing shipped depends on them."""
    names = {"experiments", *(p.stem for p in (ROOT / "experiments").glob("*.py"))}
    found = []
    for folder in ("engine", "server", "kernels", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                imported = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                            else [])
                found += [f"{path.relative_to(ROOT)} imports {m}" for m in imported if m.split(".")[0] in names]
        for path in (ROOT / folder).rglob("*.sh"):
            if "experiments/" in path.read_text():
                found.append(f"{path.relative_to(ROOT)} runs a script of experiments/")
    assert not found, "\n".join(found)
