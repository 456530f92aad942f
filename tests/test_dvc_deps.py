"""Every DVC stage depends on the code it runs: its deps cover each module ``python -m tasks.<stage>`` reaches.

The modules are derived, not listed: starting from ``tasks/<stage>.py`` the
imports are parsed with ``ast`` (every ``import``/``from ... import``, those
inside functions included) and followed transitively through the project's own
packages (``rlhf`` under ``src/``, ``tasks``). A package's ``__init__.py`` runs
on import, so it counts too, unless it holds nothing but a docstring.
"""

from __future__ import annotations

import ast
import os
import re

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"rlhf": "src/rlhf", "tasks": "tasks"}  # top-level import name -> folder (relative to ROOT)


def _stages() -> dict:
    with open(os.path.join(ROOT, "dvc.yaml"), encoding="utf-8") as handle:
        return yaml.safe_load(handle)["stages"]


def _paths(entries) -> list[str]:
    return [next(iter(e)) if isinstance(e, dict) else e for e in entries or []]


def module_file(name: str) -> str | None:
    """The project file of dotted module ``name`` (``rlhf.x`` -> ``src/rlhf/x.py``), or None if not ours."""
    top, *rest = name.split(".")
    if top not in PACKAGES:
        return None
    base = os.path.join(PACKAGES[top], *rest)
    for candidate in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(os.path.join(ROOT, candidate)):
            return candidate
    return None


def _is_trivial(path: str) -> bool:
    """An ``__init__.py`` with nothing but (at most) a docstring runs no code."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
        body = ast.parse(handle.read()).body
    return all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


def _imported_names(module: str, path: str) -> set[str]:
    """Dotted names of every module ``path`` (module ``module``) may import, at any depth of its code."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), filename=path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)  # `from rlhf import losses`
    return names


def reached_files(entry: str) -> set[str]:
    """Project files (relative to ROOT) that ``python -m <entry>`` runs, transitively; trivial ``__init__``s left out.

    Raises:
        SyntaxError: a reached module does not parse.
    """
    seen: set[str] = set()
    queue = [entry]
    while queue:
        name = queue.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__, a/b/__init__, then a/b/c
            prefix = ".".join(parts[:i])
            path = module_file(prefix)
            if path is None or path in seen:
                continue
            seen.add(path)
            queue.extend(_imported_names(prefix, path))
    return {p for p in seen if not (p.endswith("__init__.py") and _is_trivial(p))}


def _covered(path: str, deps: list[str]) -> bool:
    return any(path == dep.rstrip("/") or path.startswith(dep.rstrip("/") + "/") for dep in deps)


def _params() -> dict:
    with open(os.path.join(ROOT, "params.yaml"), encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def _resolve(dep: str, params: dict) -> str:
    """Substitute ``${a.b}`` from params.yaml, as DVC does."""

    def lookup(match: re.Match) -> str:
        value = params
        for key in match.group(1).split("."):
            value = value[key]
        return str(value)

    return re.sub(r"\$\{([^}]+)\}", lookup, dep)


STAGES = _stages()


def _entry(stage: str) -> str:
    match = re.fullmatch(r"python -m (tasks\.\w+)", STAGES[stage]["cmd"].strip())
    assert match, f"dvc.yaml stage {stage}: cmd {STAGES[stage]['cmd']!r} is not `python -m tasks.<stage>`"
    return match.group(1)


def test_reached_files_follow_imports_inside_functions_and_package_inits():
    # tasks.reward imports tasks.kit.common at the top; tasks.kit.common imports rlhf.training.supervised inside
    # functions
    reached = reached_files("tasks.reward")
    assert {"tasks/reward.py", "tasks/kit/common.py", "src/rlhf/training/supervised.py", "src/rlhf/stats.py"} <= reached
    assert "tasks/__init__.py" in reached  # sets telemetry variables: it runs code
    assert module_file("torch") is None and module_file("rlhf.nope") is None
    assert _covered("src/rlhf/models/loading.py", ["src/rlhf"]) and not _covered(
        "src/rlhf/models/loading.py", ["src/rlhf/mod"]
    )


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_stage_deps_cover_the_code_it_runs(stage):
    deps = _paths(STAGES[stage].get("deps"))
    missing = sorted(p for p in reached_files(_entry(stage)) if not _covered(p, deps))
    assert not missing, f"dvc.yaml stage {stage}: `python -m {_entry(stage)}` runs {missing}, not in its deps"


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_stage_deps_exist(stage):
    """A dep that no stage writes must exist (a renamed or split module leaves a dangling dep behind)."""
    outs = [p for spec in STAGES.values() for key in ("outs", "metrics", "plots") for p in _paths(spec.get(key))]
    params = _params()
    dangling = []
    for dep in _paths(STAGES[stage].get("deps")):
        path = _resolve(dep, params)
        if "://" in path or _covered(path, outs):
            continue
        if not os.path.exists(os.path.join(ROOT, path)):
            dangling.append(path)
    assert not dangling, f"dvc.yaml stage {stage}: deps {dangling} do not exist"
