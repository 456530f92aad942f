"""The rules on what may import what, as a test (README "Layout", docs/layout.md).

The core (``src/rlhf``) is a stack of groups, each a subpackage but the foundation (the modules at the top of
the package). :data:`MAY_IMPORT` says which groups each group may import, always lower ones: a group imports its
own modules and those groups, never a group above it nor a sibling (``reward``, ``ppo`` and ``evaluation`` stand
side by side: none imports another), and no modules import each other in a circle. The same map is the "may
import" column of docs/layout.md and each package ``__init__``'s "Imports ..." sentence (tested here). The core
never imports the orchestration (Prefect, MLflow, DVC) nor the code around it (``tasks``, ``flows``). Around the
core: a stage (``tasks/<stage>.py``) imports no other stage, the kit (``tasks/kit``) imports no stage and no
command, and the flows run stages as processes, never import them.

Imports are read with ``ast``, every one of them: those inside functions and under ``TYPE_CHECKING`` too (a
circle that only the type checker sees is still a circle a reader has to untangle).
``pytest tests/test_layers.py -s`` prints each group's modules and the group graph.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
from collections import defaultdict
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = os.path.join("src", "rlhf")

GROUPS = (  # lowest first: the order of docs/layout.md's table
    "foundation",  # losses.py (the equations), likelihood.py (token log-likelihoods), stats.py (intervals),
    # ranges.py (range checks), files.py
    "runtime",
    "data",
    "models",
    "training",
    "reward",
    "ppo",
    "evaluation",
    "report",
)
_TRAINERS = ("foundation", "runtime", "data", "models", "training")
MAY_IMPORT = {  # group -> the groups it may import (its own modules always): the one rule, written out
    "foundation": (),
    "runtime": ("foundation",),
    "data": ("foundation", "runtime"),
    "models": ("foundation", "runtime", "data"),
    "training": ("foundation", "runtime", "data", "models"),
    "reward": _TRAINERS,  # reward, ppo and evaluation are siblings: PPO reads the reward model as a model, and
    "ppo": _TRAINERS,  # evaluation samples through rlhf.models, not through PPO
    "evaluation": _TRAINERS,
    "report": (*_TRAINERS, "reward", "ppo", "evaluation"),
}
ORCHESTRATION = ("prefect", "mlflow", "dvc", "tasks", "flows", "bench", "tests")  # never imported by the core


@dataclass(frozen=True)
class Import:
    """One import of a module of ours: where it stands and the module it reaches."""

    path: str  # the importing file, relative to the root
    line: int
    source: str  # the importing module, dotted
    target: str  # the imported name, dotted (a module, or a module's attribute)


def _module_name(path: str) -> str:
    """``src/rlhf/ppo/loop.py`` -> ``rlhf.ppo.loop``; ``tasks/kit/params.py`` -> ``tasks.kit.params``."""
    parts = os.path.normpath(path).split(os.sep)
    if parts[0] == "src":
        parts = parts[1:]
    parts[-1] = parts[-1].removesuffix(".py")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(root: str, path: str) -> list[Import]:
    """Every import of file ``path`` (relative to ``root``), at any depth of its code, relative ones resolved.

    Raises:
        SyntaxError: the file does not parse.
    """
    with open(os.path.join(root, path), encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), filename=path)
    module = _module_name(path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(path, node.lineno, module, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([node.module] if node.module else [])])
            found += [Import(path, node.lineno, module, f"{base}.{alias.name}") for alias in node.names]
    return found


def python_files(root: str, folder: str) -> list[str]:
    """The ``.py`` files under ``root/folder``, relative to ``root``, sorted."""
    found = []
    for where, _, names in os.walk(os.path.join(root, folder)):
        found += [os.path.relpath(os.path.join(where, n), root) for n in names if n.endswith(".py")]
    return sorted(found)


def core_modules(root: str) -> dict[str, str]:
    """Dotted module name -> its group, for every module of the core (package ``__init__``s included).

    Raises:
        AssertionError: a subpackage that is not a group of :data:`GROUPS`, or one nested deeper.
    """
    modules = {}
    for path in python_files(root, CORE):
        folders = os.path.relpath(os.path.dirname(path), CORE).split(os.sep)
        group = "foundation" if folders == ["."] else folders[0]
        assert group in GROUPS and len(folders) == 1, f"{path}: {group!r} is not a group of the core's layers {GROUPS}"
        modules[_module_name(path)] = group
    return modules


def _resolve(target: str, modules: dict[str, str]) -> str | None:
    """The longest prefix of ``target`` that is a module of the core (``rlhf.x.y.name`` -> ``rlhf.x.y``)."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def core_graph(root: str) -> tuple[dict[str, str], dict[str, set[str]], list[Import]]:
    """``(modules, edges, imports)``: each core module's group, module -> the core modules it imports (a
    package's ``__init__`` reached only by importing a module below it is not an edge), every import read."""
    modules = core_modules(root)
    edges: dict[str, set[str]] = defaultdict(set)
    read = []
    for path in python_files(root, CORE):
        for found in imports_of(root, path):
            read.append(found)
            target = _resolve(found.target, modules)
            if target is not None and target != found.source and target != "rlhf":
                edges[found.source].add(target)
    return modules, edges, read


