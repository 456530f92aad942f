"""Stage gate: decide once whether the reward model just trained takes the ``champion`` alias, then write the
champion into ``models/reward_champion/`` (what ppo and evaluate train and judge against).

The candidate is the registered version whose content hash is ``models/reward``'s (registered by the reward
stage; registered here if it is missing). Its decision is stored on it as tags, so a rerun of this stage (it
reruns every time: DVC ``always_changed``) never re-decides and never undoes a person's ``promote`` or
``rollback``: it only writes whichever version holds ``champion`` now. An unchanged champion leaves
``models/reward_champion/`` untouched, so nothing downstream reruns. Inside a DVC experiment a passing
candidate is tagged a challenger and ``champion`` does not move. Writes ``reports/reward_gate.json``.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from rlhf.evaluation.gate_rules import GateCriteria, reward_gate
from tasks.kit import paths
from tasks.kit.champion import MARKER, OUT_DIR, VERSION_FILE, held_version, promote_command
from tasks.kit.common import stage_runtime
from tasks.kit.configs import config_from_params
from tasks.kit.outputs import StagedOutputs, stage_metrics, write_headline, write_metrics
from tasks.kit.params import stage_params
from tasks.kit.registry import (
    SHA_TAG,
    decide_once,
    download,
    experiment_name,
    find_by_sha,
    folder_sha256,
    holder,
    refuse_deleted,
    register,
    version_tags,
)
from tasks.kit.runs import StageRun, tracking_client

REWARD, EVAL = paths.REWARD, paths.split("rm_eval")
REPORT = paths.REWARD_GATE


def rescore(client, found, reward: dict[str, Any], device: dict[str, Any] | None) -> dict[str, float]:
    """The champion's preference metrics on the current rm_eval split (a figure from other data is not comparable)."""
    from rlhf.data.reading import load_jsonl  # noqa: PLC0415 (imports torch and transformers)
    from rlhf.models.loading import load_scalar_model, load_tokenizer  # noqa: PLC0415 (imports torch and transformers)
    from rlhf.reward.metrics import evaluate_reward_model  # noqa: PLC0415 (imports torch and transformers)

    runtime = stage_runtime("gate", device)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(OUT_DIR))) as folder:
        download(client, found, folder)
        tokenizer, model = load_tokenizer(folder), runtime.frozen(load_scalar_model(folder))
        metrics, _ = evaluate_reward_model(
            model, tokenizer, load_jsonl(EVAL), reward["max_length"], reward["eval_batch_size"], runtime
        )
    return metrics


def decide(client, name: str, candidate, metrics: dict[str, float], criteria: GateCriteria, rescorer) -> dict:
    """The candidate's decision (:func:`tasks.kit.registry.decide_once`): the current champion, if another version,
    is re-scored by ``rescorer(version) -> metrics`` on the current rm_eval split, only for a new decision."""

    def judge():
        champion = holder(client, name)
        compared = champion if champion is not None and str(champion.version) != str(candidate.version) else None
        champion_metrics = rescorer(compared) if compared is not None else None
        checks = reward_gate(metrics, champion_metrics, criteria)
        return checks, {
            "champion_compared": str(compared.version) if compared is not None else None,
            "champion_accuracy": champion_metrics["rm/accuracy"] if champion_metrics else None,
            "champion_balanced_accuracy": champion_metrics.get("rm/balanced_accuracy") if champion_metrics else None,
        }

    balanced = metrics.get("rm/balanced_accuracy")
    accuracy = (
        f"rm_eval balanced accuracy {'n/a' if balanced is None else f'{balanced:.3f}'}, "
        f"accuracy {metrics['rm/accuracy']:.3f} over {metrics['rm/pairs']:.0f} pairs"
    )
    return decide_once(client, name, candidate, judge, f"passed the reward gate ({accuracy})", what="reward gate")


WITHOUT_CHAMPION = ("stop", "candidate")
"""``registry.without_champion``: what ppo and evaluate read when no version holds the alias."""


def materialise(
    client, name: str, candidate, decision: str, outputs, without_champion: str = "stop"
) -> dict[str, Any] | None:
    """Stage the champion into ``models/reward_champion/`` unless it is already there; returns what it holds.

    With no champion, ``without_champion`` says what: ``stop``, the folder holds only :data:`MARKER`, whose
    message gives the promote command (ppo stops on it); ``candidate``, the folder holds the last candidate,
    marked ``"champion": false`` in :data:`VERSION_FILE`, so ppo and evaluate run on a model that did not pass
    (a demonstration on a machine too small to train one that does) and the policy gate fails the policy made
    from it; the alias never moves.

    Raises:
        RegistryError: the downloaded folder's content hash is not the one registered.
    """
    champion = holder(client, name)
    if champion is None and without_champion == "stop":
        message = (
            f"{OUT_DIR}: no reward model holds the champion alias of {name} (the last candidate, version "
            f"{candidate.version}, {decision}): to train against it anyway run {promote_command(candidate.version)}"
        )
        folder = outputs.folder(OUT_DIR)
        with open(os.path.join(folder, MARKER), "w", encoding="utf-8") as handle:
            json.dump({"message": message}, handle, indent=2)
        return None
    chosen = candidate if champion is None else champion
    held = {"name": name, "version": str(chosen.version), "sha256": chosen.tags.get(SHA_TAG, "")}
    held |= {"champion": False, "why": decision} if champion is None else {}
    if held_version() == held:
        return held  # already written: leave it untouched, so nothing downstream reruns
    folder = outputs.folder(OUT_DIR)
    download(client, chosen, folder)  # checked against the registered hash
    with open(os.path.join(folder, VERSION_FILE), "w", encoding="utf-8") as handle:
        json.dump(held, handle, indent=2, sort_keys=True)
    return held


