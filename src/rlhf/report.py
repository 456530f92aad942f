"""The report of one pipeline run: one self-contained HTML page built from the files the stages wrote.

Pure: :func:`render_report` takes the inputs already loaded (:data:`INPUTS` names them; ``tasks/report.py``
maps each name to its file, reads them and draws the figures) and the figures as PNG bytes, and returns the
page: inline CSS, figures as ``data:image/png;base64`` images, no script and no external address, so it opens
offline from a file or as an MLflow artifact. Text from the files (model responses above all) is escaped by
Jinja2's autoescape: it never becomes markup. A missing input makes its part of the page say so; a missing or
non-finite value shows as n/a.
"""

from __future__ import annotations

import base64
import math
from importlib import resources
from typing import Any

import jinja2

from rlhf.gate_rules import decision_sentence
from rlhf.report_cells import NA, fmt, fmt_count, fmt_interval, number
from rlhf.report_cells import table as _table
from rlhf.report_kinds import kind_tables, scorer_kind_table
from rlhf.stats import chance_warning

INPUTS = (  # the stages' files the page is built from, by name (the caller maps each name to its file)
    "prepare",
    "validate",
    "validation",
    "sft",
    "reward",
    "reward_kinds",
    "margins",
    "reward_gate",
    "judge",
    "judge_kinds",
    "judge_margins",
    "ppo",
    "curves",
    "overoptimisation",
    "eval",
    "eval_kinds",
    "samples",
    "policy_gate",
)
LISTS = ("curves", "overoptimisation")  # JSON lists of row objects
IMAGES = ("margins", "judge_margins")  # PNG bytes; the other inputs are JSON objects
PPO_FIGURES = (  # figure name, title, ((key in metrics/ppo_curves.json, legend label), ...)
    (
        "ppo_reward",
        "reward-model score",
        (("ppo/reward/mean", "rollouts (mean)"), ("ppo/validation/reward", "validation")),
    ),
    ("ppo_kl", "KL to the SFT model (nats / response)", (("ppo/kl", "rollouts"),)),
    ("ppo_perplexity", "perplexity of responses", (("ppo/perplexity", "rollouts"),)),
    ("ppo_length", "response length (tokens)", (("ppo/response_length", "rollouts"),)),
    ("ppo_clipfrac", "clip fractions", (("ppo/policy/clipfrac", "policy"), ("ppo/value/clipfrac", "value"))),
)
OVEROPTIMISATION = "overoptimisation"  # the figure of proxy and judge mean scores against sqrt(KL)
HEADLINE = (  # (input, metric): the figures the parent MLflow run carries
    ("reward", "rm/accuracy"),
    ("reward", "rm/accuracy_low"),
    ("reward", "rm/balanced_accuracy"),
    ("judge", "judge/accuracy"),
    ("judge", "judge/balanced_accuracy"),
    ("eval", "eval/judge/win_rate"),
    ("eval", "eval/judge/win_rate_low"),
    ("eval", "eval/judge/win_rate_high"),
    ("eval", "eval/proxy/win_rate"),
    ("eval", "eval/proxy/win_rate_low"),
    ("eval", "eval/proxy/win_rate_high"),
    ("eval", "eval/policy/kl"),
    ("eval", "eval/judge/meaningful"),
)
# the tables of one value per measure: (label, key ("{p}": the file's prefix), "count" | "interval" | "")
SFT_ROWS = (
    ("examples", "sft/examples", "count"),
    ("epochs over them (steps x batch / examples)", "sft/epochs", ""),
    ("steps", "sft/steps", "count"),
    ("loss, first step", "sft/loss_first", ""),
    ("loss, last step", "sft/loss_last", ""),
)
ACCURACY_ROWS = (
    ("accuracy on held-out pairs [95% Wilson]", "{p}/accuracy", "interval"),
    ("decisive pairs", "{p}/pairs", "count"),
    (
        "balanced accuracy: mean of chosen-shorter and chosen-longer [95% stratified]",
        "{p}/balanced_accuracy",
        "interval",
    ),
    ("length-only baseline: accuracy of 'prefer the shorter'", "{p}/length_baseline_accuracy", ""),
    ("ties", "{p}/ties", "count"),
    ("calibration error (ECE)", "{p}/ece", ""),
    ("accuracy, chosen response shorter", "{p}/accuracy_chosen_shorter", ""),
    ("pairs, chosen response shorter", "{p}/pairs_chosen_shorter", "count"),
    ("accuracy, chosen response longer", "{p}/accuracy_chosen_longer", ""),
    ("pairs, chosen response longer", "{p}/pairs_chosen_longer", "count"),
    ("correlation of score with length", "{p}/length_corr", ""),
    ("mean margin (chosen - rejected)", "{p}/margin", ""),
    ("share of pairs where an empty response beats the chosen one", "{p}/empty_beats_chosen", ""),
    ("share where a one-word reply beats the chosen one (mean over the replies)", "{p}/short_reply_beats_chosen", ""),
    ("share where the worst one-word reply beats the chosen one", "{p}/short_reply_beats_chosen_max", ""),
)
PPO_ROWS = (
    ("iterations", "ppo/iterations", "count"),
    ("iterations that updated the policy", "ppo/policy_iterations", "count"),
    ("shipped iteration", "ppo/shipped_iteration", "count"),
    ("rollbacks", "ppo/rollbacks", "count"),
    ("validation reward (shipped)", "ppo/validation/reward", ""),
    ("validation KL (shipped)", "ppo/validation/kl", ""),
    ("validation EOS rate (shipped)", "ppo/validation/eos_rate", ""),
    ("KL, last iteration", "ppo/last/kl", ""),
)
RESPONSE_ROWS = (
    ("length (tokens)", "length"),
    ("EOS rate", "eos_rate"),
    ("cut at max_new_tokens", "truncated_share"),
    ("distinct-1", "distinct_1"),
    ("distinct-2", "distinct_2"),
    ("refusal rate (a heuristic: refusal phrases at the start, quotes aside)", "refusal_rate"),
    ("ptx perplexity", "ptx_perplexity"),
)
JUDGE_AT_CHANCE = "the judge is at chance: its win rates below mean nothing"
JUDGE_MEANINGLESS = (  # eval/judge/meaningful 0 (rlhf.gate_rules.judge_doubts: at chance, or ranking by length)
    "the verdicts of the judge mean nothing: it is at chance on judge_eval or ranks by length (see the evaluate log)"
)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def data_uri(png: bytes) -> str:
    """PNG bytes as a ``data:image/png;base64,...`` address.

    Raises:
        ValueError: ``png`` is not a PNG file (wrong signature).
    """
    if not png.startswith(PNG_SIGNATURE):
        raise ValueError("not a PNG image (its first bytes are not the PNG signature)")
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def check_inputs(loaded: dict[str, Any], paths: dict[str, str]) -> None:
    """Check that each loaded input has the shape its file (``paths[name]``) should hold (None: the file is missing).

    Raises:
        ValueError: one line naming the file and what it should hold, e.g. ``metrics/ppo_curves.json: expected
            a list of objects, found dict``.
    """
    for name, value in loaded.items():
        path = paths[name]
        if value is None:
            continue
        if name in IMAGES:
            ok, what = isinstance(value, bytes) and value.startswith(PNG_SIGNATURE), "a PNG image"
        elif name in LISTS:
            ok, what = isinstance(value, list) and all(isinstance(r, dict) for r in value), "a list of objects"
        elif name == "samples":
            rows = value.get("samples") if isinstance(value, dict) else None
            ok = isinstance(rows, list) and all(isinstance(r, dict) for r in rows)
            what = 'an object with a "samples" list of objects'
        else:
            ok, what = isinstance(value, dict), "a JSON object"
        if not ok:
            found = "other bytes" if isinstance(value, bytes) else type(value).__name__
            raise ValueError(f"{path}: expected {what}, found {found}")


