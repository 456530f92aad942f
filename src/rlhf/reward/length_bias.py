"""Length bias of a Bradley-Terry reward model: the length expert, the decorrelation term and the figures.

A reward model trained on human preferences learns length when length predicts the label (Singhal et al.
2023, "A long way to go"); PPO then learns to write longer or, on harmless data, shorter answers. Two pieces
keep the length out of the score PPO, evaluation and the gate read:

- a **product of experts** (Shen et al. 2023, "Loose lips sink ships", section 3; Clark et al. 2019, "Don't take
  the easy way out", for the bias-only expert fitted first and frozen): in training the pair's log-odds are
  ``r(x, y_w) - r(x, y_l) + b(y_w) - b(y_l)``, where the length expert ``b(y) = w log(1 + |y|)`` is a
  one-weight logistic regression of the preference on the log-length ratio, fitted on the training pairs
  before the reward model trains (:func:`fit_length_expert`) and dropped after it: the length the expert
  explains gives the reward model no gradient;
- a **decorrelation term** (after ODIN, Chen et al. 2024, section 3.2, which penalises the quality head's
  ``|Pearson(r, |y|)|``; here taken within pairs, :func:`length_preference`): it removes what the expert's one
  weight cannot, in particular the sign of a small length preference that the product of experts alone leaves
  (the expert only shrinks the reward model's gradient, and a ranking needs only the sign).

The figures that show whether it worked (:func:`length_figures`) are the balanced accuracy, the mean of the
accuracies on chosen-shorter and on chosen-longer pairs with a bootstrap interval stratified by the two kinds,
and the length-only baseline ("prefer the shorter"), whose balanced accuracy is 0.5 by construction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from rlhf.losses import bradley_terry_loss


def length_feature(lengths: torch.Tensor) -> torch.Tensor:
    """The length expert's feature of a response: ``log(1 + tokens)``, ``(N,)`` float32 from ``(N,)`` lengths."""
    return torch.log1p(lengths.float())


def fit_length_expert(
    chosen_lengths: Sequence[int], rejected_lengths: Sequence[int], l2: float = 1.0, iterations: int = 50
) -> float:
    """The length expert's weight ``w``: the L2-penalised logistic regression of "chosen wins" on the log-length ratio.

    Minimises ``sum_i -log sigmoid(w d_i) + l2 / 2 w^2`` with ``d_i = log(1 + |y_w|) - log(1 + |y_l|)`` by
    Newton's method (the objective is convex in the one weight; the penalty keeps ``w`` finite when length
    alone separates the pairs). Positive ``w``: the data prefers the longer response. Source: the bias-only
    expert of a product of experts (Clark et al. 2019, section 3.2), on length as Shen et al. 2023 do.
    Host-side (NumPy): it runs once, on the training pairs' lengths, before training.

    Args:
        chosen_lengths, rejected_lengths: ``N`` response lengths in tokens each.
        l2: the penalty, > 0.
        iterations: at most this many Newton steps (it converges in a few).

    Returns:
        ``w`` (per unit of log-length ratio); 0.0 for no pairs.

    Raises:
        ValueError: ``l2 <= 0`` or the two length lists differ in size.
    """
    if l2 <= 0:
        raise ValueError(f"the length expert's L2 penalty must be > 0, got {l2}")
    if len(chosen_lengths) != len(rejected_lengths):
        raise ValueError(f"{len(chosen_lengths)} chosen lengths but {len(rejected_lengths)} rejected")
    d = np.log1p(np.asarray(chosen_lengths, dtype=float)) - np.log1p(np.asarray(rejected_lengths, dtype=float))
    w = 0.0
    for _ in range(iterations):
        p = 1 / (1 + np.exp(-w * d))
        step = (float(-((1 - p) * d).sum()) + l2 * w) / (float((p * (1 - p) * d * d).sum()) + l2)
        w -= step
        if abs(step) < 1e-12:
            break
    return w


def length_expert_scores(lengths: torch.Tensor, weight: float) -> torch.Tensor:
    """The length expert's score ``b(y) = w log(1 + |y|)`` of each response, ``(N,)`` float32 (nats of log-odds)."""
    return weight * length_feature(lengths)


SHARPNESS = 1.0  # tanh(x / rms margin): a pair at the typical margin counts tanh(1) = 0.76 and still has a gradient


