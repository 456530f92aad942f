"""Whether the judge's verdicts mean anything: why they do not (:func:`judge_doubts`), and the judge's own
held-out figures shown beside each of its verdicts (:func:`judge_figures`). Pure rules over the judge stage's
metrics; the policy gate fails a verdict whose judge is in doubt (:mod:`rlhf.evaluation.gate_rules`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from rlhf.data.kinds import kinds_in
from rlhf.evaluation.gate_rules import figure_text
from rlhf.stats import chance_warning


def judge_doubts(judge: dict[str, Any], min_length_accuracy: float, kinds: Iterable[str] = ()) -> list[str]:
    """Why the judge's verdicts mean nothing, one reason each; ``[]`` when they mean something.

    A judge must rank its own held-out pairs better than chance whatever their lengths (the lower end of the
    stratified 95% interval of its judge_eval balanced accuracy above 0.5, :func:`rlhf.stats.chance_warning`;
    "prefer the shorter" has a balanced accuracy of 0.5), and so on each kind of data's pairs
    (``judge/kind/<kind>/balanced_accuracy``): a judge that ranks helpful pairs well and harmless ones at chance
    or backwards gives a verdict on harmless prompts that means nothing, and a policy could win there by
    anything; and not by length alone: the smaller of its accuracies on chosen-shorter and on chosen-longer
    pairs must be at least ``min_length_accuracy`` (a judge that prefers the shorter response whatever it says
    calls a policy that writes less "better"; the reward gate's length criterion, applied to the judge).

    Args:
        judge: the judge stage's metrics (``judge/balanced_accuracy`` with ``_low``/``_high``, the same per kind
            as ``judge/kind/<kind>/balanced_accuracy...``, ``judge/accuracy_chosen_shorter``,
            ``judge/accuracy_chosen_longer``); None or NaN where undefined.
        min_length_accuracy: the floor of the smaller length-kind accuracy, in [0, 1].
        kinds: the kinds the evaluation reads (its prompts' kinds): each must have a judge above chance, a kind
            without figures is undefined, so a doubt. Every kind the judge's metrics hold is checked too.
    """
    doubts = []
    at_chance = chance_warning(
        "judge_eval balanced accuracy", *(judge.get(f"judge/balanced_accuracy{s}") for s in ("", "_low", "_high"))
    )
    if at_chance:
        doubts.append(at_chance)
    for kind in sorted(set(kinds) | set(kinds_in(judge, "judge"))):
        name = f"judge_eval balanced accuracy on {kind} pairs"
        at_chance = chance_warning(
            name, *(judge.get(f"judge/kind/{kind}/balanced_accuracy{s}") for s in ("", "_low", "_high"))
        )
        doubts += [at_chance] if at_chance else []
    kinds = [judge.get(f"judge/accuracy_chosen_{kind}") for kind in ("shorter", "longer")]
    smaller = min((k for k in kinds if k is not None and not math.isnan(k)), default=float("nan"))
    if not smaller >= min_length_accuracy:
        doubts.append(
            f"it ranks by length: accuracy {figure_text(kinds[0])} on chosen-shorter and {figure_text(kinds[1])} on "
            f"chosen-longer pairs, the smaller below {min_length_accuracy}"
        )
    return doubts


def judge_figures(
    judge: dict[str, Any], min_length_accuracy: float, kinds: list[str] | tuple[str, ...] = ()
) -> tuple[dict[str, float], list[str]]:
    """The judge's own judge_eval figures, shown beside each of its verdicts, and why they mean nothing (if so).

    Args:
        judge: the judge stage's metrics; min_length_accuracy: the length floor (:func:`judge_doubts`); kinds: the
            evaluated prompts' kinds, each of which needs a judge above chance on its own judge_eval pairs.

    Returns:
        ``(metrics, doubts)``: ``eval/judge/accuracy`` with ``_low``/``_high`` (Wilson 95%),
        ``eval/judge/balanced_accuracy`` with ``_low``/``_high`` (stratified bootstrap 95%),
        ``eval/judge/length_accuracy`` (the smaller of its chosen-shorter and chosen-longer accuracies),
        ``eval/judge/meaningful`` (1.0 when :func:`judge_doubts` finds nothing, per kind included) and per kind
        ``eval/kind/<kind>/judge_balanced_accuracy`` with ``_low``/``_high`` (NaN where the judge has no figure for
        it); ``doubts``: its reasons.
    """
    shown = ("accuracy", "accuracy_low", "accuracy_high")
    shown += tuple(f"balanced_{k}" for k in shown)
    names = (*shown, "accuracy_chosen_shorter", "accuracy_chosen_longer")
    values = {k: math.nan if judge.get(f"judge/{k}") is None else float(judge[f"judge/{k}"]) for k in names}
    per_kind = {
        f"kind/{kind}/{k}": math.nan if judge.get(f"judge/kind/{kind}/{k}") is None else judge[f"judge/kind/{kind}/{k}"]
        for kind in sorted(set(kinds) | set(kinds_in(judge, "judge")))
        for k in shown[3:]
    }
    doubts = judge_doubts({f"judge/{k}": float(v) for k, v in (values | per_kind).items()}, min_length_accuracy, kinds)
    metrics = {f"eval/judge/{k}": values[k] for k in shown}
    lengths = [v for v in names[len(shown) :] if not math.isnan(values[v])]
    metrics["eval/judge/length_accuracy"] = min((values[k] for k in lengths), default=math.nan)
    kind_rows = {f"eval/{k.replace('/balanced_', '/judge_balanced_')}": float(v) for k, v in per_kind.items()}
    return {**metrics, "eval/judge/meaningful": float(not doubts), **kind_rows}, doubts
