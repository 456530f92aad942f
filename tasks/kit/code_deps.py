"""Each DVC stage's code deps, derived from the imports: ``python -m tasks.kit.code_deps`` rewrites them in dvc.yaml
(``make dvc-deps``); ``--check`` only says whether dvc.yaml holds them (``tests/test_dvc_deps.py`` requires it).

A stage's code deps are the project's ``.py`` files that ``python -m tasks.<stage>`` runs: from
``tasks/<stage>.py`` every ``import`` and ``from ... import`` is read with ``ast`` (those inside functions too) and
followed through the project's own packages (``rlhf`` under ``src/``, ``tasks``). A package's ``__init__.py`` runs
on import, so it counts too, unless it holds nothing but a docstring. Every other dep (data, models, metrics,
templates) is written by hand and left as it is.
"""

from __future__ import annotations

import ast
import os
import re
import sys

import yaml

PACKAGES = {"rlhf": "src/rlhf", "tasks": "tasks"}  # top-level import name -> folder, relative to the project root
_DEP = re.compile(r"^(?P<indent>\s+)- (?P<path>(?:src|tasks)/\S+\.py)\s*$")


def module_file(root: str, name: str) -> str | None:
    """The project file of dotted module ``name`` (``rlhf.stats`` -> ``src/rlhf/stats.py``), or None if not ours."""
    top, *rest = name.split(".")
    if top not in PACKAGES:
        return None
    base = os.path.join(PACKAGES[top], *rest)
    for candidate in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(os.path.join(root, candidate)):
            return candidate
    return None


def _is_trivial(root: str, path: str) -> bool:
    """An ``__init__.py`` with nothing but (at most) a docstring runs no code."""
    with open(os.path.join(root, path), encoding="utf-8") as handle:
        body = ast.parse(handle.read()).body
    return all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


def imported_names(root: str, module: str, path: str) -> set[str]:
    """Dotted names of every module ``path`` (module ``module``) may import, at any depth of its code."""
    with open(os.path.join(root, path), encoding="utf-8") as handle:
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


def reached_files(root: str, entry: str) -> set[str]:
    """Project files (relative to ``root``) that ``python -m <entry>`` runs, transitively; trivial ``__init__``s
    left out.

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
            path = module_file(root, prefix)
            if path is None or path in seen:
                continue
            seen.add(path)
            queue.extend(imported_names(root, prefix, path))
    return {p for p in seen if not (p.endswith("__init__.py") and _is_trivial(root, p))}


def stage_entry(stage: str, spec: dict) -> str:
    """``tasks.<stage>`` from a stage's ``cmd: python -m tasks.<stage>``.

    Raises:
        ValueError: the command is not of that form.
    """
    match = re.fullmatch(r"python -m (tasks\.\w+)", str(spec.get("cmd", "")).strip())
    if not match:
        raise ValueError(f"dvc.yaml stage {stage}: cmd {spec.get('cmd')!r} is not `python -m tasks.<stage>`")
    return match.group(1)


def with_code_deps(root: str, text: str) -> str:
    """dvc.yaml's ``text`` with each stage's ``.py`` deps under ``src/`` and ``tasks/`` replaced by the files it
    runs (:func:`reached_files`), sorted, where its first such dep stood (after its other deps when it had none);
    comments, other deps and every other line unchanged.

    Raises:
        ValueError: a stage whose command is not ``python -m tasks.<stage>`` (:func:`stage_entry`), or one
            without a ``deps:`` list.
    """
    stages = yaml.safe_load(text)["stages"]
    lines = text.splitlines(keepends=True)
    keys = [(i, re.match(r"^  ([\w-]+):\s*(#.*)?$", line)) for i, line in enumerate(lines)]
    starts = [(i, key.group(1)) for i, key in keys if key and key.group(1) in stages]
    out = lines[: starts[0][0]]
    for (begin, stage), end in zip(starts, [i for i, _ in starts[1:]] + [len(lines)], strict=True):
        block = lines[begin:end]
        deps_at = next((i for i, line in enumerate(block) if line.strip() == "deps:"), None)
        if deps_at is None:
            raise ValueError(f"dvc.yaml stage {stage}: no deps: list to hold the code it runs")
        listed = deps_at + 1
        while listed < len(block) and block[listed].lstrip().startswith("- "):
            listed += 1
        items = block[deps_at + 1 : listed]
        kept = [line for line in items if not _DEP.match(line)]
        first = next((i for i, line in enumerate(items) if _DEP.match(line)), len(items))
        place = sum(1 for line in items[:first] if not _DEP.match(line))
        indent = _DEP.match(items[first]).group("indent") if first < len(items) else "      "
        code = [f"{indent}- {path}\n" for path in sorted(reached_files(root, stage_entry(stage, stages[stage])))]
        out += [*block[: deps_at + 1], *kept[:place], *code, *kept[place:], *block[listed:]]
    return "".join(out)


def main(argv: list[str]) -> int:
    """``[--check]``: rewrite dvc.yaml in the current folder, or only say whether it is current; 1 when not."""
    with open("dvc.yaml", encoding="utf-8") as handle:
        text = handle.read()
    wanted = with_code_deps(".", text)
    if wanted == text:
        print("dvc.yaml: every stage's code deps are the files it runs")
        return 0
    if "--check" in argv:
        print("dvc.yaml: a stage's code deps are not the files it runs; run `make dvc-deps`", file=sys.stderr)
        return 1
    with open("dvc.yaml", "w", encoding="utf-8") as handle:
        handle.write(wanted)
    print("dvc.yaml: code deps rewritten from the imports")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
