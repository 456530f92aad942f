"""Figures of training runs: one figure per monitored signal, runs side by side (matplotlib, Agg)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

SIGNALS = {
    "ppo/reward/mean": "reward-model score (raw)",
    "ppo/kl": "KL to reference (nats / response, k1)",
    "ppo/kl_k3": "KL to reference (nats / response, k3)",
    "ppo/perplexity": "perplexity of responses",
    "ppo/response_length": "response length (tokens)",
    "ppo/eos_rate": "EOS rate",
    "ppo/entropy": "entropy (nats / token)",
    "ppo/policy/clipfrac": "policy clip fraction",
    "ppo/value/explained_variance": "value explained variance (GAE returns)",
    "ppo/value/explained_variance_outcome": "value explained variance (Monte Carlo returns)",
    "ppo/validation/reward": "validation reward (greedy)",
}


def signal_figures(histories: dict[str, dict[int, dict[str, float]]]) -> dict[str, Figure]:
    """One line figure per signal in :data:`SIGNALS`, one line per run.

    Args:
        histories: run name -> {iteration -> metrics}.

    Returns:
        File stem (e.g. ``"ppo_kl"``) -> figure.
    """
    figures = {}
    for key, title in SIGNALS.items():
        figure, axis = plt.subplots(figsize=(6, 3.5))
        for name, history in histories.items():
            points = sorted((int(step), stats[key]) for step, stats in history.items() if key in stats)
            if points:
                axis.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=name)
        axis.set(xlabel="iteration", title=title)
        axis.grid(alpha=0.3)
        axis.legend()
        figures[key.replace("/", "_")] = figure
    return figures


def reward_histograms(samples: dict[str, dict[int, list[float]]]) -> Figure:
    """Reward-score histograms at the logged iterations, one column per run.

    Paper appendix A: a long tail means collapse.

    Args:
        samples: run name -> {iteration -> raw reward scores of that iteration's rollouts}.
    """
    names = list(samples)
    rows = max((len(s) for s in samples.values()), default=1) or 1
    figure, axes = plt.subplots(rows, len(names), figsize=(4 * len(names), 1.8 * rows), squeeze=False, sharex=True)
    for column, name in enumerate(names):
        for row, (step, scores) in enumerate(sorted(samples[name].items(), key=lambda item: int(item[0]))):
            axes[row][column].hist(scores, bins=20)
            axes[row][column].set_title(f"{name}, iteration {step}", fontsize=8)
    figure.tight_layout()
    return figure