def check_params(params: dict[str, Any]) -> GateCriteria:
    """The ``registry`` section's gate settings, checked before any MLflow run opens or any version is registered:
    a bad bound stops the stage whether or not it would decide.

    Returns:
        ``registry.reward_gate`` as :class:`rlhf.evaluation.gate_rules.GateCriteria`.

    Raises:
        ValueError: an unknown ``without_champion``, or a ``reward_gate`` key that is unknown or out of range (one
            line naming the key).
    """
    without_champion = params.get("without_champion", "stop")
    if without_champion not in WITHOUT_CHAMPION:
        raise ValueError(
            f"registry.without_champion must be one of {', '.join(WITHOUT_CHAMPION)}, got {without_champion!r}"
        )
    return config_from_params(GateCriteria, params["reward_gate"], "registry.reward_gate")


def run(params: dict[str, Any], reward: dict[str, Any], device: dict[str, Any] | None, outputs, run_id: str) -> dict:
    """Find (or register) the candidate, decide once, write the champion; returns the report."""
    criteria = check_params(params)
    without_champion = params.get("without_champion", "stop")
    client, _ = tracking_client()
    name = params["reward_model"]
    metrics = stage_metrics("reward")
    sha = folder_sha256(REWARD)
    candidate = find_by_sha(client, name, sha)
    if candidate is None:
        refuse_deleted(client, name, sha, 'rlhf-registry restore reward --version {version} --reason "..."')
        tags = version_tags(REWARD, reward, [paths.split("rm_train"), EVAL])
        candidate = register(client, name, REWARD, run_id, tags, reward, metrics)
    decision = decide(client, name, candidate, metrics, criteria, lambda found: rescore(client, found, reward, device))
    held = materialise(client, name, candidate, _outcome(decision), outputs, without_champion)
    return {
        "candidate": {"name": name, "version": str(candidate.version)},
        **decision,
        "champion": held,
        "run_in_experiment": experiment_name(),  # this run's (``experiment`` is the deciding run's)
        "gate/passed": 1.0 if decision["decision"] == "pass" else 0.0,
        "gate/candidate_version": float(candidate.version),
        "gate/champion_version": float(held["version"]) if held and held.get("champion", True) else None,
    }


def _outcome(decision: dict[str, Any]) -> str:
    """What became of the candidate, for the no-champion line: the true cause, not a guess."""
    if decision["decision"] == "fail":
        return "failed its gate"
    if decision.get("experiment"):
        return f"passed inside DVC experiment {decision['experiment']}, where the champion never moves"
    return (
        "passed its gate and took the alias, which was removed in the registry since (the alias, or the version "
        "holding it, deleted by hand)"
    )


def report_lines(report: dict[str, Any]) -> list[str]:
    """What the stage prints: the decision, a ``GATE FAILED: criterion, value, bound`` line per failed check,
    and the champion it wrote."""
    when = "decided now" if report["decided"] == "now" else "decided before, kept"
    lines = [
        f"[gate] {report['candidate']['name']} version {report['candidate']['version']}: {report['decision']} ({when})"
    ]
    lines += [f"[gate] {line}" for line in report["lines"] if line.startswith("GATE FAILED")]
    if report["decision"] == "pass" and report.get("experiment"):
        lines.append(f"[gate] inside DVC experiment {report['experiment']}: tagged a challenger, champion not moved")
    held = report["champion"]
    if held and held.get("champion") is False:
        lines.append(
            f"[gate] champion: none; ppo and evaluate read candidate version {held['version']}, which {held['why']} "
            "(registry.without_champion: candidate): the policy gate will fail what they make"
        )
    else:
        lines.append(f"[gate] champion: version {held['version']}" if held else "[gate] champion: none (ppo will stop)")
    return lines


def main() -> None:
    """DVC stage command."""
    params, reward, device = stage_params("registry"), stage_params("reward"), stage_params("device")
    check_params(params)  # one line before the stage's MLflow run opens
    with StageRun("gate", {**params, "device": device}) as stage, StagedOutputs() as outputs:
        report = run(params, reward, device, outputs, stage.run.info.run_id)
        stage.log({k: v for k, v in report.items() if k.startswith("gate/") and v is not None}, 0)
        write_metrics(outputs.file(REPORT), report, stage)
        write_headline(outputs, "gate", report)
    for line in report_lines(report):
        print(line, flush=True)


if __name__ == "__main__":
    from tasks.kit.common import cli

    cli(main)
