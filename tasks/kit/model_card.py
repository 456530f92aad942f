"""The model card of an exported policy: what it is, what it was trained on and with, how it scored, where it came from.

:func:`card_facts` gathers the facts (run from the project root): params.yaml (read with
:func:`tasks.kit.params.read_params`, which refuses credentials), the data fingerprints, the metrics (the registered
version's run's metrics, else ``metrics/*.json``), the lineage (git, ``dvc.lock``, MLflow runs).
:func:`render_card` writes them as a Hugging Face ``ModelCard`` (YAML front matter + Markdown). Nothing is
silently dropped: a fact nobody recorded reads ``unknown``. No environment variable is ever copied into a card.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import re
from datetime import UTC, datetime
from importlib import resources
from typing import Any

import yaml

from rlhf.data.kinds import kinds_in
from tasks.kit import paths
from tasks.kit.outputs import is_part_figure, load_json, stage_metrics
from tasks.kit.params import load_yaml, read_params, stage_params
from tasks.kit.registry import (
    COMMIT_TAG,
    DATA_TAG,
    DECISION_TAG,
    REASON_TAG,
    SHA_TAG,
    RegistryError,
    files_sha256,
    folder_sha256,
    version,
    version_metrics,
)
from tasks.kit.runs import PIPELINE_RUN_TAG, git_commit
from tasks.kit.secrets import find_secrets

UNKNOWN = "unknown"
PARAM_SECTIONS = ("sft", "reward", "ppo", "generation", "evaluate")
EVAL, REWARD, JUDGE = paths.metrics("eval"), paths.metrics("reward"), paths.metrics("judge")
EVAL_KINDS = paths.EVAL_KINDS  # the same verdicts per kind of prompt (eval/kind/<kind>/...)
PROMPTS, SOURCES = paths.split("eval_prompts"), paths.SOURCES
DVC_LOCK, POLICY = "dvc.lock", paths.POLICY
PRESETS = {
    "ppo_max": "reward normalisation and clipping, value clipping, critic pre-training, PPO-ptx",
    "vanilla": "PPO-clip with a KL penalty only",
}

TEMPLATE = (resources.files("tasks.kit") / "templates/model_card.md").read_text(encoding="utf-8")  # a Jinja template


def _number(value: Any) -> float | None:
    """A metric as a float: NaN for one recorded as undefined (null, ``nan``), None when it is not a number."""
    if value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def show(metrics: dict[str, Any], key: str, digits: int = 3) -> str:
    """``metrics[key]`` with its 95% interval (``key_low``/``key_high``) when recorded: ``0.620 (95% CI
    0.510-0.720)``; ``unknown`` when not recorded, ``undefined`` when recorded as null or NaN."""
    if key not in metrics:
        return UNKNOWN
    value = _number(metrics[key])
    if value is None or not math.isfinite(value):
        return "undefined (recorded as null: no decisive comparison)" if value is not None else str(metrics[key])
    text = f"{value:.{digits}f}"
    low, high = _number(metrics.get(f"{key}_low")), _number(metrics.get(f"{key}_high"))
    if f"{key}_low" in metrics and low is not None and high is not None and math.isfinite(low) and math.isfinite(high):
        text += f" (95% CI {low:.{digits}f}-{high:.{digits}f})"
    return text


def sha256_file(path: str) -> str:
    """Hex sha256 of a file's bytes, or ``unknown`` when it does not exist."""
    if not os.path.isfile(path):
        return UNKNOWN
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _load(path: str) -> dict[str, Any]:
    """A JSON object file, or ``{}`` when there is none. Raises ValueError on bad JSON."""

    return load_json(path) if os.path.isfile(path) else {}


def _dvc_out_md5(path: str) -> str:
    """The md5 ``dvc.lock`` records for the output ``path`` (``models/policy``), or ``unknown``."""
    if not os.path.isfile(DVC_LOCK):
        return UNKNOWN
    lock = load_yaml(DVC_LOCK, written_by_dvc=True) or {}
    for stage, entry in (lock.get("stages") or {}).items():
        for out in entry.get("outs") or []:
            if out.get("path") == path:
                return f"`{out.get('md5', UNKNOWN)}` (stage {stage})"
    return UNKNOWN


