"""``rlhf-registry``: the champions (reward model, policy) of this project's MLflow registry for people: status,
promote, rollback and restore (the library they use is :mod:`tasks.kit.registry`)."""

from __future__ import annotations

import os

import typer
import yaml

from tasks.cli import run_command
from tasks.kit import ledger
from tasks.kit.common import echo, one_line
from tasks.kit.registry import (
    CHAMPION,
    DECISION_TAG,
    RegistryError,
    _guard,
    _project,
    history,
    holder,
    model_exists,
    move_alias,
    previous_holder,
    pruned,
    version,
    version_metrics,
)
from tasks.kit.restore import restore

app = typer.Typer(
    rich_markup_mode="markdown",  # the docstrings' `code` shown as code, not as backticks
    help="The champions (reward model, policy) of this project's MLflow registry: status, promote, rollback, restore.",
)
MODELS = {"reward": "reward_model", "policy": "policy_model"}  # the command's model -> params.yaml registry key
STATUS_METRICS = (
    "rm/accuracy",
    "rm/accuracy_low",
    "rm/accuracy_high",
    "rm/ece",
    "rm/accuracy_chosen_shorter",
    "rm/accuracy_chosen_longer",
    "rm/pairs",
    "eval/judge/win_rate",
    "eval/judge/win_rate_low",
    "eval/judge/accuracy_low",
    "eval/proxy/win_rate",
    "eval/policy/kl",
    "eval/policy/eos_rate",
)


def _open(model: str, project: str | None):
    """``(client, registered model name, a line naming the project and its store)``; the current folder becomes
    the project's. Raises RegistryError (one line) on a bad model, project, params file or store."""
    import mlflow

    from tasks.kit.params import stage_params
    from tasks.kit.runs import tracking_uri

    if model not in MODELS:
        raise RegistryError(f"registry: unknown model {model!r}; known: {', '.join(MODELS)}")
    folder = _project(project)
    os.chdir(folder)
    try:
        name = stage_params("registry")[MODELS[model]]
        uri = tracking_uri()
    except (ValueError, KeyError, OSError, yaml.YAMLError) as err:
        message = one_line(str(err)) or type(err).__name__
        raise RegistryError(f"registry: {folder}/params.yaml: {type(err).__name__}: {message}") from None
    if uri.startswith("sqlite:///") and not os.path.exists(uri[len("sqlite:///") :]):
        raise RegistryError(f"registry: no tracking store at {uri} yet (no stage has run in {folder})")
    # a person is waiting: a server that is down fails in seconds, not after MLflow's minutes of retries
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    client = mlflow.MlflowClient(tracking_uri=uri)
    if not model_exists(client, name) and not _guard("read the ledger", ledger.read, client, f"content.{name}."):
        _guard(f"registered model {name}", client.get_registered_model, name)  # never registered: its one line
    return client, name, f"project {folder}, tracking store {uri}"


def _command(action) -> None:
    """Run a command; a registry error ends with its one line and exit 1."""
    try:
        action()
    except RegistryError as err:
        echo(str(err), err=True)
        raise typer.Exit(1) from None


def _move(model: str, to: str, by: str, reason: str, project: str | None) -> None:
    if not reason.strip():
        raise RegistryError("registry: --reason must say why the alias moves (it is recorded)")
    client, name, where = _open(model, project)
    if not model_exists(client, name):
        raise RegistryError(
            f'registry: {name} was deleted from the registry whole; rlhf-registry restore {model} --reason "..." '
            "brings every version back with its aliases, then move it"
        )
    decision = version(client, name, to).tags.get(DECISION_TAG)
    record = move_alias(client, name, to, by, reason)  # a refusal (a pruned version, say) is its one line
    echo(where)
    before = f"from version {record['from']}" if record["from"] is not None else "(no version held it)"
    moved = f"moved {before} to {record['to']} ({by}: {record['reason']})"
    echo(f"{name}: {CHAMPION} {moved}")
    if decision != "pass":  # by hand a person may override the gate: say what was overridden
        echo(f"note: version {to} {'failed its gate' if decision == 'fail' else 'was never gated'}; moved by hand")
    if model == "reward":
        echo("Run `dvc repro` (or the pipeline flow): the gate stage writes the new champion, ppo reruns on it.")


