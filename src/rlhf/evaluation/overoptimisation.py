"""What the reward model delivers as the policy moves away from SFT (Gao et al. 2023, "Scaling Laws for Reward
Model Overoptimization"): the over-optimisation curve of the policies PPO kept, and best-of-N of the SFT model,
the reference point to read that curve against. Both sample the first ``curve_prompts`` evaluated prompts the way
the evaluation does (:class:`rlhf.evaluation.evaluator.Sampling`) and reuse its first sample of each.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import PreTrainedModel

from rlhf.evaluation.comparison import best_of_n, best_of_n_kl, paired_difference
from rlhf.evaluation.evaluator import Sampling, generate_and_score


def curve(
    sft: PreTrainedModel,
    prompts: list[list[dict]],
    sampling: Sampling,
    *,
    sampled: Mapping[int, dict[str, Any]],
    kept: Mapping[int, Callable[[], PreTrainedModel]],
    kinds: list[str] | None = None,
) -> list[dict[str, float]]:
    """The over-optimisation curve: one row for the SFT model (iteration 0) and one for each policy PPO kept (its
    rollout step), in the order of the iterations, each sampled the same way: one sample of each of the first
    ``sampling.config.curve_prompts`` prompts, each from its own generator as the evaluation draws it.

    Args:
        sft: the SFT model, the reference of every KL.
        prompts: the evaluated prompts, in the evaluation's order.
        sampling: as the evaluation sampled (:class:`rlhf.evaluation.evaluator.Sampling`).
        sampled: the evaluation's own runs by iteration (SFT at 0, the shipped policy at its iteration): their
            first sample of those prompts is that point's, not drawn again.
        kept: iteration -> a function that loads that kept policy (on the device, no gradients); called only for
            an iteration not in ``sampled``, one model at a time.
        kinds: each prompt's kind of data, its responses read with that kind's score
            (:func:`rlhf.evaluation.evaluator.generate_and_score`).

    Returns:
        Rows of ``iteration``, mean ``proxy`` and ``judge`` score, and the KL to SFT in nats per response: ``kl``
        (k1, as ``eval/policy/kl``; its mean over a few samples can come out below 0), ``kl_k3`` (never negative)
        and ``sqrt_kl`` = sqrt(``kl_k3``), the axis of Gao et al. 2023.
    """
    fixed = prompts[: sampling.config.curve_prompts]
    fixed_kinds = kinds[: len(fixed)] if kinds is not None else None

    def point(iteration: int, run: dict[str, Any]) -> dict[str, float]:
        kl, kl_k3, proxy, judge = (float(run[k][: len(fixed), 0].mean()) for k in ("kl", "kl_k3", "proxy", "judge"))
        return {"iteration": iteration, "kl": kl, "kl_k3": kl_k3, "sqrt_kl": math.sqrt(kl_k3), "proxy": proxy,
                "judge": judge}  # fmt: skip

    rows = [point(0, sampled[0])]
    for iteration in sorted(kept):
        if iteration in sampled:
            rows.append(point(iteration, sampled[iteration]))
            continue
        policy = kept[iteration]()
        rows.append(point(iteration, generate_and_score(policy, sft, fixed, sampling, kinds=fixed_kinds)))
        del policy
    return rows


def best_of_n_figures(
    sft: PreTrainedModel,
    prompts: list[list[dict]],
    sampling: Sampling,
    *,
    sampled: dict[str, Any],
    kinds: list[str] | None = None,
) -> dict[str, float]:
    """Best-of-N of the SFT model on the curve prompts, the reference point of the over-optimisation curve.

    ``config.best_of_n`` samples of each of the first ``curve_prompts`` prompts (the first of each is the
    evaluation's own, taken from ``sampled``, its SFT run, not drawn again); for N = 1, 4, 16, ... up to it,
    the proxy keeps each prompt's best of the first N (:func:`rlhf.evaluation.comparison.best_of_n`), and the judge
    scores it (``kinds``: each prompt's kind of data, as :func:`curve`). KL to SFT is the analytic
    ``log N - (N-1)/N`` (:func:`rlhf.evaluation.comparison.best_of_n_kl`): what the reward model can deliver at each
    KL without training, to read PPO's kept policies against.

    Returns:
        ``eval/best_of_n/N/{judge,proxy,kl,sqrt_kl}`` (mean judge and proxy score of the kept responses) and, for
        the largest N, ``eval/best_of_n/judge_gain`` with ``_low``/``_high``: its judge score minus best-of-1's
        (one sample of SFT) on the same prompts, bootstrap over prompts; ``{}`` when ``best_of_n`` is 0.
    """
    config = sampling.config
    if config.best_of_n < 1:
        return {}
    fixed = prompts[: config.curve_prompts]
    run = {k: sampled[k][: len(fixed), :1] for k in ("proxy", "judge")}
    if config.best_of_n > 1:
        fixed_kinds = kinds[: len(fixed)] if kinds is not None else None
        more = generate_and_score(sft, sft, fixed, sampling, samples=config.best_of_n, first=1, kinds=fixed_kinds)
        run = {k: torch.cat([run[k], more[k]], dim=1) for k in run}
    figures, n, kept = {}, 1, {}
    while n <= config.best_of_n:
        kept[n] = best_of_n(run["proxy"], run["judge"], n)
        kl = best_of_n_kl(n)
        figures |= {
            f"eval/best_of_n/{n}/judge": float(kept[n].mean()),
            f"eval/best_of_n/{n}/proxy": float(best_of_n(run["proxy"], run["proxy"], n).mean()),
            f"eval/best_of_n/{n}/kl": kl,
            f"eval/best_of_n/{n}/sqrt_kl": math.sqrt(kl),
        }
        n *= 4
    largest = max(kept)
    gain = paired_difference(kept[largest][:, None], kept[1][:, None], config.bootstrap_resamples, config.seed)
    return figures | {
        "eval/best_of_n/largest": float(largest),
        "eval/best_of_n/judge_gain": gain.mean,
        "eval/best_of_n/judge_gain_low": gain.low,
        "eval/best_of_n/judge_gain_high": gain.high,
    }