def _reward_metrics(client, registry: dict[str, Any], metrics: dict[str, Any], found) -> tuple[dict[str, Any], str]:
    """The reward model's metrics: its registered version's tags (the version the evaluation names), else
    ``metrics/reward.json``; and where they came from."""

    number = _number(metrics.get("eval/reward_model_version", ""))
    if found is not None and client is not None and number is not None and math.isfinite(number):
        name = registry.get("reward_model", "")
        try:
            return version_metrics(client, version(client, name, int(number))), f"registry {name} v{int(number)}"
        except RegistryError:
            pass  # not in this store: the project's own file below
    return (stage_metrics("reward"), REWARD) if os.path.isfile(REWARD) else ({}, UNKNOWN)


def _run_lineage(client, run_id: str) -> list[tuple[str, str]]:
    """The pipeline's parent MLflow run of ``run_id`` and every stage run under it."""
    from mlflow.exceptions import MlflowException  # noqa: PLC0415 (MLflow: seconds to import)

    try:
        run = client.get_run(run_id)
        parent = run.data.tags.get("mlflow.parentRunId")
        if not parent:
            return [("MLflow pipeline (parent) run", f"{UNKNOWN} (run {run_id} has no parent run)")]
        children = client.search_runs([run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent}'")
    except (MlflowException, OSError) as err:
        return [("MLflow pipeline (parent) run", f"{UNKNOWN} ({type(err).__name__})")]
    stages = sorted(f"{c.data.tags.get('rlhf.stage', '?')} `{c.info.run_id}`" for c in children)
    return [("MLflow pipeline (parent) run", f"`{parent}`"), ("MLflow stage runs of that pipeline", ", ".join(stages))]


def _metric_facts(found, client, registry: dict[str, Any], folder_sha: str) -> dict[str, Any]:
    """The Metrics section: the key rows (name, value with interval, source), the other eval metrics, the judge
    warning; from the metrics of the run that registered the version, else the project's metrics files, but only
    for the model they measured (the folder's content is that of ``models/policy``): another folder's metrics are
    unknown."""

    evaluated = os.path.isdir(POLICY) and folder_sha256(POLICY) == folder_sha
    if found is not None:
        metrics = version_metrics(client, found)
        metrics_from = f"the metrics of the MLflow run that registered {found.name} v{found.version}"
        where = dict.fromkeys(metrics, f"registry v{found.version}")
    elif evaluated:
        metrics, kinds = _load(EVAL), _load(EVAL_KINDS)
        metrics_from = f"the project's {EVAL}" if os.path.isfile(EVAL) else f"{UNKNOWN} (no {EVAL}, not registered)"
        metrics_from += f" and {EVAL_KINDS}" if kinds else ""
        where = dict.fromkeys(metrics, EVAL) | dict.fromkeys(kinds, EVAL_KINDS)
        metrics |= kinds
    else:
        metrics, where = {}, {}
        metrics_from = f"{UNKNOWN}: this folder is neither a registered version nor the evaluated {POLICY}"
    reward, reward_from = _reward_metrics(client, registry, metrics, found)
    judged = stage_metrics("judge") if os.path.isfile(JUDGE) else {}
    judge = {f"eval/{k}": v for k, v in judged.items()} if "eval/judge/accuracy" not in metrics else {}
    metrics |= reward | judge
    where |= dict.fromkeys(reward, reward_from) | dict.fromkeys(judge, JUDGE)
    proxy = "eval/proxy/win_rate" if "eval/proxy/win_rate" in metrics else "eval/win_rate"  # the name before issue 11
    rows = {
        "Judge win rate over SFT": "eval/judge/win_rate",
        "Proxy (trained-against RM) win rate over SFT": proxy,
        "Judge length-controlled win rate over SFT (at equal length)": "eval/judge/lc_win_rate",
        "Proxy length-controlled win rate over SFT (at equal length)": "eval/proxy/lc_win_rate",
        "Judge score difference, policy - SFT (same prompts)": "eval/judge/score_diff",
        "Proxy score difference, policy - SFT (same prompts)": "eval/proxy/score_diff",
        "KL to SFT (nats per response)": "eval/policy/kl",
        "Reward-model accuracy (rm_eval)": "rm/accuracy",
        "Reward-model balanced accuracy (mean of chosen-shorter and chosen-longer)": "rm/balanced_accuracy",
        "Reward model: the prefer-the-shorter baseline's accuracy": "rm/length_baseline_accuracy",
        "Judge accuracy (its held-out split)": "eval/judge/accuracy",
        "Judge balanced accuracy (its held-out split)": "eval/judge/balanced_accuracy",
        "Policy EOS rate": "eval/policy/eos_rate",
        "Eval prompts": "eval/prompts",
    }
    rows |= kind_rows(metrics) | scorer_kind_rows(metrics)
    shown = [
        (name, show(metrics, key, 0 if key.endswith("/prompts") else 3), where.get(key, UNKNOWN))
        for name, key in rows.items()
    ]
    keys = {f"{k}{end}" for k in rows.values() for end in ("", "_low", "_high")}
    shown += [
        (f"`{k}`", show(metrics, k, 4), where.get(k, UNKNOWN))
        for k in sorted(metrics)
        if k.startswith("eval/") and k not in keys and not is_part_figure(k)  # per kind: the rows above
    ]
    judge_warning = None
    if _number(metrics.get("eval/judge/meaningful", "")) == 0.0:
        judge_warning = (
            "the judge is not meaningful (eval/judge/meaningful = 0: its balanced-accuracy interval "
            "does not lie above 0.5, or it ranks by length), so its win rates mean nothing."
        )
    elif "eval/judge/meaningful" not in metrics:
        judge_warning = "whether the judge is meaningful is unknown (no eval/judge/meaningful recorded)."
    return {
        "metrics_from": metrics_from,
        "metrics": shown,
        "metrics_raw": metrics,
        "judge_warning": judge_warning,
    }


def scorer_kind_rows(metrics: dict[str, Any]) -> dict[str, str]:
    """The card's rows of the reward model's and the judge's held-out figures per kind of data
    (``rm/kind/<kind>/...``, ``eval/judge/kind/<kind>/...``): balanced accuracy, and how often an empty answer
    beats the chosen response (the reward model's)."""
    rows = {}
    for kind in kinds_in(metrics, "rm"):
        rows[f"Reward model on {kind} pairs: balanced accuracy"] = f"rm/kind/{kind}/balanced_accuracy"
        rows[f"Reward model on {kind} prompts: an empty answer beats the chosen one"] = (
            f"rm/kind/{kind}/empty_beats_chosen"
        )
    for kind in kinds_in(metrics, "eval/judge"):
        rows[f"Judge on {kind} pairs: balanced accuracy"] = f"eval/judge/kind/{kind}/balanced_accuracy"
    return rows


def kind_rows(metrics: dict[str, Any]) -> dict[str, str]:
    """The card's rows per kind of prompt (``eval/kind/<kind>/...``, :func:`rlhf.evaluation.by_kind.kind_figures`):
    row name -> metric, for each kind the metrics hold; the policy's verdicts against SFT, SFT's against the base
    model, the refusal rates and the policy's increase over SFT."""
    rows = {}
    for kind in kinds_in(metrics, "eval"):
        p = f"eval/kind/{kind}/"
        rows |= {
            f"{kind} prompts: judge win rate over SFT": p + "judge_win_rate",
            f"{kind} prompts: judge length-controlled win rate over SFT": p + "judge_lc_win_rate",
            f"{kind} prompts: judge score difference, policy - SFT": p + "judge_score_diff",
            f"{kind} prompts: proxy win rate over SFT": p + "proxy_win_rate",
            f"{kind} prompts: SFT's judge win rate over the base model": p + "sft_vs_base/judge_win_rate",
            f"{kind} prompts: policy refusal rate": p + "policy_refusal_rate",
            f"{kind} prompts: SFT refusal rate": p + "sft_refusal_rate",
            f"{kind} prompts: base model refusal rate": p + "base_refusal_rate",
            f"{kind} prompts: refusal rate increase, policy - SFT": p + "refusal_increase",
            f"{kind} prompts: eval prompts": p + "prompts",
        }
    return rows


def _data_facts(data: dict[str, Any], tags: dict[str, str]) -> dict[str, Any]:
    """The Data section: sources with their fingerprints (data/sources.json), the version's data hash and
    whether the checkout's eval prompts match it, the sha256 of every data/validated/*.jsonl."""

    sources = _load(SOURCES).get("sources") or []
    hashes = [
        {
            "url": s.get("url", UNKNOWN),
            "hash": (s.get("fingerprint") or {}).get("sha256") or json.dumps(s.get("fingerprint") or UNKNOWN),
        }
        for s in sources
    ]
    registered = tags.get(DATA_TAG)
    if not os.path.isfile(PROMPTS):
        match = f"{UNKNOWN} (not in the project)"
    elif registered:
        match = "matches" if files_sha256([PROMPTS]) == registered else "differs: the version saw other eval prompts"
    else:
        match = "no registered hash to compare with"
    return {
        "data_source": data.get("source", UNKNOWN),
        "more_sources": [s.get("source", UNKNOWN) for s in data.get("more_sources") or []],
        "source_hashes": hashes or [{"url": data.get("source", UNKNOWN), "hash": f"{UNKNOWN} (no {SOURCES})"}],
        "data_sha256": f"`{registered}`" if registered else UNKNOWN,
        "prompts_match": match,
        "data_files": [(os.path.basename(p), sha256_file(p)) for p in sorted(glob.glob(paths.split("*")))],
        "hh": "hh-rlhf" in str(data.get("source", "")).lower(),
    }


def _lineage(found, client, folder_sha: str, commit_now: str) -> list[tuple[str, str]]:
    """The Lineage rows: registry name and version, gate decision, content hash, git commits, dvc.lock, MLflow runs."""

    tags = found.tags if found is not None else {}
    registered = f"{UNKNOWN} (no registered version has this content)"
    if found is not None:
        aliases = ", ".join(getattr(found, "aliases", None) or [])
        registered = f"{found.name} version {found.version}" + (f" (aliases: {aliases})" if aliases else "")
    same = " (= the registered rlhf.model_sha256)" if tags.get(SHA_TAG) == folder_sha else ""
    run_id = found.run_id if found is not None and found.run_id else None
    rows = [
        ("Registered model", registered),
        ("Policy gate decision", tags.get(DECISION_TAG, UNKNOWN)),
        ("Model content sha256 (folder)", f"`{folder_sha}`{same}"),
        ("Git commit (at registration)", f"`{tags[COMMIT_TAG]}`" if COMMIT_TAG in tags else UNKNOWN),
        ("Git commit of the project (at export)", f"`{commit_now}`" if commit_now != "no-git" else UNKNOWN),
        ("dvc.lock sha256 (at export)", f"`{sha256_file(DVC_LOCK)}`" if os.path.isfile(DVC_LOCK) else UNKNOWN),
        ("dvc.lock md5 of models/policy", _dvc_out_md5(POLICY)),
        ("MLflow run that registered it (evaluate)", f"`{run_id}`" if run_id else UNKNOWN),
        (
            "MLflow pipeline run id (rlhf.pipeline_run_id)",
            f"`{tags[PIPELINE_RUN_TAG]}`" if PIPELINE_RUN_TAG in tags else UNKNOWN,
        ),
    ]
    if run_id and client is not None:
        return rows + _run_lineage(client, run_id)
    return rows + [("MLflow pipeline (parent) run", UNKNOWN)]


def card_facts(
    folder_sha: str, found=None, client=None, exported_from: str = "", dtype: str = UNKNOWN
) -> dict[str, Any]:
    """Everything the card says, as template values; run from the project root (params.yaml, metrics/, dvc.lock).

    Args:
        folder_sha: :func:`tasks.kit.registry.folder_sha256` of the exported model folder.
        found: the registered ``ModelVersion`` the model is (from the registry, or a folder whose content
            hash a version carries), or None.
        client: the ``MlflowClient`` of ``found``'s store (None without one).
        exported_from: where the weights came from, in words.
        dtype: the dtype the weights are written in (``bfloat16`` or ``float32``).

    Raises:
        FileNotFoundError: no params.yaml. ValueError: params.yaml holds a credential or a bad section.
    """
    from rlhf.models.loading import resolve_model_source  # noqa: PLC0415 (imports torch and transformers)

    params = read_params()
    section = {name: stage_params(name, params) if name in params else None for name in PARAM_SECTIONS}
    section |= {"judge": stage_params("judge", params)} if "judge" in params else {}  # the independent judge
    model, data, registry, ppo = (
        {} if name not in params else stage_params(name, params) for name in ("model", "data", "registry", "ppo")
    )
    base, detail = model.get("source", UNKNOWN), ""
    try:
        gguf = resolve_model_source(base)[1]
        detail = f"GGUF file {gguf}, dequantised to float32" if gguf else ""
    except (FileNotFoundError, ValueError, OSError):
        detail = "not found on this machine"
    preset = params.get("ppo", {}).get("preset", UNKNOWN)
    lora = f", LoRA rank {ppo['lora_rank']} merged into the weights" if ppo.get("lora_rank") else ""
    tags, commit_now = (found.tags if found is not None else {}), git_commit()
    note = None
    if tags.get(COMMIT_TAG) and tags[COMMIT_TAG] != commit_now:
        note = (
            f"the params are the checkout's (commit {commit_now}); the version was trained at commit "
            f"{tags[COMMIT_TAG]}, whose params.yaml may differ."
        )
    metric_facts = _metric_facts(found, client, registry, folder_sha)
    sft_steps = (section.get("sft") or {}).get("steps")
    sft = (
        "no SFT (sft.steps 0: the base model is the start)"
        if sft_steps == 0
        else "supervised fine-tuning (SFT) on the sft split"
    )
    return {
        "verdict": _verdict(tags, found),
        "weights_dtype": dtype,
        "model_name": f"{found.name} v{found.version}" if found is not None else "RLHF policy (unregistered)",
        "exported_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "exported_from": exported_from or UNKNOWN,
        "base_model": base,
        "base_detail": detail,
        "random_weights": f"random_init {json.dumps(model['random_init'])}" if model.get("random_init") else "",
        "training": (
            f"{sft} -> a Bradley-Terry reward model on rm_train (gated in the registry) -> PPO, preset `{preset}` "
            f"({PRESETS.get(preset, 'see Params')}), KL coefficient {ppo.get('kl_coef', UNKNOWN)} to the start"
            f"{lora}"
        ),
        **_data_facts(data, tags),
        "profile": params.get("profile", "demo"),
        "ppo_preset": preset,
        "params_from": f"params.yaml of the project at commit {commit_now}",
        "params_note": note,
        "params_yaml": yaml.safe_dump({k: UNKNOWN if v is None else v for k, v in section.items()}, sort_keys=False),
        **metric_facts,
        "lineage": _lineage(found, client, folder_sha, commit_now),
        "intended_use": list(INTENDED_USE),
        "limitations": limitations(bool(model.get("random_init")), metric_facts["judge_warning"], tags, found),
    }


def _verdict(tags: dict[str, str], found) -> str:
    """The card's first line: the policy gate's decision on this version, with its reasons when it failed."""
    if found is None:
        return "not a registered version: no policy gate decided on it."
    decision = tags.get(DECISION_TAG)
    if decision is None:
        return f"{found.name} version {found.version} has no policy gate decision yet."
    why = tags.get(REASON_TAG, "")
    return (
        f"{found.name} version {found.version} **{'passed' if decision == 'pass' else 'FAILED'}** its policy gate"
        + (f": {why}." if decision != "pass" and why else ".")
    )


INTENDED_USE = (  # the card's "Intended use" section
    "Research and teaching: studying RLHF (SFT, reward modelling, PPO-max) at small scale and comparing runs "
    "of this pipeline.",
    "Looking at the policy's behaviour by hand (`rlhf-model chat`) and generating responses to prompt files "
    "for further evaluation (`rlhf-model generate`).",
    "Out of scope: production or any user-facing service, advice people act on (medical, legal, financial, "
    "safety), decisions about people.",
)


def limitations(random_weights: bool, judge_doubtful: Any, tags: dict[str, str], found) -> list[str]:
    """What the model cannot be trusted for (the card's "Limitations" section); a few lines depend on the run."""
    lines = [
        "A small research model aligned on HH-RLHF preference pairs (the HH-RLHF harmless-base red-teaming pairs, and "
        "the helpful sets where the data names them: see Data) with a CPU-sized budget of PPO steps. Its verdicts "
        "per kind of prompt are in Metrics: a win on one kind (saying less on harmless prompts) can hide a loss on "
        "another (refusing ordinary requests).",
        "The reward model is a proxy for human preference and PPO optimised it: the proxy win rate overstates the "
        "real improvement (reward over-optimisation). The judge is an independent reward model, still not a human.",
        "Win rates are against the SFT model on a few dozen held-out prompts: their intervals are wide.",
        "English only. HH-RLHF holds offensive and harmful requests; the model can produce harmful, false or "
        "biased text, and may refuse too much or too little.",
        "Responses were limited to the generation section's max_new_tokens in training; longer ones are untested.",
    ]
    if random_weights:
        lines.append("This export has random base weights (a test profile): its output is noise.")
    if judge_doubtful:
        lines.append("The judge's verdict is not established for this model (see Metrics).")
    if tags.get("rlhf.gate.decision") == "fail":
        lines.append("This version FAILED its policy gate.")
    if found is None:
        lines.append(
            "This folder matches no registered version: its metrics are the project's latest files when "
            "it is the evaluated models/policy, unknown otherwise."
        )
    return lines


def render_card(facts: dict[str, Any]):
    """The ``huggingface_hub.ModelCard`` of :func:`card_facts`: YAML front matter (base model, tags, language,
    library, a model-index of the win rates, raw and length-controlled, and KL) and the Markdown body.

    Raises:
        ValueError: the rendered card would hold something that looks like a credential (names what).
    """
    from huggingface_hub import EvalResult, ModelCard, ModelCardData  # noqa: PLC0415 (huggingface_hub: only the card needs it)

    metrics, results = facts["metrics_raw"], []
    names = {
        "eval/judge/win_rate": "judge win rate",
        "eval/proxy/win_rate": "proxy win rate",
        "eval/win_rate": "proxy win rate",
        "eval/judge/lc_win_rate": "judge length-controlled win rate",
        "eval/proxy/lc_win_rate": "proxy length-controlled win rate",
        "eval/policy/kl": "KL to SFT",
    }
    for key, name in names.items():
        if key == "eval/win_rate" and "eval/proxy/win_rate" in metrics:
            continue
        if key.startswith("eval/judge/") and facts["judge_warning"]:  # the body says why it means nothing
            continue
        value = _number(metrics.get(key, ""))
        if value is not None and math.isfinite(value):
            results.append(
                EvalResult(
                    task_type="text-generation",
                    dataset_type="Anthropic/hh-rlhf" if facts["hh"] else "local",
                    dataset_name="held-out eval prompts",
                    dataset_split="eval_prompts",
                    metric_type=key.split("/", 1)[1].replace("/", "_"),
                    metric_name=name,
                    metric_value=round(value, 6),
                )
            )
    base = facts["base_model"]
    hub_id = base.count("/") == 1 and ":" not in base and not os.path.exists(base) and not base.endswith(".gguf")
    data = ModelCardData(
        base_model=base if hub_id else None,
        language="en",
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["rlhf", "ppo", "ppo-max", "reward-model", "sft", "safetensors"],
        model_name=facts["model_name"],
        eval_results=results or None,
        base_model_source=base,  # model.source as params.yaml names it (not always a Hub id)
    )
    text = str(ModelCard.from_template(data, template_str=TEMPLATE, **facts))
    card = ModelCard(re.sub(r"\n{3,}", "\n\n", text))  # the template's empty conditionals leave blank runs
    found = find_secrets(text)
    if found:
        raise ValueError(f"model card: refusing to write a card holding {found[0]}")
    return card
