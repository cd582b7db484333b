"""The package's layering (docs/architecture.md, "Data flows one way"): no import cycle, every
module imports on its own, the model and the kernels import nothing of the training stack,
parallelize.py no optimizer, and the trainer reaches the memory planner only through the small
start-up check."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "titan_glm52"
ROOT = PACKAGE.parent


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str) -> set[str]:
    """Package modules that ``name`` imports, at module level or inside functions."""
    path = MODULES[name]
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in GRAPH[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_no_import_cycle():
    cycles = sorted(name for name in MODULES if name in _reachable(name))
    assert cycles == [], f"modules on an import cycle: {cycles}"


@pytest.mark.parametrize("layer", ["titan_glm52.model", "titan_glm52.kernels"])
def test_model_and_kernels_import_nothing_of_the_training_stack(layer):
    stack = (
        "titan_glm52.trainer",
        "titan_glm52.config",
        "titan_glm52.parallelize",
        "titan_glm52.pipeline",
        "titan_glm52.optimizer",
        "titan_glm52.checkpoint",
        "titan_glm52.data",
        "titan_glm52.plan",
    )
    for name in (n for n in MODULES if n == layer or n.startswith(layer + ".")):
        bad = sorted(d for d in GRAPH[name] if d.startswith(stack))
        assert bad == [], f"{name} imports {bad}"


def test_parallelize_applies_parallelism_only():
    assert "titan_glm52.optimizer" not in _reachable("titan_glm52.parallelize")
    assert "titan_glm52.trainer" not in _reachable("titan_glm52.parallelize")


def test_the_trainer_reaches_the_planner_only_through_the_start_up_check():
    planner = "titan_glm52.memory_estimate"
    assert planner not in GRAPH["titan_glm52.trainer"]
    assert "titan_glm52.memory_check" in GRAPH["titan_glm52.trainer"]
    assert "titan_glm52.trainer" not in _reachable(planner)


# One fresh interpreter imports torch, triton and torchtitan (the slow part of any import here),
# then forks a child per module that imports it with no package module loaded yet: a fresh
# interpreter per module took over three minutes of the CPU suite, this takes about 20 s.
_EACH_ON_ITS_OWN = """
import importlib, os, sys, traceback
# third-party only: no module of the package is loaded before the fork
import torch, triton, torchtitan.config, torch.distributed.checkpoint
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    if os.waitpid(pid, 0)[1]:
        failed.append(name)
print("failed:", " ".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_on_its_own():
    """Each module imported first in a process that holds no other module of the package (an
    import cycle or a missing dependency would show here)."""
    res = subprocess.run(
        [sys.executable, "-c", _EACH_ON_ITS_OWN, *MODULES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