GATES = (("reward_gate", "reward gate"), ("policy_gate", "policy gate"))  # input name, as the verdict names it


def headline(loaded: dict[str, Any]) -> dict[str, float]:
    """The headline figures of :data:`HEADLINE` in ``loaded``: a figure its file holds as None or NaN (a win rate
    of all ties) is NaN, so the parent run shows it undefined rather than absent; a missing file's are left out.

    Returns:
        e.g. ``{"rm/accuracy": 0.59, "rm/accuracy_low": 0.52, "eval/judge/win_rate": nan, ...}``.
    """
    found = {key: (loaded[name] or {}).get(key, math.nan) for name, key in HEADLINE if loaded.get(name) is not None}
    return {key: math.nan if number(value) is None else float(value) for key, value in found.items()}


def _missing(loaded: dict[str, Any], paths: dict[str, str], *names: str) -> list[str]:
    return [f"not produced by this run ({paths[n]} missing)" for n in names if loaded.get(n) is None]


def _section(sid: str, title: str, loaded: dict[str, Any], paths: dict[str, str], *names: str) -> dict[str, Any]:
    missing = _missing(loaded, paths, *names)
    return dict(id=sid, title=title, missing=missing, warnings=[], notes=[], tables=[], figures=[], samples=[])


def _values(caption: str, m: dict[str, Any], spec: tuple, prefix: str = "") -> dict:
    """A two-column table of ``spec`` rows (label, key, kind) read from metrics ``m``."""
    rows = []
    for label, key, kind in spec:
        key = key.format(p=prefix)
        rows.append(
            [label, {"count": fmt_count(m.get(key)), "interval": fmt_interval(m, key)}.get(kind, fmt(m.get(key)))]
        )
    return _table(caption, ["measure", "value"], rows)


