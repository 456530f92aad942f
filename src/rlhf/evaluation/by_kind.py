"""Evaluation per kind of prompt: a fair share of each kind, and what the policy (and SFT) changed on each.

The data mixes kinds of preference (HH-RLHF: ``harmless``, red-teaming prompts where raters preferred saying less;
``helpful``, ordinary requests where they preferred the more helpful answer; every row carries its ``kind``). A
policy can win overall by helping less: it wins the harmless prompts by refusing and loses little elsewhere. So
every verdict is also read per kind (:func:`kind_figures`): the win rate, the paired score difference and the
length-controlled win rate by each scorer, the refusal rate of each model and the policy's refusal increase over
SFT with its interval, and SFT against the base model (what SFT itself did).

Pure: NumPy and the product's interval functions over the runs :func:`rlhf.evaluation.evaluator.generate_and_score`
returned (``(P, K)`` tensors or arrays on the CPU, ``P * K`` texts prompt-major); no model, no MLflow.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from rlhf.data.kinds import kind_of
from rlhf.evaluation.comparison import length_controlled_rate, paired_difference, rate_difference
from rlhf.evaluation.text_measures import is_refusal
from rlhf.stats import TiesWarning, clustered_rate

KIND_PREFIX = "eval/kind/"  # every per-kind figure's name begins so: they go to their own metrics file
SCORERS = ("proxy", "judge")
FIGURES = (  # what compare_runs gives per scorer, in this order
    "win_rate",
    "win_rate_low",
    "win_rate_high",
    "decisive",
    "ties",
    "score_diff",
    "score_diff_low",
    "score_diff_high",
    "lc_win_rate",
    "lc_win_rate_low",
    "lc_win_rate_high",
    "lc_length_coef",
)


def stratified(rows: list[dict[str, Any]], limit: int | None) -> list[dict[str, Any]]:
    """The prompts evaluation reads, in the order it reads them: a fair share of each kind, deterministic.

    Each kind's rows in ``id`` order, dealt one of each kind at a time (kinds by name), so any first N of the
    result holds ``N / kinds`` of each kind (the first kinds by name get the remainder) and, when a kind runs
    out, the others fill its place. The first ``limit`` are returned: with 2 kinds and ``limit`` 32, the first 16
    of each by id. The over-optimisation curve and best-of-N read a prefix of this list, so they are
    stratified too, and their first sample of a prompt is the one evaluated.

    Args:
        rows: ``{"id", "prompt", "kind", ...}`` rows (a row without ``kind``: :func:`rlhf.data.kinds.kind_of`).
        limit: how many to return; None: all.

    Returns:
        At most ``limit`` rows, interleaved by kind.
    """
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for row in sorted(rows, key=lambda r: r["id"]):
        by_kind.setdefault(kind_of(row), []).append(row)
    queues = [by_kind[kind] for kind in sorted(by_kind)]
    order = [queue[i] for i in range(max(map(len, queues), default=0)) for queue in queues if i < len(queue)]
    return order if limit is None else order[:limit]


def compare_runs(
    first: dict[str, Any], second: dict[str, Any], resamples: int, seed: int, warn_ties: bool = False
) -> dict[str, float]:
    """``first`` against ``second`` on the same prompts, by each scorer: ``<scorer>_<figure>`` for :data:`FIGURES`.

    The win rate (ties apart; bootstrap over prompts floored by Wilson, :func:`rlhf.stats.clustered_rate`), the
    paired score difference (first minus second, :func:`rlhf.evaluation.comparison.paired_difference`) and the
    length-controlled win rate (:func:`rlhf.evaluation.comparison.length_controlled_rate`, on ``length`` in tokens),
    every
    interval 95% over prompts (``resamples``, ``seed``). Ties are counted in ``<scorer>_ties``; their
    :class:`rlhf.stats.TiesWarning` is issued once, by the win rate, when ``warn_ties`` (the overall comparison;
    a kind's are the same ties again).

    Args:
        first, second: runs with ``proxy``, ``judge`` and ``length``: ``(P, K)`` on the CPU.

    Returns:
        e.g. ``{"judge_win_rate": 0.6, "judge_win_rate_low": 0.4, ..., "proxy_lc_length_coef": -0.3}``.
    """
    out = {}
    for scorer in SCORERS:
        a, b = np.asarray(first[scorer], dtype=np.float64), np.asarray(second[scorer], dtype=np.float64)
        lengths = np.asarray(first["length"], dtype=np.float64), np.asarray(second["length"], dtype=np.float64)
        with warnings.catch_warnings():
            if not warn_ties:
                warnings.simplefilter("ignore", TiesWarning)
            wins = clustered_rate(a, b, resamples, seed, what="evaluation prompts")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TiesWarning)  # the same comparisons: the win rate has warned of them
            lc = length_controlled_rate(a, b, *lengths, resamples, seed)
        diff = paired_difference(a, b, resamples, seed)
        values = (wins.rate, wins.low, wins.high, float(wins.n), float(wins.ties), diff.mean, diff.low, diff.high)
        values += (lc.rate, lc.low, lc.high, lc.length_coef)
        out |= {f"{scorer}_{name}": float(value) for name, value in zip(FIGURES, values, strict=True)}
    return out


def refusals(run: dict[str, Any]) -> np.ndarray:
    """``(P, K)`` float64, 1.0 where the response refuses (:func:`rlhf.evaluation.text_measures.is_refusal`), from
    ``texts``."""
    shape = np.asarray(run["proxy"]).shape
    return np.array([float(is_refusal(text)) for text in run["texts"]]).reshape(shape)


def _rows(run: dict[str, Any], prompts: list[int]) -> dict[str, Any]:
    """The run restricted to the prompts ``prompts`` (indices), its texts too."""
    k = np.asarray(run["proxy"]).shape[1]
    out = {key: np.asarray(value)[prompts] for key, value in run.items() if key != "texts"}
    return out | {"texts": [run["texts"][i * k + j] for i in prompts for j in range(k)]}


def kind_figures(runs: dict[str, dict[str, Any]], kinds: list[str], resamples: int, seed: int) -> dict[str, float]:
    """Every per-kind figure of the evaluation, named ``eval/kind/<kind>/<figure>``.

    Args:
        runs: ``sft``, ``policy`` and, when it was evaluated, ``base``: each
            :func:`rlhf.evaluation.evaluator.generate_and_score`'s result on the same prompts (identical texts already
            tied, :func:`rlhf.evaluation.evaluator.tie_identical_responses`).
        kinds: the kind of each of the P prompts (:func:`rlhf.data.kinds.kind_of`), in the runs' order.
        resamples, seed: of every bootstrap.

    Returns:
        For each kind ``k``, with ``p = eval/kind/k/``: ``p + "prompts"``; the policy against SFT,
        ``p + "<scorer>_<figure>"`` (:func:`compare_runs`; e.g. ``eval/kind/helpful/judge_win_rate_low``); SFT
        against the base model, ``p + "sft_vs_base/<scorer>_<figure>"``; ``p + "<model>_refusal_rate"`` and
        ``p + "<model>_length"`` (mean tokens) for each model run; ``p + "refusal_increase"`` with ``_low`` and
        ``_high``: the policy's refusal rate minus SFT's on the same prompts, its 95% interval a paired bootstrap
        over prompts floored by Newcombe's paired score interval (:func:`rlhf.evaluation.comparison.rate_difference`);
        ``p + "complied_where_declined"``: the share of the kind's responses where the policy did not refuse and
        SFT or the base model refused the same prompt and sample (on a red-team kind, an answer it learned to give).

    Raises:
        ValueError: ``kinds`` is not one kind per prompt.
    """
    prompts = np.asarray(runs["sft"]["proxy"]).shape[0]
    if len(kinds) != prompts:
        raise ValueError(f"kind_figures needs one kind per prompt: {len(kinds)} kinds for {prompts} prompts")
    refused = {name: refusals(run) for name, run in runs.items()}
    out: dict[str, float] = {}
    for kind in sorted(set(kinds)):
        index = [i for i, k in enumerate(kinds) if k == kind]
        part = {name: _rows(run, index) for name, run in runs.items()}
        p = f"{KIND_PREFIX}{kind}/"
        out[p + "prompts"] = float(len(index))
        out |= {p + key: value for key, value in compare_runs(part["policy"], part["sft"], resamples, seed).items()}
        if "base" in part:
            versus = compare_runs(part["sft"], part["base"], resamples, seed)
            out |= {f"{p}sft_vs_base/{key}": value for key, value in versus.items()}
        for name, run in part.items():
            out[f"{p}{name}_refusal_rate"] = float(refused[name][index].mean())
            out[f"{p}{name}_length"] = float(np.asarray(run["length"], dtype=np.float64).mean())
        declined = np.maximum(refused["sft"][index], refused["base"][index] if "base" in refused else 0.0)
        out[p + "complied_where_declined"] = float(((1.0 - refused["policy"][index]) * declined).mean())
        increase = rate_difference(refused["policy"][index], refused["sft"][index], resamples, seed)
        out |= {p + "refusal_increase": increase.mean}
        out |= {p + "refusal_increase_low": increase.low, p + "refusal_increase_high": increase.high}
    return out
