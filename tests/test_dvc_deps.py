"""Every DVC stage's code deps are exactly the code it runs: the ``.py`` files ``python -m tasks.<stage>`` reaches.

The files are derived, not listed: :mod:`tasks.kit.code_deps` follows the imports and writes them into dvc.yaml
(``make dvc-deps``); these tests require dvc.yaml to hold exactly that, so a module added, moved or no longer
imported fails CI until the deps are generated again.
"""

from __future__ import annotations

import os
import re
import textwrap

import pytest
import yaml

from tasks.kit.code_deps import module_file, reached_files, stage_entry, with_code_deps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stages() -> dict:
    with open(os.path.join(ROOT, "dvc.yaml"), encoding="utf-8") as handle:
        return yaml.safe_load(handle)["stages"]


def _paths(entries) -> list[str]:
    return [next(iter(e)) if isinstance(e, dict) else e for e in entries or []]


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


def test_reached_files_follow_imports_inside_functions_and_package_inits():
    # tasks.reward imports tasks.kit.common at the top; tasks.kit.common imports rlhf.training.supervised inside
    # functions
    reached = reached_files(ROOT, "tasks.reward")
    assert {"tasks/reward.py", "tasks/kit/common.py", "src/rlhf/training/supervised.py", "src/rlhf/stats.py"} <= reached
    assert "tasks/__init__.py" in reached  # sets telemetry variables: it runs code
    assert module_file(ROOT, "torch") is None and module_file(ROOT, "rlhf.nope") is None
    assert _covered("src/rlhf/models/loading.py", ["src/rlhf"]) and not _covered(
        "src/rlhf/models/loading.py", ["src/rlhf/mod"]
    )


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_stage_code_deps_are_exactly_the_code_it_runs(stage):
    listed = {p for p in _paths(STAGES[stage].get("deps")) if re.match(r"(src|tasks)/.*\.py$", p)}
    reached = reached_files(ROOT, stage_entry(stage, STAGES[stage]))
    assert listed == reached, (
        f"dvc.yaml stage {stage}: runs {sorted(reached - listed)} not in its deps, lists {sorted(listed - reached)} "
        "it does not run; `make dvc-deps` writes them"
    )


def test_dvc_yaml_is_what_the_generator_writes():
    with open(os.path.join(ROOT, "dvc.yaml"), encoding="utf-8") as handle:
        text = handle.read()
    assert with_code_deps(ROOT, text) == text, "dvc.yaml's code deps are not generated: run `make dvc-deps`"


def test_the_generator_replaces_code_deps_and_keeps_every_other_line(tmp_path):
    for path, body in {
        "tasks/__init__.py": '"""Nothing runs."""\n',
        "tasks/one.py": "from tasks import helper\n",
        "tasks/helper.py": "def f():\n    import tasks.deep\n",
        "tasks/deep.py": "",
        "tasks/stale.py": "",
    }.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(body)
    text = textwrap.dedent("""\
        # the DAG
        stages:
          one:  # a stage
            cmd: python -m tasks.one
            deps:
              - data/in.jsonl  # by hand
              - tasks/stale.py
              - tasks/one.py
              - templates/page.html
            outs:
              - out/
        """)
    wanted = text.replace(
        "      - tasks/stale.py\n      - tasks/one.py\n",
        "      - tasks/deep.py\n      - tasks/helper.py\n      - tasks/one.py\n",
    )
    assert with_code_deps(str(tmp_path), text) == wanted
    assert with_code_deps(str(tmp_path), wanted) == wanted  # generated once, it stays
    with pytest.raises(ValueError, match="stage one: cmd 'make' is not `python -m tasks.<stage>`"):
        with_code_deps(str(tmp_path), text.replace("python -m tasks.one", "make"))


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
