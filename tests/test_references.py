"""Every reference to our own code resolves inside the repository: a docstring's ``:func:`rlhf...``` (and the
other roles), a guide page's `` `rlhf.x.y` ``, and a path ``src/rlhf/.../x.py`` or ``tasks/.../x.py`` anywhere in
the code, the docs, params.yaml and dvc.yaml. A module that moves or a name that is renamed leaves none behind.
"""

from __future__ import annotations

import importlib
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLE = re.compile(r":(?:func|class|mod|meth|data|attr|exc):`~?((?:rlhf|tasks|flows|bench)(?:\.\w+)+)`")
BACKTICKED = re.compile(r"`((?:rlhf|tasks|flows|bench)\.(?:\w+\.)*\w+)`")  # a guide page's `rlhf.models.sample`
PATH = re.compile(r"\b((?:src/rlhf|tasks|flows|bench)/[\w/]+\.(?:py|html|md))\b")
OURS = ("src", "tasks", "flows", "bench", "tests", "docs", "README.md", "params.yaml", "dvc.yaml", "pyproject.toml")


def _files() -> list[str]:
    """Our source and text files under :data:`OURS`, relative to the root (the benchmarks' output left out); read
    from the tree, not from git, so a copy of it (``bench.mutants``) is checked the same."""
    found = []
    for entry in OURS:
        if os.path.isfile(os.path.join(ROOT, entry)):
            found.append(entry)
        for where, folders, names in os.walk(os.path.join(ROOT, entry)):
            folders[:] = [f for f in folders if f not in ("__pycache__", "out") and not f.startswith(".")]
            found += [os.path.relpath(os.path.join(where, n), ROOT) for n in names]
    return sorted(p for p in found if p.endswith((".py", ".md", ".yaml", ".toml")))


def resolves(reference: str) -> bool:
    """Whether dotted ``reference`` is a module of ours or an attribute reached from one (``a.b.C.method``)."""
    parts = reference.split(".")
    for end in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        for name in parts[end:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return False


def _tag_names(root: str, files: list[str]) -> set[str]:
    """The MLflow tag names the code writes (``"rlhf.gate.decision"``): dotted like a module, but not one."""
    found = set()
    for path in files:
        if path.startswith(("tasks/", "flows/")) and path.endswith(".py"):
            with open(os.path.join(root, path), encoding="utf-8") as handle:
                found.update(re.findall(r"[\"'](rlhf\.[\w.]+)[\"']", handle.read()))
    return found


def broken_references(root: str, files: list[str]) -> list[str]:
    """``file: reference`` for each reference in ``files`` (relative to ``root``) that does not resolve: dotted
    names (an MLflow tag the code writes is not one) and paths (the tests' example paths and ``bench/out``, the
    benchmarks' output, left out)."""
    tags = _tag_names(root, files)
    broken = []
    for path in files:
        with open(os.path.join(root, path), encoding="utf-8") as handle:
            text = handle.read()
        dotted = set(ROLE.findall(text)) | (set(BACKTICKED.findall(text)) if path.endswith(".md") else set())
        broken += [f"{path}: {ref}" for ref in sorted(dotted - tags) if not resolves(ref)]
        paths = set() if path.startswith("tests/") else {p for p in PATH.findall(text) if "/out/" not in p}
        broken += [f"{path}: {p} (no such file)" for p in sorted(paths) if not os.path.exists(os.path.join(root, p))]
    return broken


def test_every_reference_to_our_code_resolves():
    files = _files()
    assert len(files) > 100
    broken = broken_references(ROOT, files)
    assert not broken, "references that resolve to nothing:\n" + "\n".join(broken)


def test_a_moved_name_is_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "Sampling is `rlhf.models.sampling.sample`; the loop was `rlhf.ppo.train_ppo`, in src/rlhf/ppo.py.\n"
    )
    assert broken_references(str(tmp_path), ["docs/page.md"]) == [
        "docs/page.md: rlhf.ppo.train_ppo",
        "docs/page.md: src/rlhf/ppo.py (no such file)",
    ]


def test_the_code_cites_no_file_outside_the_repository():
    # papers are cited by title, section and equation (rlhf/losses.py), never by a reader's copy of them; the data
    # beside the repository (../shared/data) is params.yaml's and the guide's to name
    outside = re.compile(r"(?<![.\w])\.\./\w|DESIGN\.md")
    cited = []
    for path in _files():
        if path.startswith(("src/", "tasks/", "flows/")) and path.endswith(".py"):
            with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
                cited += [f"{path}:{n}" for n, line in enumerate(handle, 1) if outside.search(line)]
    assert not cited, "cites a file outside the repository: " + ", ".join(cited)
