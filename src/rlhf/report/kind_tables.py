"""The report's per-kind rows of the evaluation (``metrics/eval_kinds.json``: ``eval/kind/<kind>/...``).

Each kind of prompt (HH: harmless, helpful) gets its own rows: the policy against SFT by each scorer, SFT against
the base model, and the refusals of the three models with the policy's increase over SFT, each with its 95%
interval over prompts (:func:`rlhf.evaluation.by_kind.kind_figures` names the figures). Pure: rows of text for
the page's tables (:func:`rlhf.report.tables.table`).
"""

from __future__ import annotations

from typing import Any

from rlhf.data.kinds import kinds_in
from rlhf.report.tables import fmt, fmt_count, fmt_interval, table
from rlhf.stats import chance_warning

SCORERS = ("proxy", "judge")
MODELS = ("base", "sft", "policy")


def _verdict_rows(
    kinds: dict[str, Any], names: list[str], head: str, meaningless: bool
) -> tuple[list[list[str]], list[str]]:
    """One row per kind and scorer of the comparison whose figures are ``<kind prefix><head><scorer>_...``."""
    rows, classes = [], []
    for kind in names:
        p = f"eval/kind/{kind}/{head}"
        for scorer in SCORERS:
            judge_note = ""
            if scorer == "judge":
                accuracy = fmt_interval(kinds, f"eval/kind/{kind}/judge_balanced_accuracy")
                judge_note = ("not meaningful; " if meaningless else "") + f"judge balanced accuracy here {accuracy}"
            rows.append(
                [
                    kind,
                    scorer,
                    fmt_interval(kinds, f"{p}{scorer}_win_rate"),
                    f"{fmt_count(kinds.get(f'{p}{scorer}_decisive'))} / {fmt_count(kinds.get(f'{p}{scorer}_ties'))}",
                    fmt_interval(kinds, f"{p}{scorer}_lc_win_rate"),
                    fmt_interval(kinds, f"{p}{scorer}_score_diff"),
                    judge_note,
                ]
            )
            classes.append("muted" if scorer == "judge" and meaningless else "")
    return rows, classes


def kind_tables(kinds: dict[str, Any] | None, meaningless: bool) -> list[dict]:
    """The evaluation's per-kind tables; ``[]`` when no per-kind figure was recorded.

    Args:
        kinds: ``metrics/eval_kinds.json`` as loaded (None: missing).
        meaningless: the judge's verdicts mean nothing (``eval/judge/meaningful`` 0): its rows are struck through.

    Returns:
        The policy against SFT per kind and scorer; SFT against the base model per kind and scorer (when the
        base model was evaluated); refusal rates of each model, the policy's increase over SFT, the share it
        answered where SFT or the base model declined, and lengths.
    """
    kinds = kinds or {}
    names = kinds_in(kinds, "eval")
    if not names:
        return []
    headers = ["kind", "scorer", "win rate [95%]", "decisive / ties", "length-controlled win rate [95%]"]
    headers += ["score difference [95%]", "note"]
    tables = []
    rows, classes = _verdict_rows(kinds, names, "", meaningless)
    caption = "Per kind of prompt: the policy against SFT (policy - SFT; 95% intervals over prompts)"
    tables.append(table(caption, headers, rows, classes))
    if any(key.startswith(f"eval/kind/{k}/sft_vs_base/") for k in names for key in kinds):
        rows, classes = _verdict_rows(kinds, names, "sft_vs_base/", meaningless)
        caption = "Per kind of prompt: SFT against the base model, what SFT itself changed (SFT - base)"
        tables.append(table(caption, [*headers[:-2], "score difference, SFT - base [95%]", "note"], rows, classes))
    rows = []
    for kind in names:
        p = f"eval/kind/{kind}/"
        rows.append(
            [
                kind,
                fmt_count(kinds.get(p + "prompts")),
                *(fmt(kinds.get(f"{p}{m}_refusal_rate")) for m in MODELS),
                fmt_interval(kinds, p + "refusal_increase"),
                fmt(kinds.get(p + "complied_where_declined")),
                " / ".join(fmt(kinds.get(f"{p}{m}_length"), 1) for m in MODELS),
            ]
        )
    headers = ["kind", "prompts", "refusal rate, base", "SFT", "policy", "policy - SFT [95%, paired over prompts]"]
    headers.append("policy answered where SFT or base declined (its samples first below)")
    caption = "Per kind of prompt: refusals (a heuristic: refusal phrases at the start) and lengths"
    tables.append(table(caption, [*headers, "length, base / SFT / policy (tokens)"], rows))
    return tables


def scorer_kind_table(metrics: dict[str, Any] | None, prefix: str, caption: str) -> tuple[dict | None, list[str]]:
    """The reward model's or the judge's held-out figures per kind of data (``<prefix>/kind/<kind>/...``,
    ``metrics/<stage>_kinds.json``): one row per kind with its balanced accuracy and accuracy (95% intervals),
    decisive pairs, the chosen-shorter and chosen-longer accuracies, and how often an empty answer and the
    most successful one-word reply beat the chosen response; and a warning for each kind whose balanced-accuracy
    interval includes chance or lies below it (:func:`rlhf.stats.chance_warning`).

    Returns:
        ``(table or None when the metrics name no kind, warnings)``.
    """
    metrics = metrics or {}
    rows, warnings = [], []
    for kind in kinds_in(metrics, prefix):
        p = f"{prefix}/kind/{kind}/"
        rows.append(
            [
                kind,
                fmt_interval(metrics, p + "balanced_accuracy"),
                fmt_interval(metrics, p + "accuracy"),
                fmt_count(metrics.get(p + "pairs")),
                fmt(metrics.get(p + "accuracy_chosen_shorter")),
                fmt(metrics.get(p + "accuracy_chosen_longer")),
                fmt(metrics.get(p + "empty_beats_chosen")),
                fmt(metrics.get(p + "short_reply_beats_chosen_max")),
            ]
        )
        warning = chance_warning(
            f"{kind} balanced accuracy", *(metrics.get(f"{p}balanced_accuracy{s}") for s in ("", "_low", "_high"))
        )
        warnings += [warning] if warning else []
    headers = ["kind", "balanced accuracy [95%]", "accuracy [95%]", "decisive pairs", "chosen shorter",
               "chosen longer", "empty beats chosen", "a one-word reply beats chosen (most)"]  # fmt: skip
    return (table(caption, headers, rows) if rows else None), warnings