def _gate(section: dict[str, Any], report: dict[str, Any] | None, what: str) -> None:
    """The decision (a warning unless it passed) and the checks of a gate report (reports/*_gate.json)."""
    if report is None:
        return
    candidate, decision = report.get("candidate") or {}, str(report.get("decision", NA))
    line = (
        f"{what}: {decision} (candidate {candidate.get('name', '?')} version {candidate.get('version', '?')}, "
        f"decided {report.get('decided', NA)} at {report.get('decided_at', NA)})"
    )
    (section["notes"] if decision == "pass" else section["warnings"]).append(line)
    checks = report.get("checks") or []
    rows = [
        [
            str(c.get("criterion", "")),
            fmt(c.get("value")),
            fmt(c.get("bound")),
            "passed" if c.get("passed") else "FAILED",
            str(c.get("detail", "")),
        ]
        for c in checks
    ]
    classes = ["" if c.get("passed") else "fail" for c in checks]
    headers = ["criterion", "value", "bound", "result", "detail"]
    section["tables"].append(_table(f"{what} checks", headers, rows, classes))


def data_section(loaded: dict[str, Any], paths: dict[str, str]) -> dict[str, Any]:
    """Rows per split (prepare, then validate) and the count of rows each validation rule quarantined."""
    section = _section("data", "Data and validation", loaded, paths, "prepare", "validation", "validate")
    prepare, validation, v = (loaded.get(n) or {} for n in ("prepare", "validation", "validate"))
    if loaded.get("prepare") is not None:
        section["notes"].append(
            f"prepare: {fmt_count(prepare.get('rows_in'))} rows read, "
            f"{fmt_count(prepare.get('quarantined'))} quarantined"
        )
    if loaded.get("validate") is not None:
        section["notes"].append(
            f"validate: {fmt_count(v.get('validate/rows_in'))} rows checked, "
            f"{fmt_count(v.get('validate/valid'))} valid, "
            f"{fmt_count(v.get('validate/quarantined'))} quarantined"
        )
    if loaded.get("validation") is not None:
        section["notes"].append(
            f"validation {'passed' if validation.get('success') else 'FAILED'}; at most "
            f"{fmt(validation.get('max_quarantine_fraction'), 2)} of a split may be quarantined; control tokens: "
            f"{validation.get('control_tokens', NA)}, role markers: {validation.get('role_markers', NA)}"
        )
    splits = {name: split for name, split in (validation.get("splits") or {}).items() if isinstance(split, dict)}
    names = sorted({k.split("/", 1)[1] for k in prepare if k.startswith("split/")} | set(splits))
    if names:
        counts = ("rows_in", "valid", "quarantined")
        rows = [
            [n, fmt_count(prepare.get(f"split/{n}")), *(fmt_count(splits.get(n, {}).get(k)) for k in counts)]
            for n in names
        ]
        headers = ["split", "prepared rows", "validated rows in", "valid", "quarantined"]
        section["tables"].append(_table("Rows per split", headers, rows))
    checked = {n: s.get("rules") or {} for n, s in sorted(splits.items())}
    rules = sorted({rule for found in checked.values() for rule in found})
    if rules:
        rows = [
            [rule, *(fmt_count(found[rule]) if rule in found else "-" for found in checked.values())] for rule in rules
        ]
        classes = ["fail" if any(number(found.get(r)) for found in checked.values()) else "" for r in rules]
        caption = "Rows quarantined per rule ('-': the split is not checked by it)"
        section["tables"].append(_table(caption, ["rule", *checked], rows, classes))
    return section