def forbidden_imports(root: str) -> list[str]:
    """One line per import of a group that :data:`MAY_IMPORT` does not allow the importer's (``file:line: ...``)."""
    modules, _, read = core_graph(root)
    lines = []
    for found in read:
        target = _resolve(found.target, modules)
        if target is None or target == "rlhf":
            continue
        mine, theirs = modules[found.source], modules[target]
        if theirs != mine and theirs not in MAY_IMPORT[mine]:
            allowed = ", ".join(MAY_IMPORT[mine]) or "no other group"
            lines.append(
                f"{found.path}:{found.line}: {found.source} ({mine}) imports {target} ({theirs}); "
                f"{mine} may import {allowed}"
            )
    return lines


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted: the import circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(set(edges) | {n for targets in edges.values() for n in targets}):
        if node not in index:
            visit(node)
    return found


def group_edges(modules: dict[str, str], edges: dict[str, set[str]]) -> dict[tuple[str, str], int]:
    """(importing group, imported group) -> how many module edges go so, within a group left out."""
    counted: dict[tuple[str, str], int] = defaultdict(int)
    for source, targets in edges.items():
        for target in targets:
            if modules[source] != modules[target]:
                counted[(modules[source], modules[target])] += 1
    return dict(counted)


def test_each_group_imports_only_what_its_map_allows_and_prints_its_house():
    modules, edges, _ = core_graph(ROOT)
    print("\nthe core's groups, lowest first, and their modules:")
    for group in GROUPS:
        members = sorted(name.removeprefix("rlhf.") for name, g in modules.items() if g == group)
        print(f"  {group:<11} {', '.join(members)}")
    print("the group graph (importer -> imported: module edges):")
    by_group = group_edges(modules, edges)
    for group in GROUPS:
        targets = sorted(((t, n) for (s, t), n in by_group.items() if s == group), key=lambda x: GROUPS.index(x[0]))
        print(f"  {group:<11} -> {', '.join(f'{t} ({n})' for t, n in targets) or 'nothing of ours'}")
    module_circles = circles(edges)
    group_graph: dict[str, set[str]] = defaultdict(set)
    for source, target in by_group:
        group_graph[source].add(target)
    group_circles = circles(group_graph)
    print(f"circles in the core: {len(module_circles)} between modules, {len(group_circles)} between groups")
    assert not forbidden_imports(ROOT), "\n".join(forbidden_imports(ROOT))
    assert not module_circles, f"import circles in the core: {module_circles}"
    assert not group_circles, f"the groups import each other in a circle: {group_circles}"


def test_the_core_never_imports_the_orchestration():
    _, _, read = core_graph(ROOT)
    wrong = [f"{f.path}:{f.line}: imports {f.target}" for f in read if f.target.split(".")[0] in ORCHESTRATION]
    assert not wrong, "the core imports orchestration or the code around it:\n" + "\n".join(wrong)


def _plant(root, module: str, line: str) -> None:
    with open(os.path.join(root, CORE, *module.split(".")[1:]) + ".py", "a", encoding="utf-8") as handle:
        handle.write(f"\n\ndef _planted():\n    {line}  # noqa\n")


def test_planted_imports_the_map_refuses_and_a_planted_circle_fail(tmp_path):
    """The checks go through :func:`forbidden_imports` and :func:`circles` on a copy of the core with bad imports
    planted: the equations importing the report (up the stack), evaluation importing PPO and PPO the reward
    trainer (siblings: a ladder of groups would let both pass), then the report's tables importing its sections,
    which import the tables (a circle inside one group)."""
    shutil.copytree(os.path.join(ROOT, CORE), tmp_path / CORE)
    root = str(tmp_path)
    assert forbidden_imports(root) == [] and circles(core_graph(root)[1]) == []
    _plant(root, "rlhf.losses", "from rlhf.report.render import render_report")
    _plant(root, "rlhf.evaluation.comparison", "from rlhf.ppo.loop import train_ppo")
    _plant(root, "rlhf.ppo.rollout", "from rlhf.reward.trainer import train_reward_model")
    found = forbidden_imports(root)
    assert [line.split(":")[0] for line in found] == [
        "src/rlhf/evaluation/comparison.py",
        "src/rlhf/losses.py",
        "src/rlhf/ppo/rollout.py",
    ]
    assert (
        "rlhf.losses (foundation) imports rlhf.report.render (report); foundation may import no other group" in found[1]
    )
    assert "rlhf.evaluation.comparison (evaluation) imports rlhf.ppo.loop (ppo)" in found[0]
    assert "rlhf.ppo.rollout (ppo) imports rlhf.reward.trainer (reward)" in found[2]
    _plant(root, "rlhf.report.tables", "from rlhf.report.sections import conversation")
    (circle,) = circles(core_graph(root)[1])  # the tables reach the sections, and the sections the tables
    assert {"rlhf.report.sections", "rlhf.report.tables"} <= set(circle) and "rlhf.losses" not in circle


