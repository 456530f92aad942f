"""Stage evaluate: the policy against the SFT model on eval_prompts, judged by the reward model.

Writes ``metrics/eval.json`` and ``reports/eval/`` (``samples.md``: prompts with both
responses; ``scores.png``: the score distributions of both models) together, after everything
that can fail (:class:`tasks.outputs.StagedOutputs`): a failed or stopped run leaves the previous
ones as they were.
"""

from __future__ import annotations

import os
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from rlhf.checkpoint import write_json
from rlhf.data import load_jsonl
from rlhf.evaluation import EvalConfig, evaluate_policy
from rlhf.models import load_causal_lm, load_scalar_model, load_tokenizer
from rlhf.rollout import GenerationSettings
from rlhf.training import config_from_params
from tasks.champion import require_champion
from tasks.common import cli, setup_torch, stage_runtime
from tasks.outputs import StagedOutputs, write_metrics
from tasks.params import stage_params
from tasks.runs import StageRun

PROMPTS, SFT, POLICY = "data/validated/eval_prompts.jsonl", "models/sft", "models/policy"
REWARD = "models/reward_champion"  # the reward model the policy was trained against (tasks/champion.py)
REPORTS, METRICS = "reports/eval", "metrics/eval.json"
PPO_METRICS, POLICY_GATE = "metrics/ppo.json", "reports/policy_gate.json"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def samples_markdown(samples: list[dict[str, Any]]) -> str:
    """The sample table as Markdown: prompt, SFT response and score, policy response and score."""
    lines = ["| prompt | SFT response | SFT reward | policy response | policy reward |", "|---|---|---|---|---|"]
    for s in samples:
        lines.append(
            f"| {_cell(s['prompt'])} | {_cell(s['sft_response'])} | {s['sft_reward']:.3f} "
            f"| {_cell(s['policy_response'])} | {s['policy_reward']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def run(
    params: dict[str, Any], generation: dict[str, Any], device: dict[str, Any] | None = None
) -> tuple[dict[str, float], list[dict[str, Any]], EvalConfig]:
    """Evaluate with the ``generation`` section PPO used; returns ``(metrics, samples, config)``.

    ``device``: the params.yaml ``device`` section (None: read from params.yaml). The SFT model (the
    reference of the KL) and the policy are placed alike, so identical weights give identical logprobs.
    """
    config = config_from_params(EvalConfig, params, "evaluate")
    settings = config_from_params(GenerationSettings, generation, "generation")
    champion = require_champion(REWARD)  # the reward model the policy was trained against
    setup_torch(config.seed)
    prompts = [row["prompt"] for row in sorted(load_jsonl(PROMPTS), key=lambda row: row["id"])]
    tokenizer = load_tokenizer(SFT)
    runtime = stage_runtime("evaluate", device)
    sft, policy = runtime.place(load_causal_lm(SFT)), runtime.place(load_causal_lm(POLICY))
    reward_model = runtime.frozen(load_scalar_model(REWARD))
    metrics, samples = evaluate_policy(sft, policy, reward_model, tokenizer, prompts, config, settings, runtime)
    return {**metrics, "eval/reward_model_version": float(champion["version"])}, samples, config


def gate_policy(metrics: dict[str, float], run_id: str) -> dict[str, Any]:
    """Register ``models/policy`` (once per content) and decide the policy gate on it, once.

    The verdict is ``registry.policy_gate.verdict``'s (the proxy reward model); a pass moves the policy's
    ``champion`` alias (:func:`tasks.registry.decide_once`). Returns the report for ``reports/policy_gate.json``.
    """
    from rlhf.gate_rules import PolicyCriteria, policy_gate
    from tasks.outputs import load_json
    from tasks.registry import decide_once, find_by_sha, folder_sha256, register, version_tags
    from tasks.runs import tracking_client

    params = stage_params("registry")
    criteria = PolicyCriteria(**params["policy_gate"])  # a bad bound stops before anything is registered
    client, _ = tracking_client()
    name, ppo = params["policy_model"], load_json(PPO_METRICS)
    candidate = find_by_sha(client, name, folder_sha256(POLICY))
    if candidate is None:
        tags = version_tags(POLICY, {**metrics, **ppo}, {"evaluate": params}, [PROMPTS])
        candidate = register(client, name, POLICY, run_id, tags)
    reason = f"passed the policy gate (win rate {metrics.get('eval/win_rate')} by the {criteria.verdict})"
    move = not params["policy_approval"]["required"]  # else a person approves in the flow (flows/approval.py)
    decision = decide_once(client, name, candidate, lambda: (policy_gate(metrics, ppo, criteria), {}), reason, move)
    return {"candidate": {"name": name, "version": str(candidate.version)}, **decision}


def main() -> None:
    """DVC stage command."""
    import mlflow

    params, generation, device = stage_params("evaluate"), stage_params("generation"), stage_params("device")
    with (
        StageRun("evaluate", {**params, "generation": generation, "device": device}) as stage,
        StagedOutputs() as outputs,
    ):
        metrics, samples, config = run(params, generation, device)
        stage.log(metrics, 0)
        mlflow.log_table({key: [s[key] for s in samples] for key in samples[0]}, artifact_file="samples.json")
        reports = outputs.folder(REPORTS)
        with open(os.path.join(reports, "samples.md"), "w", encoding="utf-8") as handle:
            handle.write(samples_markdown(samples[: config.samples_in_table]))
        figure, axis = plt.subplots(figsize=(6, 4))
        axis.hist(
            [[s["sft_reward"] for s in samples], [s["policy_reward"] for s in samples]],
            label=["SFT", "policy"],
            bins=15,
        )
        axis.set(xlabel="reward-model score", ylabel="responses", title=f"win rate {metrics['eval/win_rate']:.2f}")
        axis.legend()
        figure.savefig(os.path.join(reports, "scores.png"), dpi=90)
        mlflow.log_artifacts(reports, "eval")
        write_metrics(outputs.file(METRICS), metrics, stage)
        report = gate_policy(metrics, stage.run.info.run_id)  # last: a registry that is down keeps the old outputs
        write_json(outputs.file(POLICY_GATE), report)
    print("[evaluate] " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items()))
    candidate = report["candidate"]
    print(f"[evaluate] policy {candidate['name']} version {candidate['version']}: {report['decision']}", flush=True)
    for line in report["lines"]:
        if line.startswith("GATE FAILED"):
            print(f"[evaluate] {line}", flush=True)


if __name__ == "__main__":
    cli(main)
