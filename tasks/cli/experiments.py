"""``rlhf-experiments``: DVC experiments side by side in 120 columns, the way ``dvc params diff`` reads.

``dvc exp show`` makes every key of every params.yaml section a stage reads a column (each profile's too), every
dep a column and every headline figure a ``file:key`` column, so its table is a row of ``…`` at 120 columns. This
command reads the same data (``dvc exp show --json``, run in the project) and turns it round: one column per
experiment and its baseline commit, one row per param that differs between them as the stages read it (the
profile applied: what was swept) and per headline
figure of each stage (:func:`tasks.kit.paths.headline`, ``dvc metrics show``'s row of the stage). Every figure
of a stage stays in ``dvc metrics diff <a> <b> --targets metrics/<stage>.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from tasks.cli import run_command
from tasks.kit import paths
from tasks.kit.params import stage_params
from tasks.kit.registry import RegistryError, _project

app = typer.Typer(
    add_completion=False,
    rich_markup_mode="markdown",
    help="DVC experiments side by side: the params that differ and each stage's headline figures.",
)


class ExperimentsError(ValueError):
    """``dvc exp show`` failed or printed what this command cannot read (one line)."""


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": [{"d": 2}]}`` -> ``{"a.b": 1, "c.0.d": 2}`` (as MLflow's params name them); a list
    that holds anything but mappings, and every other value, is a leaf."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            value = {str(i): item for i, item in enumerate(value)}
        flat |= flatten(value, f"{name}.") if isinstance(value, dict) else {name: value}
    return flat


def as_read(params: dict[str, Any]) -> dict[str, Any]:
    """params.yaml as the stages read it: each section with its preset and the run's profile applied
    (:func:`tasks.kit.params.stage_params`), so ``reward.steps`` is what the reward stage trained for, not the
    demo's value beside a ``reward.profiles.long.steps``; a section that does not resolve stays as written.
    Top-level values (``profile``) stay."""
    read: dict[str, Any] = {}
    for key, value in params.items():
        try:
            read[key] = stage_params(key, params) if isinstance(value, dict) else value
        except ValueError:  # an unknown profile or preset: the run failed on it; show what was written
            read[key] = value
    return read


def _columns(entry: dict[str, Any], name: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``(column name, flat params as the stages read them, headline figures)`` of one commit or experiment of
    ``dvc exp show --json``."""
    data = entry.get("data") or {}
    params = flatten(as_read(((data.get("params") or {}).get("params.yaml") or {}).get("data") or {}))
    figures = {}
    for path, found in (data.get("metrics") or {}).items():
        if paths.is_headline(path) and isinstance((found or {}).get("data"), dict):
            stage = os.path.basename(path).removesuffix(".json")
            figures |= {f"{stage} {key}": value for key, value in found["data"].items()}
    return name, params, figures


def experiment_columns(shown: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """The columns of :func:`table` from ``dvc exp show --json``: each baseline commit (its short sha, or
    ``workspace``), followed by its experiments (their names), in DVC's order; a failed or queued experiment,
    which has no figures yet, is left out.

    Raises:
        ExperimentsError: the JSON is not DVC's list of baselines.
    """
    if not isinstance(shown, list):
        raise ExperimentsError("dvc exp show --json: expected a list of baseline commits")
    columns = []
    for baseline in shown:
        rev = baseline.get("rev", "")
        columns.append(_columns(baseline, "workspace" if rev == "workspace" else rev[:7]))
        for group in baseline.get("experiments") or []:
            for revision in group.get("revs") or []:
                if revision.get("data") and not revision.get("error"):
                    columns.append(_columns(revision, revision.get("name") or revision.get("rev", "")[:7]))
    return columns


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def table(columns: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> Table:
    """Rows: the params whose value, as the stages read it, differs between the columns (a key one column lacks
    counts as different),
    then every headline figure, ``<stage> <name>``, ``-`` where a column has none."""
    result = Table(box=None, pad_edge=False, header_style="bold")
    result.add_column("param / figure", overflow="fold")
    for name, _, _ in columns:
        result.add_column(name, justify="right", overflow="fold")
    keys = sorted({key for _, params, _ in columns for key in params})
    changed = [k for k in keys if len({json.dumps(p.get(k), sort_keys=True) for _, p, _ in columns}) > 1]
    for key in changed:
        result.add_row(key, *(_cell(params.get(key)) for _, params, _ in columns))
    if changed:
        result.add_section()
    figures = list(dict.fromkeys(key for _, _, found in columns for key in found))
    for key in figures:
        result.add_row(key, *(_cell(found.get(key)) for _, _, found in columns))
    return result


def dvc_experiments(project: str, all_commits: bool, num: int) -> list[dict[str, Any]]:
    """``dvc exp show --json`` of ``project`` (the ``dvc`` of this Python), parsed.

    Raises:
        ExperimentsError: dvc exits non-zero (its last line) or prints no JSON.
    """
    scope = ["--all-commits"] if all_commits else ["--num", str(num)]
    command = [sys.executable, "-m", "dvc", "exp", "show", "--json", *scope]
    done = subprocess.run(command, cwd=project, capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ExperimentsError(f"dvc exp show failed in {project}: {last.strip()}")
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        raise ExperimentsError(f"dvc exp show --json printed no JSON in {project}") from None


@app.command()
def show(
    project: str = typer.Option(None, help="the project folder (default: found from the current folder upward)"),
    all_commits: bool = typer.Option(False, "--all-commits", "-A", help="experiments of every commit"),
    num: int = typer.Option(1, "--num", "-n", min=1, help="experiments of the last N commits"),
) -> None:
    """The baseline and its experiments side by side: the params that differ, then each stage's headline figures
    (`dvc exp show`'s data, turned round to fit 120 columns)."""
    try:
        folder = _project(project)
        columns = experiment_columns(dvc_experiments(folder, all_commits, num))
    except (RegistryError, ExperimentsError) as err:
        typer.echo(f"rlhf-experiments: {str(err).removeprefix('registry: ')}", err=True)
        raise typer.Exit(1) from None
    Console(highlight=False).print(table(columns))  # the terminal's width; 80 columns into a file or a pipe


def console() -> None:
    """The console command (pyproject's scripts): :data:`app` through :func:`tasks.cli.run_command`."""
    run_command(app)


if __name__ == "__main__":
    console()
