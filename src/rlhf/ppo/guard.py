"""The pattern-collapse guard (paper section 5.2 and appendix A): signals that can fire, checked before an update.

Each check uses a signal that can reach its threshold at the configured sizes
(:class:`rlhf.ppo.config.PPOConfig` refuses thresholds out of reach): the
sequence KL of the rollout, its mean length against the starting policy's (a
fall), its perplexity against the starting policy's (either way; both references
pooled over every rollout the starting policy sampled, :func:`pooled_baseline`), and, pooled over
the last ``collapse_window`` rollouts, the skewness of the raw scores (a long
tail) and the share of responses cut at ``max_new_tokens`` (a length blow-up
cannot show as a ratio under a length cap).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from rlhf.ppo.config import PPOConfig
from rlhf.ppo.monitoring import skewness
from rlhf.ppo.types import PPOState
from rlhf.training.checkpoint import Checkpointer


def window_signals(window: list[dict[str, list[float]]]) -> dict[str, float]:
    """Skewness of the pooled raw scores and the pooled truncated share of recent rollouts.

    Args:
        window: one entry per rollout, ``{"scores": [...], "truncated": [0.0 or 1.0, ...]}``.

    Returns:
        ``ppo/window/reward_skew`` and ``ppo/window/truncated_share``.
    """
    scores = [s for entry in window for s in entry["scores"]]
    truncated = [t for entry in window for t in entry["truncated"]]
    return {
        "ppo/window/reward_skew": skewness(scores),
        "ppo/window/truncated_share": sum(truncated) / len(truncated) if truncated else 0.0,
    }


BASELINE_KEYS = ("ppo/response_length", "ppo/perplexity", "ppo/truncated_share")


def pooled_baseline(baseline: dict[str, float], stats: dict[str, float]) -> dict[str, float]:
    """The guard's reference with one more rollout of the starting policy: the running mean of its
    :data:`BASELINE_KEYS` over every rollout sampled before the first policy update (critic pre-training samples
    the SFT policy too), so one rollout's few prompts do not set the reference alone.

    Args:
        baseline: the reference so far (``{}`` before the first rollout); ``rollouts`` counts what it pools.
        stats: the new rollout's signals (response length in tokens, perplexity, share cut at max_new_tokens).

    Returns:
        The new reference: each key the mean over ``rollouts`` rollouts (equal batches weigh equally).
    """
    pooled = baseline.get("rollouts", 0.0)
    means = {key: (baseline.get(key, 0.0) * pooled + stats[key]) / (pooled + 1) for key in BASELINE_KEYS}
    return {**means, "rollouts": pooled + 1}


def detect_collapse(stats: dict[str, float], baseline: dict[str, float], config: PPOConfig) -> str | None:
    """Name the first collapse signal over its threshold, or None.

    Args:
        stats: the rollout's signals plus :func:`window_signals` of the window that ends with it.
        baseline: ``ppo/response_length``, ``ppo/perplexity`` and ``ppo/truncated_share`` of the starting (SFT)
            policy's rollouts (:func:`pooled_baseline`; a checkpoint written before the share has none: 0).
        config: thresholds (None disables a check).

    Returns:
        A one-line reason, or None when nothing is wrong.
    """
    if config.collapse_kl_max is not None and stats["ppo/kl"] > config.collapse_kl_max:
        return f"KL {stats['ppo/kl']:.2f} > {config.collapse_kl_max}"
    ratio = config.collapse_length_ratio
    first = baseline.get("ppo/response_length", 0.0)
    if ratio is not None and first > 0 and stats["ppo/response_length"] < first / ratio:
        return f"mean response length fell from {first:.1f} to {stats['ppo/response_length']:.1f} (limit /{ratio})"
    ratio = config.collapse_perplexity_ratio
    first = baseline.get("ppo/perplexity", 0.0)
    if ratio is not None and first > 0:
        change = stats["ppo/perplexity"] / first
        if change > ratio or change < 1 / ratio:
            return f"perplexity moved from {first:.2f} to {stats['ppo/perplexity']:.2f} (x{change:.2f}, limit x{ratio})"
    skew = stats["ppo/window/reward_skew"]
    if config.collapse_reward_skew is not None and abs(skew) > config.collapse_reward_skew:
        return f"reward scores have a long tail over the last {config.collapse_window} rollouts (skew {skew:.2f})"
    share, start = stats["ppo/window/truncated_share"], baseline.get("ppo/truncated_share", 0.0)
    # above the threshold and above what the starting policy did: a start that writes long (the base model, no
    # SFT) is not a collapse of training
    if config.collapse_truncated_share is not None and share > max(config.collapse_truncated_share, start):
        return (
            f"{share:.0%} of the last {config.collapse_window} rollouts' responses hit max_new_tokens (the starting "
            f"policy's: {start:.0%})"
        )
    return None


def act_on_collapse(
    line: str,
    config: PPOConfig,
    state: PPOState,
    policy: PreTrainedModel,
    policy_optimizer: torch.optim.Optimizer,
    best_dir: str,
    say: Callable[[str], None],
) -> float:
    """Act on a collapse found in a rollout, before any update trains on it; returns 1.0 when rolled back.

    Writes ``state.rollbacks``, ``state.window`` and ``state.stopped_by``; reads ``state.best``.

    ``rollback`` loads the best policy so far (the SFT policy before any
    validation) and drops the policy optimiser's moments; after ``max_rollbacks``
    rollbacks, and with ``stop``, the run stops.
    """
    say(line)
    if config.on_collapse == "rollback" and state.rollbacks < config.max_rollbacks:
        best = Checkpointer(best_dir)
        best.load_model_weights(best.latest(), "policy", policy)
        policy_optimizer.state.clear()  # the optimiser moments of the collapsed trajectory go too
        state.window = []  # and its rollouts leave the window, or they would trigger the guard again
        state.rollbacks += 1
        count = f"{state.rollbacks}/{config.max_rollbacks}"
        say(f"rolled the policy back to iteration {state.best.iteration} ({count})")
        return 1.0
    if config.on_collapse != "warn":
        state.stopped_by = line
    return 0.0
