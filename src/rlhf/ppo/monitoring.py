"""The monitoring signals of one rollout, from a per-response table that the ranks' rows concatenate into.

Every signal is a mean over responses or a sum over all response tokens divided
by all tokens, so the table of a whole batch (one process, or every rank's rows
gathered) gives the batch's figures, and every rank takes the same decisions
from them (the collapse guard, critic pre-training, the adaptive KL).
"""

from __future__ import annotations

import math

import torch

from rlhf.runtime.finite import to_host

# the per-response columns of :func:`sequence_table`; the token sums are over the response's tokens
COLUMNS = (
    "raw",
    "scored",
    "normalized",
    "length",
    "ended",
    "empty",
    "unfinished",
    "kl",
    "kl_k3",
    "logprobs",
    "entropy",
    "advantages",
    "returns",
    "returns_sq",
    "residual",
    "residual_sq",
    "outcome",
    "outcome_sq",
    "outcome_residual",
    "outcome_residual_sq",
)
VARIANCES = ("returns", "residual", "outcome", "outcome_residual")  # token variances rollout_stats reads


def rollout_stats(table: torch.Tensor) -> dict[str, float]:
    """The monitoring signals of one rollout (metric names of docs/ppo.md, Monitoring) from its
    :func:`sequence_table` (every rank's rows), in one host round trip besides the skewness (which reads the
    scores' host copy): response means, token means (sums over all tokens divided by all tokens), the score
    quantiles, and the value model's explained variance ``1 - Var[returns - values] / Var[returns]`` over all
    response tokens (NaN when the returns are constant), read twice: against the GAE returns PPO trains it on
    (``ppo/value/explained_variance``, as TRL's PPO trainer logs it), and against the Monte Carlo returns, the
    outcome (``ppo/value/explained_variance_outcome``). With ``lambda < 1`` the GAE returns are built from the
    values themselves (``R_t = V_t + A_t``), so a critic that only varies little from token to token can score
    well on the first; only the second says it predicts what the responses will be scored (docs/ppo.md).

    Args:
        table: ``(N, len(COLUMNS))`` float64, one row per response.

    Returns:
        ``{metric name: float}``.
    """
    col = dict(zip(COLUMNS, table.unbind(1), strict=True))
    tokens = col["length"].sum().clamp(min=1.0)
    token_mean = {name: col[name].sum() / tokens for name in COLUMNS}
    raw = col["raw"]
    quantiles = torch.quantile(raw, raw.new_tensor([0.1, 0.5, 0.9]))
    stats = to_host(
        {
            "ppo/reward/mean": raw.mean(),
            "ppo/reward/std": raw.std(unbiased=False),
            "ppo/reward/scored_mean": col["scored"].mean(),
            "ppo/reward/normalized_mean": col["normalized"].mean(),
            "ppo/reward/normalized_std": col["normalized"].std(unbiased=False),
            **{f"ppo/reward/p{q}": quantiles[i] for i, q in enumerate((10, 50, 90))},
            "ppo/reward/max": raw.max(),
            "ppo/kl": col["kl"].mean(),
            "ppo/kl_k3": col["kl_k3"].mean(),
            "ppo/kl_token": token_mean["kl"],
            "ppo/kl_token_k3": token_mean["kl_k3"],
            "ppo/perplexity": torch.exp(-token_mean["logprobs"]),
            "ppo/response_length": col["length"].mean(),
            "ppo/eos_rate": col["ended"].mean(),
            "ppo/truncated_share": 1.0 - col["ended"].mean(),
            "ppo/empty_share": col["empty"].mean(),
            "ppo/unfinished_share": col["unfinished"].mean(),
            "ppo/entropy": token_mean["entropy"],
            "ppo/advantages/mean": token_mean["advantages"],
            "ppo/returns/mean": token_mean["returns"],
            **{f"var_{name}": token_mean[f"{name}_sq"] - token_mean[name] ** 2 for name in VARIANCES},
        }
    )
    variances = {name: stats.pop(f"var_{name}") for name in VARIANCES}
    return {
        **stats,
        "ppo/reward/skew": skewness(raw.tolist()),
        "ppo/value/explained_variance": explained_variance(variances["residual"], variances["returns"]),
        "ppo/value/explained_variance_outcome": explained_variance(variances["outcome_residual"], variances["outcome"]),
    }


def explained_variance(var_residual: float, var_target: float) -> float:
    """The critic's explained variance, ``1 - Var[target - values] / Var[target]``, from the two variances.

    Args:
        var_residual: ``Var[target - values]`` over the response tokens (float, units of the return squared).
        var_target: ``Var[target]`` over the same tokens: the GAE returns or the Monte Carlo returns.

    Returns:
        At most 1 (1: the values predict the target exactly; 0: no better than its mean; below 0: worse); NaN when
        the target is constant (``var_target`` at most 1e-12).
    """
    return 1 - var_residual / var_target if var_target > 1e-12 else float("nan")


def skewness(values: list[float]) -> float:
    """Sample skewness ``E[(x - mu)^3] / sigma^3`` of ``N`` values (population moments); 0 when constant or empty.

    On the host (the values are already there, e.g. a rollout's scores for the collapse guard).
    """
    if not values:
        return 0.0
    mean = math.fsum(values) / len(values)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
    return math.fsum((v - mean) ** 3 for v in values) / len(values) / std**3 if std > 0 else 0.0


def kind_reward_means(raw: torch.Tensor, kinds: list[str] | None) -> dict[str, float]:
    """The rollout's mean reward-model score per prompt kind, ``ppo/reward/kind/<kind>/mean`` (empty without kinds):
    each kind's scores are on their own scale (:mod:`rlhf.ppo.moments`), so a rollout's mean over both also moves
    with its mix of kinds, and each kind's own mean is what shows the policy improving on it.

    Args:
        raw: ``(N,)`` float, the raw scores of every rank's responses in the global order (the table's ``raw``).
        kinds: the ``N`` prompts' kinds in the same order, or None.
    """
    if kinds is None:
        return {}
    names = sorted(set(kinds))
    means = torch.stack([raw[[k == kind for k in kinds]].mean() for kind in names]).tolist()  # one host copy
    return {f"ppo/reward/kind/{kind}/mean": mean for kind, mean in zip(names, means, strict=True)}
