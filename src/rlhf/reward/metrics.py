"""Stage 2's measurements: how well a reward model ranks held-out pairs, overall, per kind and per source.

:func:`evaluate_reward_model` scores a split's pairs (and the empty and one-word replies, known hacks) and
:func:`preference_metrics` turns scores into the figures the reward stage, the judge stage, the gate and
``rlhf-model score-pairs`` report; the trainer is :mod:`rlhf.reward.trainer`.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.data.chat import encode_chat
from rlhf.data.kinds import first_of_each_kind, kind_of, named, parts
from rlhf.models.shared_prompt import score_groups
from rlhf.reward.length_bias import REPLY_PROMPTS, SHORT_REPLIES, empty_response_metrics, length_figures, reply_name
from rlhf.reward.trainer import encode_pairs, response_lengths
from rlhf.runtime.device import Runtime
from rlhf.stats import TiesWarning, paired_rate


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, bins: int = 10) -> float:
    """Expected calibration error of binary predictions (Guo et al., 2017).

    Each prediction's confidence is ``max(p, 1 - p)`` and it is correct when
    ``(p > 0.5) == label``; ECE is the sum over equal-width confidence bins of
    ``|accuracy - mean confidence| * share of predictions in the bin``.

    Args:
        probs: ``(N,)`` float in [0, 1], predicted probability that the label is 1.
        labels: ``(N,)`` 0/1.
        bins: number of bins over [0.5, 1].

    Returns:
        ECE in [0, 1]; 0.0 for empty input.
    """
    if probs.numel() == 0:
        return 0.0
    confidence = torch.maximum(probs, 1 - probs)
    correct = ((probs > 0.5) == labels.bool()).float()
    edges = torch.linspace(0.5, 1.0, bins + 1, device=probs.device)
    index = torch.clamp(torch.bucketize(confidence, edges[1:-1], right=True), 0, bins - 1)
    ece = 0.0
    for b in range(bins):
        in_bin = index == b
        if in_bin.any():
            ece += float(in_bin.float().mean()) * abs(float(correct[in_bin].mean()) - float(confidence[in_bin].mean()))
    return ece


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two ``(N,)`` float tensors; 0.0 when either is constant."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denominator = math.sqrt(float((x * x).sum()) * float((y * y).sum()))
    return float((x * y).sum()) / denominator if denominator > 0 else 0.0


def preference_metrics(
    chosen: torch.Tensor, rejected: torch.Tensor, chosen_lengths: torch.Tensor, rejected_lengths: torch.Tensor
) -> dict[str, float]:
    """Held-out reward-model metrics from scores and response lengths.

    Accuracies follow the product's tie rule (:func:`rlhf.stats.paired_rate`):
    a pair is right when chosen > rejected, wrong when chosen < rejected, and a
    tie (equal scores) is not decisive: it is left out of the accuracy and its
    count, counted in ``rm/ties``, and a :class:`rlhf.stats.TiesWarning` is
    issued. A constant model thus gets ``rm/accuracy`` NaN, ``rm/pairs`` 0 and
    ``rm/ties`` N (not an accuracy of 0.0).

    Args:
        chosen, rejected: ``(N,)`` float scores.
        chosen_lengths, rejected_lengths: ``(N,)`` response lengths in tokens.

    Returns:
        ``rm/accuracy`` (share of decisive pairs with chosen > rejected; NaN
        when none), ``rm/accuracy_low`` and ``rm/accuracy_high`` (its Wilson 95%
        interval), ``rm/pairs`` (decisive pairs, the accuracy's denominator),
        ``rm/ties`` (pairs with equal scores; ``rm/pairs + rm/ties = N``),
        ``rm/accuracy_chosen_shorter`` / ``rm/pairs_chosen_shorter`` (the same
        on pairs whose chosen response is strictly shorter, and their decisive
        count), ``rm/accuracy_chosen_longer`` / ``rm/pairs_chosen_longer``
        (chosen strictly longer; equal lengths are in neither), ``rm/margin``
        (mean chosen - rejected over all N), ``rm/ece`` (of ``sigmoid(margin)``
        against the label "chosen wins"), ``rm/length_corr`` (Pearson of
        score with length over all responses), and the length-bias figures of
        :func:`rlhf.reward.length_bias.length_figures` (``rm/balanced_accuracy`` with its
        stratified interval, ``rm/length_baseline_accuracy``).

    Raises:
        ValueError: a NaN score.
    """
    margin = chosen - rejected
    overall = paired_rate(chosen, rejected, what="rm_eval pairs")
    metrics = {
        "rm/accuracy": overall.rate,
        "rm/accuracy_low": overall.low,
        "rm/accuracy_high": overall.high,
        "rm/pairs": float(overall.n),
        "rm/ties": float(overall.ties),
        "rm/margin": float(margin.mean()),
        "rm/ece": expected_calibration_error(torch.sigmoid(margin), torch.ones_like(margin)),
        "rm/length_corr": pearson(torch.cat([chosen, rejected]), torch.cat([chosen_lengths, rejected_lengths]).float()),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TiesWarning)  # already reported once for all pairs above
        for name, subset in (
            ("chosen_shorter", chosen_lengths < rejected_lengths),
            ("chosen_longer", chosen_lengths > rejected_lengths),
        ):
            part = paired_rate(chosen[subset], rejected[subset])
            metrics[f"rm/accuracy_{name}"] = part.rate
            metrics[f"rm/pairs_{name}"] = float(part.n)
    return {**metrics, **length_figures(chosen, rejected, chosen_lengths, rejected_lengths)}


KIND_FIGURES = (
    "accuracy",
    "accuracy_low",
    "accuracy_high",
    "pairs",
    "ties",
    "balanced_accuracy",
    "balanced_accuracy_low",
    "balanced_accuracy_high",
    "accuracy_chosen_shorter",
    "pairs_chosen_shorter",
    "accuracy_chosen_longer",
    "pairs_chosen_longer",
    "length_baseline_accuracy",
    "margin",
    "ece",
    "empty_beats_chosen",
    "short_reply_beats_chosen",
    "short_reply_beats_chosen_max",
    *(f"reply_beats_chosen/{reply_name(r)}" for r in SHORT_REPLIES),
)
"""The figures taken on each kind and source (:mod:`rlhf.data.kinds`) besides the whole split."""


def evaluate_reward_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: list[dict[str, Any]],
    max_length: int,
    batch_size: int,
    runtime: Runtime,
) -> tuple[dict[str, float], torch.Tensor]:
    """Score held-out pairs; returns the metrics and the ``(N,)`` margins (for the histogram).

    Metrics: :func:`preference_metrics`, plus :func:`rlhf.reward.length_bias.empty_response_metrics` of the
    first :data:`REPLY_PROMPTS` prompts of each kind (what the model says of an empty answer and of each of
    :data:`rlhf.reward.length_bias.SHORT_REPLIES`, known hacks),
    all on the reward model's raw score (no rule for unfinished responses applied); and the
    :data:`KIND_FIGURES` of each kind and source (:func:`rlhf.data.kinds.parts`) as ``rm/kind/<kind>/<figure>`` and
    ``rm/source/<name>/<figure>``.
    """
    pairs = encode_pairs(tokenizer, examples, max_length)
    kinds = [kind_of(example) for example in examples]  # each pair read with its own kind's score
    scores = score_groups(model, tokenizer, [[c.input_ids, r.input_ids] for c, r in pairs], batch_size, runtime, kinds)
    chosen, rejected = scores.view(-1, 2).unbind(1)
    chosen_lengths, rejected_lengths = (torch.tensor(n, device=runtime.device) for n in response_lengths(pairs))
    replies = ("", *SHORT_REPLIES)  # one prompt's replies share it: a group
    asked_rows = first_of_each_kind(examples, REPLY_PROMPTS)
    asked = [
        [
            encode_chat(tokenizer, examples[i]["prompt"], [{"role": "assistant", "content": r}], max_length).input_ids
            for r in replies
        ]
        for i in asked_rows
    ]
    replied = score_groups(model, tokenizer, asked, batch_size, runtime, [kinds[i] for i in asked_rows])
    replied = replied.view(-1, len(replies)).T  # (replies, R)
    asked_index = torch.tensor(asked_rows, device=chosen.device, dtype=torch.long)

    def figures(index: torch.Tensor, reply_index: torch.Tensor) -> dict[str, float]:
        return {
            **preference_metrics(chosen[index], rejected[index], chosen_lengths[index], rejected_lengths[index]),
            **empty_response_metrics(
                replied[0, reply_index], replied[1:, reply_index], chosen[asked_index[reply_index]]
            ),
        }

    metrics = figures(
        torch.arange(len(examples), device=chosen.device), torch.arange(len(asked_rows), device=chosen.device)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TiesWarning)  # reported once for the whole split above
        position = {row: k for k, row in enumerate(asked_rows)}
        for part, rows in parts(examples).items():
            index = torch.tensor(rows, device=chosen.device, dtype=torch.long)
            asked_here = [position[r] for r in rows if r in position]
            reply_index = torch.tensor(asked_here, device=chosen.device, dtype=torch.long)
            metrics.update(named(figures(index, reply_index), "rm", part, KIND_FIGURES))
    return metrics, chosen - rejected