def sft_section(loaded: dict[str, Any], paths: dict[str, str]) -> dict[str, Any]:
    """The SFT run's size and loss."""
    section = _section("sft", "Supervised fine-tuning", loaded, paths, "sft")
    if loaded.get("sft") is not None:
        section["tables"].append(_values("SFT", loaded["sft"], SFT_ROWS))
    return section


def reward_section(loaded: dict[str, Any], paths: dict[str, str]) -> dict[str, Any]:
    """Reward-model metrics with the Wilson interval, ECE and length bias, the gate and the margin histogram."""
    section = _section("reward-model", "Reward model (proxy)", loaded, paths, "reward", "reward_gate", "margins")
    rm = loaded.get("reward")
    if rm is not None:
        warning = chance_warning(
            "rm_eval balanced accuracy", *(rm.get(f"rm/balanced_accuracy{s}") for s in ("", "_low", "_high"))
        )
        section["warnings"] += [warning] if warning else []
        section["tables"].append(_values("Reward model on rm_eval", rm, ACCURACY_ROWS, "rm"))
    per_kind, warnings = scorer_kind_table(loaded.get("reward_kinds"), "rm", "Reward model on rm_eval, per kind")
    section["tables"] += [per_kind] if per_kind else []
    section["warnings"] += warnings
    _gate(section, loaded.get("reward_gate"), "reward gate")
    if loaded.get("margins") is not None:
        section["figures"].append(_figure("margins (chosen - rejected) on rm_eval", loaded["margins"]))
    return section


def judge_warning(m: dict[str, Any], prefix: str = "judge/") -> str:
    """The loud line when the judge's balanced-accuracy interval includes 0.5 (or is undefined, or lies below);
    else ``""``."""
    detail = chance_warning(
        "judge balanced accuracy", *(m.get(f"{prefix}balanced_accuracy{s}") for s in ("", "_low", "_high"))
    )
    if not detail:
        return ""
    head = "the judge ranks backwards" if "below chance" in detail else "the judge is at chance"
    return f"{JUDGE_AT_CHANCE.replace('the judge is at chance', head)} ({detail})"


def judge_section(loaded: dict[str, Any], paths: dict[str, str]) -> dict[str, Any]:
    """The independent judge's own held-out accuracy, with the warning when it is no better than chance."""
    section = _section("judge", "Judge (independent reward model)", loaded, paths, "judge", "judge_margins")
    judge = loaded.get("judge")
    if judge is not None:
        section["warnings"] += [judge_warning(judge)] if judge_warning(judge) else []
        section["tables"].append(_values("Judge on its held-out pairs", judge, ACCURACY_ROWS, "judge"))
    per_kind, warnings = scorer_kind_table(loaded.get("judge_kinds"), "judge", "Judge on judge_eval, per kind")
    section["tables"] += [per_kind] if per_kind else []
    section["warnings"] += warnings
    if loaded.get("judge_margins") is not None:
        section["figures"].append(_figure("margins (chosen - rejected) on judge_eval", loaded["judge_margins"]))
    return section


