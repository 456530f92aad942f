"""Stage evaluate: the policy against the SFT model on eval_prompts, by the proxy reward model and by the judge.

Also the alignment tax (perplexity on held-out ptx text, distinct-n, refusals, lengths) and the
over-optimisation curve: each policy PPO kept (``models/policy_kept``), scored by the proxy and the judge
on a fixed set of prompts against its KL to the SFT model (Gao et al. 2023).

The prompts are a fair share of each kind of data (:func:`rlhf.evaluation.by_kind.stratified`), and the base model
(``models/base``) is a third contestant, sampled and scored as SFT is, so SFT's own effect shows; every verdict is
also taken per kind (``eval/kind/<kind>/...`` in ``metrics/eval_kinds.json``, apart so that ``dvc metrics show``
stays readable).

Writes ``metrics/eval.json``, ``metrics/eval_kinds.json``, ``metrics/overoptimisation.json`` (a DVC plot),
``reports/eval/`` (``samples.json``: every prompt with both responses and their scores, and the MLflow run id;
``samples.md``; ``scores.png``) and ``reports/policy_gate.json`` together, after
everything that can fail (:class:`tasks.kit.outputs.StagedOutputs`): a failed or stopped run leaves the previous
ones as they were.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from rlhf.data.chat import check_reads_whole
from rlhf.data.kinds import kind_of, kinds_in
from rlhf.data.reading import load_jsonl
from rlhf.evaluation.by_kind import KIND_PREFIX, kind_figures, stratified
from rlhf.evaluation.evaluator import EvalConfig, Sampling, Scorers, evaluate_policy, sample_rows
from rlhf.evaluation.gate_rules import PolicyCriteria, policy_gate
from rlhf.evaluation.judge_trust import judge_figures
from rlhf.evaluation.overoptimisation import best_of_n_figures, curve
from rlhf.files import write_json
from rlhf.models.generation import GenerationSettings
from rlhf.models.loading import load_causal_lm, load_scalar_model, load_tokenizer
from rlhf.runtime.device import PhaseTimer
from rlhf.training.checkpoint import load_kept_policy
from tasks.kit import paths
from tasks.kit.champion import is_champion, require_champion
from tasks.kit.common import cli, setup_torch, stage_runtime
from tasks.kit.configs import config_from_params, derived_values
from tasks.kit.outputs import StagedOutputs, load_json, stage_metrics, write_headline, write_metrics
from tasks.kit.params import stage_params
from tasks.kit.registry import decide_once, find_by_sha, folder_sha256, refuse_deleted, register, version_tags
from tasks.kit.runs import StageRun, tracking_client

PROMPTS, PTX_HELDOUT = paths.split("eval_prompts"), paths.split("ptx_heldout")
BASE, SFT, POLICY, KEPT = paths.BASE, paths.SFT, paths.POLICY, paths.POLICY_KEPT
REWARD = paths.CHAMPION  # the reward model the policy was trained against: the proxy (tasks/kit/champion.py)
JUDGE = paths.JUDGE  # the independent judge (tasks/judge.py); its metrics: stage_metrics("judge")
REPORTS, METRICS, CURVE = paths.EVAL_REPORTS, paths.metrics("eval"), paths.OVEROPTIMISATION
KIND_METRICS = paths.EVAL_KINDS  # every eval/kind/<kind>/... figure
PPO_METRICS, POLICY_GATE = paths.metrics("ppo"), paths.POLICY_GATE


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def samples_markdown(samples: list[dict[str, Any]]) -> str:
    """The sample table as Markdown: prompt, then each model's response with its proxy and judge scores."""
    lines = [
        "| prompt | SFT response | proxy | judge | policy response | proxy | judge |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in samples:
        lines.append(
            f"| {_cell(s['prompt'])} | {_cell(s['sft_response'])} | {s['sft_proxy']:.3f} | {s['sft_judge']:.3f} "
            f"| {_cell(s['policy_response'])} | {s['policy_proxy']:.3f} | {s['policy_judge']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def kept_policies(runtime) -> dict[int, Any]:
    """Iteration -> a function that loads the policy PPO kept then (``models/policy_kept/iteration-NNNN``) on the
    device, no gradients: the over-optimisation curve's points (:func:`rlhf.evaluation.overoptimisation.curve`)."""

    def load(folder: str) -> Any:
        return runtime.place(load_kept_policy(SFT, folder)).requires_grad_(False)

    names = sorted(os.listdir(KEPT)) if os.path.isdir(KEPT) else []
    return {int(name.split("-")[-1]): functools.partial(load, os.path.join(KEPT, name)) for name in names}


def sampling_settings(config: EvalConfig, generation: GenerationSettings) -> tuple[GenerationSettings, tuple[str, int]]:
    """The generation section's settings with evaluation's own token limit (``evaluate.max_new_tokens``, when set),
    and ``(key, tokens)`` of that limit: the longest response the reward model and the judge must read whole."""
    if config.max_new_tokens is None:
        return generation, ("generation.max_new_tokens", generation.max_new_tokens)
    limit = ("evaluate.max_new_tokens", config.max_new_tokens)
    return dataclasses.replace(generation, max_new_tokens=config.max_new_tokens), limit


def run(
    params: dict[str, Any], generation: dict[str, Any], device: dict[str, Any] | None = None
) -> tuple[dict[str, float], list[dict[str, Any]], list[dict[str, float]], EvalConfig, list[str]]:
    """Evaluate with the ``generation`` section PPO used; returns ``(metrics, samples, curve rows, config, doubts)``
    (doubts: why the judge's verdicts mean nothing, :func:`rlhf.evaluation.judge_trust.judge_figures`). ``metrics``
    holds the per-kind figures too (``eval/kind/...``: :func:`rlhf.evaluation.by_kind.kind_figures`, the judge's own
    per kind).

    ``device``: the params.yaml ``device`` section (None: read from params.yaml). The SFT model (the
    reference of the KL) and the policy are placed alike, so identical weights give identical logprobs.
    """
    config = config_from_params(EvalConfig, params, "evaluate", derived_values("evaluate", stage_params))
    settings, longest = sampling_settings(config, config_from_params(GenerationSettings, generation, "generation"))
    champion = require_champion(REWARD)  # the reward model the policy was trained against
    setup_torch(config.seed)
    rows = stratified(load_jsonl(PROMPTS), config.max_prompts)  # a fair share of each kind, by id
    prompts, kinds = [row["prompt"] for row in rows], [kind_of(row) for row in rows]
    tokenizer = load_tokenizer(SFT)
    runtime = stage_runtime("evaluate", device)
    # never trained here: requires_grad off, so models that share frozen blocks run them once (rlhf.models.trunk)
    sft, policy = (runtime.place(load_causal_lm(path)).requires_grad_(False) for path in (SFT, POLICY))
    # no SFT (sft.steps 0): models/sft is the base model, byte for byte, evaluated once
    base = (
        sft if folder_sha256(SFT) == folder_sha256(BASE) else runtime.place(load_causal_lm(BASE)).requires_grad_(False)
    )
    scorers = Scorers(
        runtime.frozen(load_scalar_model(REWARD)), runtime.frozen(load_scalar_model(JUDGE)), load_tokenizer(JUDGE)
    )
    for reader, model, reads in (
        (f"{REWARD} (trained at max_length)", scorers.proxy, config.max_prompt_length),
        (f"{JUDGE} (trained at max_length)", scorers.judge, config.max_prompt_length),
        ("judge.max_length (evaluate's judge_max_length)", None, config.max_prompt_length),
    ):
        length = config.judge_max_length if model is None else getattr(model.config, "reward_max_length", None)
        check_reads_whole(reader, length, ("ppo.max_prompt_length (evaluate's max_prompt_length)", reads), longest)
    timer = PhaseTimer(runtime)  # eval/time/{comparison,curve,best_of_n} and, summed over them, each phase of a sample
    sampling = Sampling(scorers, tokenizer, config, settings, runtime, timer)
    with timer("comparison"):
        heldout = load_jsonl(PTX_HELDOUT)
        metrics, runs = evaluate_policy(sft, policy, prompts, heldout, sampling, base=base, kinds=kinds)
    del policy, base
    metrics |= kind_figures(runs, kinds, config.bootstrap_resamples, config.seed)
    shipped = int(stage_metrics("ppo").get("ppo/shipped_iteration", 0))
    sampled = {shipped: runs["policy"], 0: runs["sft"]}
    with timer("curve"):
        rows_of_curve = curve(sft, prompts, sampling, sampled=sampled, kept=kept_policies(runtime), kinds=kinds)
    with timer("best_of_n"):
        metrics |= best_of_n_figures(sft, prompts, sampling, sampled=runs["sft"], kinds=kinds)
    metrics |= timer.stats("eval/time")
    judge, doubts = judge_figures(stage_metrics("judge"), config.judge_min_length_accuracy, sorted(set(kinds)))
    metrics |= judge | {
        "eval/reward_model_version": float(champion["version"]),
        "eval/reward_model_champion": float(is_champion(champion)),
    }
    return metrics, sample_rows(rows, runs), rows_of_curve, config, doubts


def summary_lines(metrics: dict[str, float], doubts: list[str]) -> list[str]:
    """The printed verdicts: the judge's win rate beside its own accuracy (or why it means nothing), the proxy's;
    each followed by its paired score difference and length-controlled win rate (undefined when not recorded)."""

    def rate(who: str) -> str:
        m = {k: metrics.get(f"eval/{who}/{k}") for k in ("win_rate", "win_rate_low", "win_rate_high")}
        if m["win_rate"] is None or not math.isfinite(m["win_rate"]):
            return f"undefined (no decisive comparison, {metrics[f'eval/{who}/ties']:.0f} ties)"
        return (
            f"{m['win_rate']:.3f} [{m['win_rate_low']:.3f}, {m['win_rate_high']:.3f}] (95%, bootstrap over prompts) "
            f"over {metrics[f'eval/{who}/decisive']:.0f} decisive comparisons, {metrics[f'eval/{who}/ties']:.0f} ties"
        )

    def change(who: str) -> str:
        def interval(key: str) -> str:
            m = [metrics.get(f"eval/{who}/{key}{end}") for end in ("", "_low", "_high")]
            return "undefined" if m[0] is None or not math.isfinite(m[0]) else f"{m[0]:.3f} [{m[1]:.3f}, {m[2]:.3f}]"

        coef = metrics.get(f"eval/{who}/lc_length_coef")
        return (
            f"[evaluate]   score difference policy - SFT {interval('score_diff')}; length-controlled win rate "
            f"{interval('lc_win_rate')} (95%, bootstrap over prompts; length coefficient "
            f"{'undefined' if coef is None or not math.isfinite(coef) else f'{coef:.3f}'})"
        )

    accuracy = tuple(metrics[f"eval/judge/accuracy{s}"] for s in ("", "_low", "_high"))
    balanced = tuple(metrics.get(f"eval/judge/balanced_accuracy{s}", math.nan) for s in ("", "_low", "_high"))
    lines = [
        f"[evaluate] win rate over SFT by the judge: {rate('judge')}",
        change("judge"),
        f"[evaluate]   judge accuracy on judge_eval {accuracy[0]:.3f} [{accuracy[1]:.3f}, {accuracy[2]:.3f}], "
        f"balanced {balanced[0]:.3f} [{balanced[1]:.3f}, {balanced[2]:.3f}], "
        f"length accuracy {metrics['eval/judge/length_accuracy']:.3f}",
    ]
    lines += [f"[evaluate]   WARNING: the judge's verdicts are MEANINGLESS: {doubt}" for doubt in doubts]
    lines.append(f"[evaluate] win rate over SFT by the proxy (the reward model PPO optimised): {rate('proxy')}")
    lines.append(change("proxy"))
    return lines + kind_lines(metrics)


def kind_lines(metrics: dict[str, float]) -> list[str]:
    """The printed verdicts of each kind (``eval/kind/<kind>/...``): the judge's win rate, length-controlled win
    rate and score difference against SFT, SFT's against the base model, and the refusal rates with the policy's
    increase over SFT; each with its 95% interval over prompts, n/a where undefined or not recorded."""

    def interval(key: str) -> str:
        m = [metrics.get(f"{key}{end}") for end in ("", "_low", "_high")]
        return "n/a" if m[0] is None or not math.isfinite(m[0]) else f"{m[0]:.3f} [{m[1]:.3f}, {m[2]:.3f}]"

    def rate(key: str) -> str:
        value = metrics.get(key)
        return "n/a" if value is None or not math.isfinite(value) else f"{value:.3f}"

    lines = []
    for kind in kinds_in(metrics, "eval"):
        p = f"{KIND_PREFIX}{kind}/"
        lines += [
            f"[evaluate] {kind} prompts ({metrics.get(p + 'prompts', 0):.0f}): by the judge win rate over SFT "
            f"{interval(p + 'judge_win_rate')}, length-controlled {interval(p + 'judge_lc_win_rate')}, score "
            f"difference {interval(p + 'judge_score_diff')}; by the proxy {interval(p + 'proxy_win_rate')}",
            f"[evaluate]   SFT over the base model by the judge {interval(p + 'sft_vs_base/judge_win_rate')}, "
            f"length-controlled {interval(p + 'sft_vs_base/judge_lc_win_rate')}; refusal rate base "
            f"{rate(p + 'base_refusal_rate')}, SFT {rate(p + 'sft_refusal_rate')}, policy "
            f"{rate(p + 'policy_refusal_rate')}, policy - SFT {interval(p + 'refusal_increase')}",
        ]
    return lines


def scores_figure(samples: list[dict[str, Any]], folder: str) -> None:
    """``scores.png``: the proxy and the judge score distributions of both models' responses."""
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, who in zip(axes, ("proxy", "judge"), strict=True):
        axis.hist([[s[f"sft_{who}"] for s in samples], [s[f"policy_{who}"] for s in samples]], label=["SFT", "policy"])
        axis.set(xlabel=f"{who} score", ylabel="responses", title=f"scores by the {who}")
        axis.legend()
    figure.savefig(os.path.join(folder, "scores.png"), dpi=90)
    plt.close(figure)


def policy_criteria() -> Any:
    """``registry.policy_gate`` as :class:`rlhf.evaluation.gate_rules.PolicyCriteria`; raises ValueError on a bad
    bound or
    verdict (the stage asks first, before any model is loaded)."""
    return config_from_params(PolicyCriteria, stage_params("registry")["policy_gate"], "registry.policy_gate")


def gate_policy(metrics: dict[str, float], run_id: str, doubts: list[str] | None = None) -> dict[str, Any]:
    """Register ``models/policy`` (once per content) and decide the policy gate on it, once.

    The verdict is ``registry.policy_gate.verdict``'s (the judge by default; ``doubts``: why its verdicts
    mean nothing, for the report); a pass moves the policy's ``champion`` alias
    (:func:`tasks.kit.registry.decide_once`). Returns the report for ``reports/policy_gate.json``.
    """
    params = stage_params("registry")
    criteria = policy_criteria()  # a bad bound stops before anything is registered
    client, _ = tracking_client()
    name, ppo = params["policy_model"], load_json(PPO_METRICS)
    sha = folder_sha256(POLICY)
    candidate = find_by_sha(client, name, sha)
    if candidate is None:
        refuse_deleted(client, name, sha, 'rlhf-registry restore policy --version {version} --reason "..."')
        tags = version_tags(POLICY, {"evaluate": params}, [PROMPTS])
        candidate = register(client, name, POLICY, run_id, tags, {"evaluate": params}, {**metrics, **ppo})
    win = metrics.get(f"eval/{criteria.verdict}/win_rate")
    reason = f"passed the policy gate (win rate {win} by the {criteria.verdict})"
    move = not params["policy_approval"]["required"]  # else a person approves in the flow (flows/approval.py)

    def judge() -> tuple[list, dict]:  # runs only for a version not decided before
        return policy_gate(metrics, ppo, criteria, doubts), {}

    decision = decide_once(client, name, candidate, judge, reason, move, what="policy gate")
    return {"candidate": {"name": name, "version": str(candidate.version)}, **decision}


def gate_lines(report: dict[str, Any]) -> list[str]:
    """What the stage prints of the policy gate: the decision, whether it was taken now or is the one stored on
    this policy content before (with when; its figures are that run's, not this one's), and each failed check."""
    candidate = report["candidate"]
    when = "decided now" if report["decided"] == "now" else f"decided before, at {report['decided_at']}, kept"
    head = f"[evaluate] policy {candidate['name']} version {candidate['version']}: {report['decision']} ({when})"
    return [head] + [f"[evaluate] {line}" for line in report["lines"] if line.startswith("GATE FAILED")]


def main() -> None:
    """DVC stage command."""
    import mlflow  # noqa: PLC0415 (MLflow: seconds to import)

    params, generation, device = stage_params("evaluate"), stage_params("generation"), stage_params("device")
    policy_criteria()  # a bad registry.policy_gate stops here, not after the evaluation
    with (
        StageRun("evaluate", {**params, "generation": generation, "device": device}) as stage,
        StagedOutputs() as outputs,
    ):
        metrics, samples, rows, config, doubts = run(params, generation, device)
        stage.log(metrics, 0)
        reports = outputs.folder(REPORTS)
        write_json(os.path.join(reports, "samples.json"), {"run_id": stage.run.info.run_id, "samples": samples})
        with open(os.path.join(reports, "samples.md"), "w", encoding="utf-8") as handle:
            handle.write(samples_markdown(samples[: config.samples_in_table]))
        scores_figure(samples, reports)
        mlflow.log_artifacts(reports, "eval")
        by_iteration = {r["iteration"]: {k: v for k, v in r.items() if k != "iteration"} for r in rows}
        overall = {k: v for k, v in metrics.items() if not k.startswith(KIND_PREFIX)}
        write_metrics(outputs.file(METRICS), overall, stage, curves={outputs.file(CURVE): by_iteration})
        kinds = {k: v if math.isfinite(v) else None for k, v in metrics.items() if k.startswith(KIND_PREFIX)}
        write_json(outputs.file(KIND_METRICS), kinds)  # undefined (NaN) as null, as write_metrics writes it
        report = gate_policy(metrics, stage.run.info.run_id, doubts)  # last: a registry that is down keeps the old
        write_json(outputs.file(POLICY_GATE), report)
        write_headline(outputs, "evaluate", {**metrics, "gate/passed": float(report["decision"] == "pass")})
    for line in summary_lines(metrics, doubts):
        print(line, flush=True)
    shown = ("win_rate", "score_diff", "lc_length_coef", KIND_PREFIX)  # in summary_lines
    print(
        "[evaluate] " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if not any(s in k for s in shown)),
        flush=True,
    )
    for line in gate_lines(report):
        print(line, flush=True)


if __name__ == "__main__":
    cli(main)