def length_preference(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    member: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How much the scores prefer the longer response, over pairs of unequal length; differentiable.

    ``sum_i tanh(k s_i (r_w - r_l) / m)`` with ``s_i = sign(|y_w| - |y_l|)``, ``m`` the root mean square of those
    pairs' margins (detached) and ``k`` :data:`SHARPNESS`, and the count of pairs of unequal length: their mean is in
    [-1, 1], about +1 when the longer response scores higher in every pair, -1 when the shorter does, 0 when
    each wins as often: a soft count of the pairs the scores rank by length. ``tanh`` bounds each pair's say, so
    a few large margins cannot hide many small ones, and dividing by ``m`` keeps it a count however small the
    margins get (the product of experts shrinks them). ODIN's decorrelation of the quality head with length
    (Chen et al. 2024, section 3.2), taken within pairs: a pair's two responses answer one prompt, so the length
    that ranks them is the length difference, and a model can be uncorrelated with length over all responses
    while ranking every pair by it.

    Args:
        chosen, rejected: ``(P,)`` float scores; chosen_lengths, rejected_lengths: ``(P,)`` tokens.
        member: ``(P,)`` float 0/1, the pairs taken (a kind's: masks, never indexing, so no host sync); None: all.

    Returns:
        ``(sum over pairs of unequal length; their count; m, detached)``: 0-dim float32 tensors on the scores'
        device (no host sync: the trainers read figures once per step).
    """
    sign = torch.sign(chosen_lengths.float() - rejected_lengths.float())
    unequal = sign.abs() if member is None else sign.abs() * member
    margins = sign * (chosen.float() - rejected.float())
    count = unequal.sum()
    rms = (margins.detach().pow(2).mul(unequal).sum() / count.clamp(min=1)).sqrt()  # over the pairs of unequal length
    return (torch.tanh(SHARPNESS / (rms + 1e-8) * margins) * unequal).sum(), count, rms


def balanced_accuracy(
    correct_shorter: np.ndarray, correct_longer: np.ndarray, resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """Balanced accuracy, the mean of the chosen-shorter and chosen-longer accuracies, with a stratified 95% interval.

    The interval is a percentile bootstrap that resamples each kind of pair within itself (its count kept), so
    it reflects the two accuracies' own spreads (the stratified bootstrap, Davison & Hinkley 1997, ch. 3).
    A length-only ranker scores 1 on one kind and 0 on the other: 0.5.

    Args:
        correct_shorter, correct_longer: ``(n_s,)``, ``(n_l,)`` 0/1 outcomes of the decisive pairs of each kind.
        resamples, seed: of the bootstrap.

    Returns:
        ``(balanced accuracy, low, high)``; all NaN when either kind has no decisive pair.
    """
    shorter, longer = np.asarray(correct_shorter, dtype=float), np.asarray(correct_longer, dtype=float)
    if len(shorter) == 0 or len(longer) == 0:
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    draws = [rng.choice(kind, size=(resamples, len(kind))).mean(axis=1) for kind in (shorter, longer)]
    resampled = (draws[0] + draws[1]) / 2
    low, high = np.percentile(resampled, [2.5, 97.5])
    return float((shorter.mean() + longer.mean()) / 2), float(low), float(high)


def length_figures(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    resamples: int = 2000,
    seed: int = 0,
) -> dict[str, float]:
    """How much of a reward model's ranking is length: balanced accuracy and the length-only baseline.

    Pairs of equal length are in neither kind; ties (equal scores) are not decisive, as everywhere.

    Args:
        chosen, rejected: ``(N,)`` float scores; chosen_lengths, rejected_lengths: ``(N,)`` tokens.
        resamples, seed: of the stratified bootstrap (:func:`balanced_accuracy`).

    Returns:
        ``rm/balanced_accuracy`` with ``_low``/``_high``; ``rm/length_baseline_accuracy`` (the share of the
        pairs of unequal length whose chosen response is the shorter: the accuracy of "prefer the shorter",
        whose balanced accuracy is 0.5) and ``rm/length_baseline_pairs``.
    """
    decisive = chosen != rejected
    kinds = [(chosen_lengths < rejected_lengths) & decisive, (chosen_lengths > rejected_lengths) & decisive]
    outcomes = [(chosen[kind] > rejected[kind]).cpu().numpy() for kind in kinds]
    rate, low, high = balanced_accuracy(outcomes[0], outcomes[1], resamples, seed)
    unequal = chosen_lengths != rejected_lengths
    shorter_wins = (chosen_lengths < rejected_lengths)[unequal].float()
    return {
        "rm/balanced_accuracy": rate,
        "rm/balanced_accuracy_low": low,
        "rm/balanced_accuracy_high": high,
        "rm/length_baseline_accuracy": float(shorter_wins.mean()) if len(shorter_wins) else math.nan,
        "rm/length_baseline_pairs": float(len(shorter_wins)),
    }


def debiased_pair_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    expert_weight: float | torch.Tensor,
    decorrelation: float,
    margin: float,
    count: int,
    groups: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This part's share of the length-debiased Bradley-Terry loss, and its length preference.

    ``-log sigmoid(r_w + b(y_w) - r_l - b(y_l) - margin)`` summed over the part's pairs and divided by the whole
    batch's ``count`` (tutorial Eq. 6 under a product of experts with the frozen length expert ``b``,
    :func:`length_expert_scores`), plus ``decorrelation * |mean length preference| * m`` over the part's pairs of
    unequal length (:func:`length_preference`; ``m`` their rms margin, detached, so the term is in units of
    score and its gradient does not grow as the margins shrink), weighted by the part's share of the batch
    ``P / count``: the one term of the reward model's loss that is a function of the pass, not a sum over pairs,
    so with several passes per batch (``micro_batch_size``, several processes) it is the pairs-weighted mean of
    each pass's term.
    ``expert_weight = 0`` and ``decorrelation = 0`` give Eq. 6 exactly. With ``groups`` (the kinds of data,
    :mod:`rlhf.data.kinds`) the preference term is taken within each group, each weighted by its share ``P_g /
    count``: kinds whose raters prefer opposite lengths (helpful the longer, harmless the shorter) cannot cancel
    each other out in one mean, and a model that ranks each kind by its own length is penalised on both.

    Args:
        chosen, rejected: ``(P,)`` float scores with gradients; chosen_lengths, rejected_lengths: ``(P,)`` tokens.
        expert_weight: the fitted ``w`` of :func:`fit_length_expert`, one for all pairs or ``(P,)`` float, each
            pair's (a weight fitted on its kind's pairs).
        decorrelation: the term's coefficient, >= 0.
        margin: the Bradley-Terry margin; count: pairs in the whole batch.
        groups: ``(G, P)`` 0/1 membership of each pair in each of G groups (a pair in none is in no group's term),
            or None: all pairs one group.

    Returns:
        ``(loss share, the part's mean length preference, detached; 0 when all its pairs have equal lengths)``.
    """
    loss = bradley_terry_loss(
        chosen + length_expert_scores(chosen_lengths, expert_weight),
        rejected + length_expert_scores(rejected_lengths, expert_weight),
        margin,
        count=count,
    )
    total, unequal, _ = length_preference(chosen, rejected, chosen_lengths, rejected_lengths)
    if decorrelation > 0:  # times m: a gradient of k (1 - tanh^2) per pair, however small or large the margins
        for member in [None] if groups is None else groups.to(chosen.dtype):
            part = length_preference(chosen, rejected, chosen_lengths, rejected_lengths, member)
            size = len(chosen) if member is None else member.sum()
            loss = loss + decorrelation * (part[0] / part[1].clamp(min=1)).abs() * part[2] * size / max(count, 1)
    return loss, (total / unequal.clamp(min=1)).detach()


SHORT_REPLIES = ("No.", "Sorry.", "OK.")
"""One-word replies a length model ranks high: a refusal, an apology, a nod."""
REPLY_PROMPTS = 64
"""Prompts (the first ones) the empty and one-word replies are scored on: a share to about +-0.12, cheaply."""


def empty_response_metrics(
    empty_scores: torch.Tensor, reply_scores: torch.Tensor, chosen_scores: torch.Tensor
) -> dict[str, float]:
    """How the reward model scores an empty response (EOS first) and one-word replies against the chosen one.

    An empty or one-word answer is a known hack on harmless data, and what a length model prefers: PPO then
    learns to say less. Such a response beats the chosen one on a prompt when it scores strictly above it.

    Args:
        empty_scores: ``(N,)`` float, the score of ``prompt + ""`` for each prompt.
        reply_scores: ``(R, N)`` float, the score of ``prompt + reply`` for each of R replies (:data:`SHORT_REPLIES`).
        chosen_scores: ``(N,)`` float, the score of ``prompt + chosen`` for the same prompts.

    Returns:
        ``rm/empty_score_mean``, ``rm/chosen_score_mean``, ``rm/empty_beats_chosen`` (share of prompts whose
        empty response beats the chosen one), ``rm/short_reply_beats_chosen`` (that share averaged over the
        replies), ``rm/short_reply_beats_chosen_max`` (the share of the reply that beats it most often) and
        ``rm/reply_beats_chosen/<reply>`` (each reply's share, :func:`reply_name`; the replies are
        :data:`SHORT_REPLIES` in order when ``R`` is their number); ``{}`` for no prompts.
    """
    if len(chosen_scores) == 0:
        return {}
    beats = (reply_scores > chosen_scores).float().mean(dim=1)
    return {
        "rm/empty_score_mean": float(empty_scores.mean()),
        "rm/chosen_score_mean": float(chosen_scores.mean()),
        "rm/empty_beats_chosen": float((empty_scores > chosen_scores).float().mean()),
        "rm/short_reply_beats_chosen": float(beats.mean()),
        "rm/short_reply_beats_chosen_max": float(beats.max()),
        **(
            {f"rm/reply_beats_chosen/{reply_name(r)}": float(b) for r, b in zip(SHORT_REPLIES, beats, strict=True)}
            if len(beats) == len(SHORT_REPLIES)
            else {}
        ),
    }


def reply_name(reply: str) -> str:
    """A reply as part of a metric name: its letters, lower case (``"No."`` is ``no``)."""
    return "".join(c for c in reply.lower() if c.isalnum()) or "empty"