def test_the_docs_table_and_each_package_say_the_map():
    """docs/layout.md's "may import" column and each group's ``__init__`` name exactly the groups of
    :data:`MAY_IMPORT` (a ``:mod:`` reference or "the foundation"), so the three cannot drift apart."""

    def named(text: str) -> set[str]:
        return set(re.findall(r"\b(" + "|".join(GROUPS) + r")\b", text))

    with open(os.path.join(ROOT, "docs", "layout.md"), encoding="utf-8") as handle:
        rows = [line.split("|") for line in handle if line.startswith("| ") and "may import" not in line]
    table = {cells[1].strip(" `/"): named(cells[3]) for cells in rows if cells[1].strip(" `/") in GROUPS}
    assert set(table) == set(GROUPS), "docs/layout.md: the core's table lacks a group"
    assert table == {group: set(allowed) for group, allowed in MAY_IMPORT.items()}
    for group in GROUPS[1:]:
        with open(os.path.join(ROOT, CORE, group, "__init__.py"), encoding="utf-8") as handle:
            sentence = re.split(r"\.\s", handle.read().split("Imports ", 1)[1], maxsplit=1)[0]
        assert named(sentence) == set(MAY_IMPORT[group]), f"src/rlhf/{group}/__init__.py: {sentence!r}"


def test_a_module_outside_the_groups_fails(tmp_path):
    shutil.copytree(os.path.join(ROOT, CORE), tmp_path / CORE)
    (tmp_path / CORE / "extras").mkdir()
    (tmp_path / CORE / "extras" / "__init__.py").write_text('"""Nothing."""\n')
    try:
        core_modules(str(tmp_path))
    except AssertionError as err:
        assert "'extras' is not a group" in str(err)
    else:
        raise AssertionError("a subpackage outside GROUPS was accepted")


def _stages() -> set[str]:
    return {_module_name(p) for p in python_files(ROOT, "tasks") if os.path.dirname(p) == "tasks"} - {"tasks"}


def _ours(prefixes: tuple[str, ...], found: Import) -> bool:
    return any(found.target == p or found.target.startswith(p + ".") for p in prefixes)


def test_around_the_core_no_stage_imports_another_and_the_kit_and_flows_import_no_stage():
    stages = tuple(sorted(_stages()))
    wrong = []
    for path in python_files(ROOT, "tasks") + python_files(ROOT, "flows"):
        module = _module_name(path)
        for found in imports_of(ROOT, path):
            others = tuple(s for s in stages if s != module)
            if _ours(others, found):
                wrong.append(f"{path}:{found.line}: {module} imports the stage {found.target}")
            if not module.startswith("tasks.cli") and _ours(("tasks.cli",), found):
                wrong.append(f"{path}:{found.line}: {module} imports a console command, {found.target}")
            if module.startswith("tasks") and _ours(("flows",), found):
                wrong.append(f"{path}:{found.line}: {module} imports the flows, {found.target}")
    assert len(stages) >= 10 and not wrong, "\n".join(wrong)


def test_no_call_passes_eight_or_more_arguments_by_position():
    """At a wall of many parameters the call names them: ``f(a, b, c, d, config=config, runtime=runtime, ...)``,
    never eight or more by position, where two swapped arguments of one type go unnoticed (the core, the stages,
    the flows and the benchmarks)."""
    wrong = []
    for folder in (CORE, "tasks", "flows", "bench"):
        for path in python_files(ROOT, folder):
            if path.startswith(os.path.join("bench", "out")):
                continue  # what bench.speed downloads (TRL's sources), not ours
            with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
                tree = ast.parse(handle.read(), filename=path)
            wrong += [
                f"{path}:{node.lineno}: {ast.unparse(node.func)}(...) passes {len(node.args)} arguments by position"
                for node in ast.walk(tree)
                if isinstance(node, ast.Call) and len(node.args) >= 8
            ]
    assert not wrong, "\n".join(wrong)