@app.command()
def promote(
    model: str = typer.Argument("reward", help="reward or policy"),
    version_: str = typer.Option(..., "--version", help="the version to make champion"),
    reason: str = typer.Option(..., help="why (recorded with the move)"),
    project: str = typer.Option(None, help="the project folder (default: found from here)"),
) -> None:
    """Give the champion alias to a version by hand."""
    _command(lambda: _move(model, version_, "promote", reason, project))


@app.command()
def rollback(
    model: str = typer.Argument("reward", help="reward or policy"),
    reason: str = typer.Option(..., help="why (recorded with the move)"),
    project: str = typer.Option(None, help="the project folder (default: found from here)"),
) -> None:
    """Give the champion alias back to the version that held it before the current holder."""

    def action() -> None:
        client, name, _ = _open(model, project)
        _move(model, previous_holder(client, name), "rollback", reason, project)

    _command(action)


@app.command(name="restore")
def restore_command(
    model: str = typer.Argument("reward", help="reward or policy"),
    version_: str = typer.Option(
        None, "--version", help="the deleted version to bring back (default: every deleted version)"
    ),
    reason: str = typer.Option(..., help="why (recorded)"),
    project: str = typer.Option(None, help="the project folder (default: found from here)"),
) -> None:
    """Bring back a version deleted from the registry, or every version of a model deleted whole: content, tags,
    gate decision and description, then each alias that last moved to one of them (unless another version took
    it since)."""

    def action() -> None:
        client, name, where = _open(model, project)
        restored, aliases = restore(client, name, version_, reason)
        echo(where)
        for one in restored:
            if one.new is None:
                echo(
                    f"{name}: the content of deleted version {one.old} may be registered again (its record predates "
                    "the kept runs): the next gate run (dvc repro) registers it as a new version and gates it"
                )
            else:
                echo(f"{name}: version {one.old} restored as version {one.new} (gate: {one.decision}), tags kept")
        for line in aliases:
            echo(f"{name}: {line}")

    _command(action)


@app.command()
def status(
    model: str = typer.Argument("reward", help="reward or policy"),
    project: str = typer.Option(None, help="the project folder (default: found from here)"),
) -> None:
    """The champion with its metrics and gate decision, every recorded move of the alias, then the versions whose
    model files were pruned (``rlhf-housekeeping``)."""

    def action() -> None:
        client, name, where = _open(model, project)
        echo(where)
        found = holder(client, name)
        if not model_exists(client, name):
            echo(
                f"{name}: deleted from the registry whole; its content stays out until a person restores it "
                f"(rlhf-registry restore {model} --reason ... brings every version back); its history:"
            )
        elif found is None:
            latest = _guard(f"search {name}", client.search_model_versions, f"name = '{name}'")
            newest = max(latest, key=lambda v: int(v.version)) if latest else None
            last = f"; newest version {newest.version}, gate: {newest.tags.get(DECISION_TAG, 'none')}" if newest else ""
            echo(f"{name}: no version holds {CHAMPION}{last}")
        else:
            metrics = version_metrics(client, found)
            shown = ", ".join(f"{k}={metrics[k]:.6g}" for k in STATUS_METRICS if k in metrics)
            decision = found.tags.get(DECISION_TAG, "none")
            echo(f"{name}: {CHAMPION} = version {found.version} (gate: {decision}); {shown}")
        for move in history(client, name):
            line = f"  {move['at']}  {move['from'] or '(none)'} -> {move['to']}  by {move['by']}: {move['reason']}"
            echo(line + (f" (pipeline {move['pipeline_run']})" if move.get("pipeline_run") else ""))
        gone = sorted(
            (v for v in _guard(f"search {name}", client.search_model_versions, f"name = '{name}'") if pruned(v)),
            key=lambda v: int(v.version),
        )
        if gone:
            rules = sorted({pruned(v)["rule"] for v in gone})
            echo(
                f"{name}: model files pruned by rlhf-housekeeping ({', '.join(rules)}), so they cannot be promoted: "
                f"version {', '.join(str(v.version) for v in gone)}"
            )

    _command(action)


def console() -> None:
    """The console command (pyproject's scripts): :data:`app` through :func:`tasks.cli.run_command`."""
    run_command(app)


if __name__ == "__main__":
    console()
