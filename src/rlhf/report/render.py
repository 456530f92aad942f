"""The report of one pipeline run: one self-contained HTML page built from the files the stages wrote.

Pure: :func:`render_report` takes the inputs already loaded (:data:`rlhf.report.inputs.INPUTS` names them;
``tasks/report.py`` maps each name to its file, reads them and draws the figures) and the figures as PNG bytes,
and returns the page: inline CSS, figures as ``data:image/png;base64`` images, no script and no external
address, so it opens offline from a file or as an MLflow artifact. Text from the files (model responses above
all) is escaped by Jinja2's autoescape: it never becomes markup. A missing input makes its part of the page say
so; a missing or non-finite value shows as n/a.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import jinja2

from rlhf.evaluation.gate_rules import decision_sentence
from rlhf.report.inputs import GATES, INPUTS, check_inputs
from rlhf.report.sections import (
    data_section,
    eval_section,
    judge_section,
    ppo_section,
    reward_section,
    samples_section,
    sft_section,
)
from rlhf.report.tables import NA, fmt, fmt_interval, number


def gate_figures(record: dict[str, Any] | None) -> str:
    """A gate's headline row: how many checks passed, and each failed one with its value and bound (the verdict
    row says why in words; the gate's section has every check), e.g. ``failed 1 of 2: EOS rate 0.344 (bound
    0.500)``; ``n/a`` when the gate has not decided."""
    if not record or "decision" not in record:
        return NA
    checks = record.get("checks") or []
    failed = [check for check in checks if not check.get("passed")]
    if not failed:
        return f"passed all {len(checks)} checks"
    figures = [f"{c.get('criterion', '?')} {fmt(c.get('value'))} (bound {fmt(c.get('bound'))})" for c in failed]
    return f"failed {len(failed)} of {len(checks)}: " + "; ".join(figures)


TEMPLATE = (resources.files("rlhf.report") / "templates/report.html").read_text(encoding="utf-8")  # a Jinja template


_TEMPLATE = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined).from_string(TEMPLATE)


def render_report(
    loaded: dict[str, Any],
    figures: dict[str, bytes | None],
    paths: dict[str, str],
    *,
    pipeline_run: str,
    git_commit: str,
    profile: str,
    created: str,
    samples: int = 8,
) -> str:
    """The report page.

    Args:
        loaded: input name of :data:`INPUTS` -> its content (JSON as loaded; ``margins``: the PNG's bytes), None
            (or absent) when the file is missing.
        figures: :data:`PPO_FIGURES` names and :data:`OVEROPTIMISATION` -> PNG bytes, None when the file
            holds no value to draw.
        paths: input name -> its file, as the page names a missing or malformed one.
        pipeline_run, git_commit, profile, created: the header (``created``: the time, as text).
        samples: how many rows of reports/eval/samples.json to show.

    Raises:
        ValueError: an input of the wrong shape (:func:`check_inputs`) or a figure that is not a PNG.
    """
    loaded = {name: loaded.get(name) for name in INPUTS}
    check_inputs(loaded, paths)
    ev, meaningful = loaded.get("eval") or {}, number((loaded.get("eval") or {}).get("eval/judge/meaningful"))
    judge_note = " (not meaningful: see the evaluation)" if meaningful == 0.0 else ""
    gates = [decision_sentence(loaded.get(name), what) for name, what in GATES]
    headline_rows = [
        ("verdict", next((sentence for sentence in reversed(gates) if sentence), "no gate has decided")),
        ("reward-model accuracy [95%]", fmt_interval(loaded.get("reward") or {}, "rm/accuracy")),
        ("reward-model balanced accuracy [95%]", fmt_interval(loaded.get("reward") or {}, "rm/balanced_accuracy")),
        ("judge accuracy [95%]", fmt_interval(loaded.get("judge") or {}, "judge/accuracy")),
        ("judge balanced accuracy [95%]", fmt_interval(loaded.get("judge") or {}, "judge/balanced_accuracy")),
        ("judge win rate of the policy [95%]", fmt_interval(ev, "eval/judge/win_rate") + judge_note),
        ("proxy win rate of the policy [95%]", fmt_interval(ev, "eval/proxy/win_rate")),
        ("KL of the policy to SFT (nats / response)", fmt(ev.get("eval/policy/kl"))),
        *((what, gate_figures(loaded.get(name))) for name, what in GATES),
    ]
    header_rows = [
        ("pipeline run", pipeline_run),
        ("git commit", git_commit),
        ("profile", profile),
        ("created", created),
    ]
    sections = [
        data_section(loaded, paths),
        sft_section(loaded, paths),
        reward_section(loaded, paths),
        judge_section(loaded, paths),
        ppo_section(loaded, paths, figures),
        eval_section(loaded, paths),
        samples_section(loaded, paths, samples),
    ]
    return _TEMPLATE.render(
        pipeline_run=pipeline_run, header_rows=header_rows, headline_rows=headline_rows, sections=sections
    )
