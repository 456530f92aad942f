"""The report's sections, one builder per stage (data, SFT, reward model, judge, PPO, evaluation, samples):
each takes the loaded inputs and returns its tables, notes, warnings and figures; a missing input makes its
section say so.
"""

from __future__ import annotations

import base64
from typing import Any

from rlhf.report.inputs import OVEROPTIMISATION, PNG_SIGNATURE, PPO_FIGURES
from rlhf.report.kind_tables import kind_tables, scorer_kind_table
from rlhf.report.tables import (
    ACCURACY_ROWS,
    NA,
    PPO_ROWS,
    RESPONSE_ROWS,
    SFT_ROWS,
    fmt,
    fmt_count,
    fmt_interval,
    number,
    table,
    values_table,
)
from rlhf.stats import chance_warning

JUDGE_AT_CHANCE = "the judge is at chance: its win rates below mean nothing"


JUDGE_MEANINGLESS = (  # eval/judge/meaningful 0 (rlhf.evaluation.judge_trust.judge_doubts: at chance, or ranking by
    # length)
    "the verdicts of the judge mean nothing: it is at chance on judge_eval or ranks by length (see the evaluate log)"
)


def data_uri(png: bytes) -> str:
    """PNG bytes as a ``data:image/png;base64,...`` address.

    Raises:
        ValueError: ``png`` is not a PNG file (wrong signature).
    """
    if not png.startswith(PNG_SIGNATURE):
        raise ValueError("not a PNG image (its first bytes are not the PNG signature)")
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _missing(loaded: dict[str, Any], paths: dict[str, str], *names: str) -> list[str]:
    return [f"not produced by this run ({paths[n]} missing)" for n in names if loaded.get(n) is None]


def _section(sid: str, title: str, loaded: dict[str, Any], paths: dict[str, str], *names: str) -> dict[str, Any]:
    missing = _missing(loaded, paths, *names)
    return dict(id=sid, title=title, missing=missing, warnings=[], notes=[], tables=[], figures=[], samples=[])


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
    section["tables"].append(table(f"{what} checks", headers, rows, classes))


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
        section["tables"].append(table("Rows per split", headers, rows))
    checked = {n: s.get("rules") or {} for n, s in sorted(splits.items())}
    rules = sorted({rule for found in checked.values() for rule in found})
    if rules:
        rows = [
            [rule, *(fmt_count(found[rule]) if rule in found else "-" for found in checked.values())] for rule in rules
        ]
        classes = ["fail" if any(number(found.get(r)) for found in checked.values()) else "" for r in rules]
        caption = "Rows quarantined per rule ('-': the split is not checked by it)"
        section["tables"].append(table(caption, ["rule", *checked], rows, classes))
    return section


def sft_section(loaded: dict[str, Any], paths: dict[str, str]) -> dict[str, Any]:
    """The SFT run's size and loss; with ``sft.steps`` 0 a note that there was none (SFT is the base model)."""
    section = _section("sft", "Supervised fine-tuning", loaded, paths, "sft")
    if loaded.get("sft") is not None:
        if loaded["sft"].get("sft/steps") == 0:
            section["notes"].append(
                "no fine-tuning (sft.steps 0): SFT is the base model, what PPO starts from and every figure compares "
                "with; SFT against the base model is a tie by construction"
            )
        section["tables"].append(values_table("SFT", loaded["sft"], SFT_ROWS))
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
        section["tables"].append(values_table("Reward model on rm_eval", rm, ACCURACY_ROWS, "rm"))
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
        section["tables"].append(values_table("Judge on its held-out pairs", judge, ACCURACY_ROWS, "judge"))
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
        section["tables"].append(values_table("PPO run", loaded["ppo"], PPO_ROWS))
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
    refusals (:func:`rlhf.report.kind_tables.kind_tables`), and the policy gate."""
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
        section["tables"].append(table("Win rate of the policy over SFT (ties apart)", headers, rows, classes))
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
        section["tables"].append(table(caption, headers, rows, classes))
        section["tables"] += kind_tables(loaded.get("eval_kinds"), meaningless)
        rows = [["KL to SFT (nats / response)", "-", "-", fmt(ev.get("eval/policy/kl"))]]
        models = ("base", "sft", "policy")
        rows += [[label, *(fmt(ev.get(f"eval/{m}/{key}")) for m in models)] for label, key in RESPONSE_ROWS]
        section["tables"].append(table("Responses", ["measure", "base model", "SFT", "policy"], rows))
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
    section["tables"].append(table("Best-of-N of the SFT model on the curve prompts", headers, rows))
    low = number(ev.get("eval/best_of_n/judge_gain_low"))
    verdict = "beats" if low is not None and low > 0 else "does NOT beat"
    section["notes"].append(
        f"best-of-{sizes[-1]} {verdict} SFT by the judge: judge score gain over one SFT sample "
        f"{fmt_interval(ev, 'eval/best_of_n/judge_gain')} (95%, bootstrap over prompts)"
    )


CUT_OFF = (
    "; cut off at max_new_tokens before it ended (no EOS): with generation.no_eos constant (the default) both "
    "scores are its no_eos_value, not a reading of the text"
)


def samples_section(loaded: dict[str, Any], paths: dict[str, str], limit: int) -> dict[str, Any]:
    """The first ``limit`` rows of reports/eval/samples.json: the conversation (and its kind), SFT and policy
    responses with their scores, a policy response that is SFT's text marked as the tie it is, and a row where the
    policy answered what SFT or the base model declined marked so (evaluate puts those rows first)."""
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
                    + ("; the same text as SFT's (a tie)" if same and m == "policy" else "")
                    + (CUT_OFF if row.get(f"{m}_ended") is False else ""),
                }
                for m in ("sft", "policy")
            ]
            name = f"{row.get('id', '?')} #{row.get('sample', 0)}" + (f" ({row['kind']})" if row.get("kind") else "")
            if row.get("complied_where_declined"):
                name += ": the policy answered what SFT or the base model declined"
            section["samples"].append({"id": name, "prompt": conversation(row), "sides": sides})
    return section


def conversation(row: dict[str, Any]) -> str:
    """A sample's prompt as its whole conversation, one ``role: text`` paragraph a turn (earlier turns included);
    the row's ``prompt`` text when it has no ``messages``."""
    messages = row.get("messages") or []
    if not messages:
        return str(row.get("prompt", ""))
    return "\n\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in messages)