def _figure(title: str, png: bytes | None) -> dict[str, str] | None:
    return None if png is None else {"title": title, "uri": data_uri(png)}


def ppo_section(loaded: dict[str, Any], paths: dict[str, str], figures: dict[str, bytes | None]) -> dict[str, Any]:
    """PPO's run summary, its curves and the over-optimisation figure (proxy and judge against sqrt(KL))."""
    section = _section("ppo", "PPO", loaded, paths, "ppo", "curves", "overoptimisation")
    if loaded.get("ppo") is not None:
        section["tables"].append(_values("PPO run", loaded["ppo"], PPO_ROWS))
        section["notes"].append(f"stopped by: {loaded['ppo'].get('stopped_by') or '-'}")
    names = [(n, t) for n, t, _ in PPO_FIGURES] if loaded.get("curves") is not None else []
    if loaded.get("overoptimisation") is not None:
        names.append((OVEROPTIMISATION, "over-optimisation: proxy and judge mean scores against sqrt(KL to SFT)"))
    for name, title in names:
        found = _figure(title, figures.get(name))
        section["figures"] += [found] if found else []
        section["notes"] += [] if found else [f"{title}: no values to draw"]
    return section


def eval_section(loaded: dict[str, Any], paths: dict[str, str]) -> dict[str, Any]:
    """Win rates, paired score differences and length-controlled win rates with their intervals (judge rows
    marked when its verdicts mean nothing), the same per kind of prompt with SFT against the base model and the
    refusals (:func:`rlhf.report_kinds.kind_tables`), and the policy gate."""
    names = ("eval", "eval_kinds", "policy_gate")
    section = _section("evaluation", "Evaluation: policy against SFT", loaded, paths, *names)
    ev = loaded.get("eval")
    if ev is not None:
        meaningless = number(ev.get("eval/judge/meaningful")) == 0.0
        if meaningless:
            section["warnings"].append(
                f"{JUDGE_MEANINGLESS} (judge accuracy {fmt_interval(ev, 'eval/judge/accuracy')}, smaller length-kind "
                f"accuracy {fmt(ev.get('eval/judge/length_accuracy'))})"
            )
        section["notes"].append(
            f"{fmt_count(ev.get('eval/prompts'))} prompts, "
            f"{fmt_count(ev.get('eval/samples_per_prompt'))} samples per prompt; judge accuracy "
            f"{fmt_interval(ev, 'eval/judge/accuracy')}; reward model version "
            f"{fmt_count(ev.get('eval/reward_model_version'))}"
        )
        rows = [
            [
                scorer,
                fmt_interval(ev, f"eval/{scorer}/win_rate"),
                fmt_count(ev.get(f"eval/{scorer}/decisive")),
                fmt_count(ev.get(f"eval/{scorer}/ties")),
                fmt(ev.get(f"eval/{scorer}/sft_score")),
                fmt(ev.get(f"eval/{scorer}/policy_score")),
                "not meaningful" if scorer == "judge" and meaningless else "",
            ]
            for scorer in ("proxy", "judge")
        ]
        classes = ["", "muted" if meaningless else ""]
        headers = ["scorer", "win rate [95%]", "decisive", "ties", "SFT mean score", "policy mean score", "note"]
        section["tables"].append(_table("Win rate of the policy over SFT (ties apart)", headers, rows, classes))
        rows = [
            [
                scorer,
                fmt_interval(ev, f"eval/{scorer}/score_diff"),
                fmt_interval(ev, f"eval/{scorer}/lc_win_rate"),
                fmt(ev.get(f"eval/{scorer}/lc_length_coef")),
                "not meaningful" if scorer == "judge" and meaningless else "",
            ]
            for scorer in ("proxy", "judge")
        ]
        headers = [
            "scorer",
            "score difference, policy - SFT [95%]",
            "length-controlled win rate [95%]",
            "length coefficient (log-odds)",
            "note",
        ]
        caption = "What the policy changed on the same prompts: by how much, and how often it wins at equal length"
        section["tables"].append(_table(caption, headers, rows, classes))
        section["tables"] += kind_tables(loaded.get("eval_kinds"), meaningless)
        rows = [["KL to SFT (nats / response)", "-", "-", fmt(ev.get("eval/policy/kl"))]]
        models = ("base", "sft", "policy")
        rows += [[label, *(fmt(ev.get(f"eval/{m}/{key}")) for m in models)] for label, key in RESPONSE_ROWS]
        section["tables"].append(_table("Responses", ["measure", "base model", "SFT", "policy"], rows))
        _best_of_n(section, ev)
    _gate(section, loaded.get("policy_gate"), "policy gate")
    return section


