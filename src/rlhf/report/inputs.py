"""What the report is built from: the stages' files by name (:data:`INPUTS`), the figures drawn from them, the
headline figures the parent MLflow run carries, and the check that each input has its shape.
"""

from __future__ import annotations

import math
from typing import Any

from rlhf.report.tables import number

INPUTS = (  # the stages' files the page is built from, by name (the caller maps each name to its file)
    "prepare",
    "validate",
    "validation",
    "sft",
    "reward",
    "reward_kinds",
    "margins",
    "reward_gate",
    "judge",
    "judge_kinds",
    "judge_margins",
    "ppo",
    "curves",
    "overoptimisation",
    "eval",
    "eval_kinds",
    "samples",
    "policy_gate",
)


LISTS = ("curves", "overoptimisation")  # JSON lists of row objects


IMAGES = ("margins", "judge_margins")  # PNG bytes; the other inputs are JSON objects


PPO_FIGURES = (  # figure name, title, ((key in metrics/ppo_curves.json, legend label), ...)
    (
        "ppo_reward",
        "reward-model score",
        (("ppo/reward/mean", "rollouts (mean)"), ("ppo/validation/reward", "validation")),
    ),
    ("ppo_kl", "KL to the SFT model (nats / response)", (("ppo/kl", "rollouts"),)),
    ("ppo_perplexity", "perplexity of responses", (("ppo/perplexity", "rollouts"),)),
    ("ppo_length", "response length (tokens)", (("ppo/response_length", "rollouts"),)),
    ("ppo_clipfrac", "clip fractions", (("ppo/policy/clipfrac", "policy"), ("ppo/value/clipfrac", "value"))),
)


OVEROPTIMISATION = "overoptimisation"  # the figure of proxy and judge mean scores against sqrt(KL)


HEADLINE = (  # (input, metric): the figures the parent MLflow run carries
    ("reward", "rm/accuracy"),
    ("reward", "rm/accuracy_low"),
    ("reward", "rm/balanced_accuracy"),
    ("judge", "judge/accuracy"),
    ("judge", "judge/balanced_accuracy"),
    ("eval", "eval/judge/win_rate"),
    ("eval", "eval/judge/win_rate_low"),
    ("eval", "eval/judge/win_rate_high"),
    ("eval", "eval/proxy/win_rate"),
    ("eval", "eval/proxy/win_rate_low"),
    ("eval", "eval/proxy/win_rate_high"),
    ("eval", "eval/policy/kl"),
    ("eval", "eval/judge/meaningful"),
)


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check_inputs(loaded: dict[str, Any], paths: dict[str, str]) -> None:
    """Check that each loaded input has the shape its file (``paths[name]``) should hold (None: the file is missing).

    Raises:
        ValueError: one line naming the file and what it should hold, e.g. ``metrics/ppo_curves.json: expected
            a list of objects, found dict``.
    """
    for name, value in loaded.items():
        path = paths[name]
        if value is None:
            continue
        if name in IMAGES:
            ok, what = isinstance(value, bytes) and value.startswith(PNG_SIGNATURE), "a PNG image"
        elif name in LISTS:
            ok, what = isinstance(value, list) and all(isinstance(r, dict) for r in value), "a list of objects"
        elif name == "samples":
            rows = value.get("samples") if isinstance(value, dict) else None
            ok = isinstance(rows, list) and all(isinstance(r, dict) for r in rows)
            what = 'an object with a "samples" list of objects'
        else:
            ok, what = isinstance(value, dict), "a JSON object"
        if not ok:
            found = "other bytes" if isinstance(value, bytes) else type(value).__name__
            raise ValueError(f"{path}: expected {what}, found {found}")


GATES = (("reward_gate", "reward gate"), ("policy_gate", "policy gate"))  # input name, as the verdict names it


def headline(loaded: dict[str, Any]) -> dict[str, float]:
    """The headline figures of :data:`HEADLINE` in ``loaded``: a figure its file holds as None or NaN (a win rate
    of all ties) is NaN, so the parent run shows it undefined rather than absent; a missing file's are left out.

    Returns:
        e.g. ``{"rm/accuracy": 0.59, "rm/accuracy_low": 0.52, "eval/judge/win_rate": nan, ...}``.
    """
    found = {key: (loaded[name] or {}).get(key, math.nan) for name, key in HEADLINE if loaded.get(name) is not None}
    return {key: math.nan if number(value) is None else float(value) for key, value in found.items()}