def _best_of_n(section: dict[str, Any], ev: dict[str, Any]) -> None:
    """Best-of-N of SFT (the proxy picks, the judge scores; Gao et al. 2023), and whether its largest N beats SFT."""
    sizes = sorted({int(k.split("/")[2]) for k in ev if k.startswith("eval/best_of_n/") and k.count("/") == 3})
    if not sizes:
        return
    rows = [
        [
            str(n),
            fmt(ev.get(f"eval/best_of_n/{n}/kl")),
            fmt(ev.get(f"eval/best_of_n/{n}/proxy")),
            fmt(ev.get(f"eval/best_of_n/{n}/judge")),
        ]
        for n in sizes
    ]
    headers = ["N", "KL to SFT (log N - (N-1)/N)", "proxy mean score", "judge mean score"]
    section["tables"].append(_table("Best-of-N of the SFT model on the curve prompts", headers, rows))
    low = number(ev.get("eval/best_of_n/judge_gain_low"))
    verdict = "beats" if low is not None and low > 0 else "does NOT beat"
    section["notes"].append(
        f"best-of-{sizes[-1]} {verdict} SFT by the judge: judge score gain over one SFT sample "
        f"{fmt_interval(ev, 'eval/best_of_n/judge_gain')} (95%, bootstrap over prompts)"
    )


def samples_section(loaded: dict[str, Any], paths: dict[str, str], limit: int) -> dict[str, Any]:
    """The first ``limit`` rows of reports/eval/samples.json: the conversation (and its kind), SFT and policy
    responses with their scores, a policy response that is SFT's text marked as the tie it is."""
    section = _section("samples", "Samples", loaded, paths, "samples")
    found = loaded.get("samples")
    if found is not None:
        rows = found["samples"]
        shown = f"the first {min(limit, len(rows))} of {len(rows)} samples"
        section["notes"].append(f"{shown} (evaluate run {found.get('run_id', NA)})")
        for row in rows[:limit]:
            same = row.get("sft_response") == row.get("policy_response")
            sides = [
                {
                    "text": str(row.get(f"{m}_response", "")),
                    "scores": f"proxy {fmt(row.get(f'{m}_proxy'))}, judge {fmt(row.get(f'{m}_judge'))}"
                    + ("; the same text as SFT's (a tie)" if same and m == "policy" else ""),
                }
                for m in ("sft", "policy")
            ]
            name = f"{row.get('id', '?')} #{row.get('sample', 0)}" + (f" ({row['kind']})" if row.get("kind") else "")
            section["samples"].append({"id": name, "prompt": conversation(row), "sides": sides})
    return section


def conversation(row: dict[str, Any]) -> str:
    """A sample's prompt as its whole conversation, one ``role: text`` paragraph a turn (earlier turns included);
    the row's ``prompt`` text when it has no ``messages``."""
    messages = row.get("messages") or []
    if not messages:
        return str(row.get("prompt", ""))
    return "\n\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in messages)


TEMPLATE = (resources.files("rlhf") / "templates/report.html").read_text(encoding="utf-8")  # a Jinja template
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
        *((what, sentence or NA) for (_, what), sentence in zip(GATES, gates, strict=True)),
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
