"""The preference-data suite: Great Expectations rules over the processed splits, with quarantine.

Each rule is one expectation over a column derived from the rows (text,
flags, token lengths). Split kinds: ``pairs`` (prompt/chosen/rejected),
``prompts`` and ``ptx`` (PPO-ptx rows, ``{"messages"}`` or ``{"text"}``, whose
rules read each message's content, never the chat template's own markers).
A row that breaks any rule is quarantined with the names of the rules it
broke; the rest is valid. Rows in = valid rows + quarantined rows, always. The
split fails when it is empty or when the share of quarantined rows exceeds
``max_quarantine_fraction``; the failure message has one line per broken rule
(file, row, rule, value).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any

import great_expectations as gx
import pandas as pd
from transformers import PreTrainedTokenizerBase

from rlhf.data import RowError, parse_ptx_row, ptx_token_ids
from rlhf.models import encode_chat, encode_prompt

ROLE_MARKER = re.compile(r"(?:^|\s)(?:Human|Assistant|User|System):")
"""A speaker tag inside a response or a ptx message, at a line start or mid-line ("... Human: what? Assistant: ...")."""
PAIR_SPLITS = ("sft", "rm_train", "rm_eval")
PROMPT_SPLITS = ("ppo_prompts", "eval_prompts")
PTX_SPLITS = ("ptx_text", "ptx_heldout")
KINDS = ("pairs", "prompts", "ptx")


@dataclass
class ValidationConfig:
    """Suite settings (params.yaml section ``validate``)."""

    max_length: int = 256  # tokens of prompt + response, as the trainers truncate (keep equal to sft/reward max_length)
    max_prompt_tokens: int = 2048
    max_response_tokens: int = 1024
    role_markers: str = "quarantine"  # quarantine | keep: "Human:"/"Assistant:" inside a response or ptx content
    max_ptx_tokens: int = 2048  # tokens of a ptx row as PPO-ptx reads it (chat template or text + EOS)
    max_quarantine_fraction: float = 0.05


@dataclass
class SplitResult:
    """Outcome of one split: valid rows, quarantined rows with reasons, per-rule counts, errors, GX results."""

    valid: list[dict[str, Any]]
    quarantined: list[dict[str, Any]]
    rule_counts: dict[str, int]
    role_marker_rows: int
    errors: list[str]
    gx_result: dict[str, Any] = field(default_factory=dict)


def _text(messages: Any) -> str | None:
    if isinstance(messages, str):
        return messages
    if isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str) for m in messages
    ):
        return "\n".join(m["content"] for m in messages)
    return None


def _utf8(text: str | None) -> bool:
    try:
        (text or "").encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _safe(text: str | None) -> str:
    """The text with anything UTF-8 cannot encode (lone surrogates) escaped, so the frame can hold it."""
    return (text or "").encode("utf-8", "backslashreplace").decode("utf-8")


def _normalized(text: str | None) -> str:
    return " ".join(unicodedata.normalize("NFKC", text or "").split())


def _ptx_record(row: Any, index: int, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """Derived columns of one ptx row: the rules read each message's content (or the text), one by one."""
    try:
        parsed = parse_ptx_row(row)
    except RowError:
        parsed = None
    messages = (parsed or {}).get("messages") or []
    contents = [m["content"] for m in messages] if parsed and "messages" in parsed else [(parsed or {}).get("text")]
    contents = [c for c in contents if c is not None]
    utf8 = all(_utf8(c) for c in contents)
    marker = next((c for c in contents if ROLE_MARKER.search(c)), None)
    if parsed is None:
        key = f"\x00invalid row {index}"  # a malformed row is reported by 'fields', not as a duplicate
    elif "messages" in parsed:
        key = "\x1f".join(f"{m['role']}\x1e{_normalized(m['content'])}" for m in messages)
    else:
        key = f"text\x1e{_normalized(parsed['text'])}"
    return {
        "fields_ok": parsed is not None,
        "utf8_ok": utf8,
        "text": _safe("\n".join(contents)),
        "contents_nonempty": bool(contents) and all(c.strip() for c in contents),
        "role_marker": marker is not None,
        "marker_content": _safe(marker),
        "ptx_tokens": len(ptx_token_ids(tokenizer, row, 10**9)) if parsed is not None and utf8 else 0,
        "key": _safe(key),
    }


def derive_columns(
    rows: list[dict[str, Any]], kind: str, tokenizer: PreTrainedTokenizerBase, config: ValidationConfig
) -> pd.DataFrame:
    """The columns the expectations read, one row per input row.

    Args:
        rows: the split's rows.
        kind: one of :data:`KINDS`.
        tokenizer: the base tokenizer (token lengths, truncation).
        config: :class:`ValidationConfig`.
    """
    records = []
    for row in rows:
        if kind == "ptx":
            records.append(_ptx_record(row, len(records), tokenizer))
            continue
        prompt = _text(row.get("prompt"))
        record = {"prompt": _safe(prompt), "prompt_tokens": 0}
        responses = ("chosen", "rejected") if kind == "pairs" else ()
        texts = {name: _text(row.get(name)) for name in responses}
        record["fields_ok"] = (
            prompt is not None
            and isinstance(row.get("prompt"), list)
            and all(t is not None and isinstance(row.get(n), list) for n, t in texts.items())
        )
        record["utf8_ok"] = all(_utf8(t) for t in [prompt, *texts.values()])
        if record["fields_ok"] and record["utf8_ok"]:
            record["prompt_tokens"] = len(encode_prompt(tokenizer, row["prompt"], 10**9))
        for name, text in texts.items():
            record[name] = _safe(text)
            record[f"{name}_tokens"] = (
                len(tokenizer(text, add_special_tokens=False)["input_ids"]) if text and record["utf8_ok"] else 0
            )
            record[f"{name}_role_marker"] = bool(ROLE_MARKER.search(text or ""))
        if kind == "pairs":
            record["distinct"] = _normalized(texts["chosen"]) != _normalized(texts["rejected"])
            same = False
            if record["fields_ok"] and record["utf8_ok"] and record["distinct"]:
                same = (
                    encode_chat(tokenizer, row["prompt"], row["chosen"], config.max_length).input_ids
                    == encode_chat(tokenizer, row["prompt"], row["rejected"], config.max_length).input_ids
                )
            record["differs_after_truncation"] = not same
            record["role_marker"] = record["chosen_role_marker"] or record["rejected_role_marker"]
            key = (_normalized(prompt), _normalized(texts["chosen"]), _normalized(texts["rejected"]))
        else:
            key = (_normalized(prompt),)
        record["key"] = _safe("\x1f".join(key))
        records.append(record)
    frame = pd.DataFrame.from_records(records)
    frame["is_duplicate"] = frame["key"].duplicated(keep="first") if "key" in frame else False
    return frame


def _rules(kind: str, config: ValidationConfig) -> list[tuple[str, Any]]:
    """(rule name, expectation) pairs of the suite for a kind of split."""
    E = gx.expectations
    if kind == "ptx":
        rules = [
            ("fields", E.ExpectColumnValuesToBeInSet(column="fields_ok", value_set=[True])),
            ("utf8", E.ExpectColumnValuesToBeInSet(column="utf8_ok", value_set=[True])),
            ("empty_content", E.ExpectColumnValuesToBeInSet(column="contents_nonempty", value_set=[True])),
            ("duplicate", E.ExpectColumnValuesToBeInSet(column="is_duplicate", value_set=[False])),
            (
                "ptx_tokens",
                E.ExpectColumnValuesToBeBetween(column="ptx_tokens", min_value=1, max_value=config.max_ptx_tokens),
            ),
        ]
        if config.role_markers == "quarantine":
            rules.append(
                ("role_marker_in_content", E.ExpectColumnValuesToBeInSet(column="role_marker", value_set=[False]))
            )
        return rules
    rules = [
        ("fields", E.ExpectColumnValuesToBeInSet(column="fields_ok", value_set=[True])),
        ("utf8", E.ExpectColumnValuesToBeInSet(column="utf8_ok", value_set=[True])),
        ("empty_prompt", E.ExpectColumnValuesToMatchRegex(column="prompt", regex=r"\S")),
        ("duplicate", E.ExpectColumnValuesToBeInSet(column="is_duplicate", value_set=[False])),
        (
            "prompt_tokens",
            E.ExpectColumnValuesToBeBetween(column="prompt_tokens", min_value=1, max_value=config.max_prompt_tokens),
        ),
    ]
    if kind == "pairs":
        rules += [
            ("empty_chosen", E.ExpectColumnValuesToMatchRegex(column="chosen", regex=r"\S")),
            ("empty_rejected", E.ExpectColumnValuesToMatchRegex(column="rejected", regex=r"\S")),
            (
                "chosen_tokens",
                E.ExpectColumnValuesToBeBetween(
                    column="chosen_tokens", min_value=1, max_value=config.max_response_tokens
                ),
            ),
            (
                "rejected_tokens",
                E.ExpectColumnValuesToBeBetween(
                    column="rejected_tokens", min_value=1, max_value=config.max_response_tokens
                ),
            ),
            ("identical_responses", E.ExpectColumnValuesToBeInSet(column="distinct", value_set=[True])),
            (
                "identical_after_truncation",
                E.ExpectColumnValuesToBeInSet(column="differs_after_truncation", value_set=[True]),
            ),
        ]
        if config.role_markers == "quarantine":
            rules.append(
                ("role_marker_in_response", E.ExpectColumnValuesToBeInSet(column="role_marker", value_set=[False]))
            )
    return rules


def validate_split(
    path: str, rows: list[dict[str, Any]], kind: str, tokenizer: PreTrainedTokenizerBase, config: ValidationConfig
) -> SplitResult:
    """Run the suite on one split; quarantine the rows that break a rule.

    Args:
        path: the file the rows came from (named in messages).
        rows: its rows, in file order (row numbers are 1-based lines).
        kind: one of :data:`KINDS`.
        tokenizer: the base tokenizer.
        config: :class:`ValidationConfig`.

    Returns:
        :class:`SplitResult`; ``errors`` is non-empty when the split is empty or
        its quarantined share exceeds ``max_quarantine_fraction`` (one line per broken rule).

    Raises:
        ValueError: an unknown ``role_markers`` setting or kind.
    """
    if config.role_markers not in ("quarantine", "keep"):
        raise ValueError(f"validate.role_markers must be quarantine or keep, got {config.role_markers!r}")
    if kind not in KINDS:
        raise ValueError(f"unknown split kind {kind!r}")
    if not rows:
        return SplitResult(
            [],
            [],
            {},
            0,
            [
                f"{path}: the split is empty (an empty input is an error, not a pass; "
                "check the source's size and data.fractions)"
            ],
        )
    frame = derive_columns(rows, kind, tokenizer, config)
    context = gx.get_context(mode="ephemeral")
    batch = (
        context.data_sources.add_pandas("rlhf")
        .add_dataframe_asset(kind)
        .add_batch_definition_whole_dataframe("all")
        .get_batch(batch_parameters={"dataframe": frame})
    )
    suite = gx.ExpectationSuite(name=f"preference_{kind}")
    rules = _rules(kind, config)
    for name, expectation in rules:
        expectation.meta = {"rule": name}
        suite.add_expectation(expectation)
    result = batch.validate(suite, result_format={"result_format": "COMPLETE"})
    reasons: dict[int, list[str]] = {}
    counts: dict[str, int] = {}
    first_failure: dict[str, tuple[int, Any]] = {}
    for outcome in result.results:
        rule = outcome.expectation_config.meta["rule"]
        indices = outcome.result.get("unexpected_index_list") or []
        values = outcome.result.get("unexpected_list") or []
        counts[rule] = len(indices)
        for position, index in enumerate(indices):
            reasons.setdefault(int(index), []).append(rule)
            if position == 0:
                first_failure[rule] = (
                    int(index) + 1,
                    _shown_value(frame, rule, int(index), values[0] if values else None),
                )
    valid = [row for i, row in enumerate(rows) if i not in reasons]
    quarantined = [{"file": path, "line": i + 1, "reasons": reasons[i], "row": rows[i]} for i in sorted(reasons)]
    if len(valid) + len(quarantined) != len(rows):
        raise RuntimeError(f"{path}: {len(valid)} valid + {len(quarantined)} quarantined != {len(rows)} rows in")
    errors = []
    share = len(quarantined) / len(rows)
    if share > config.max_quarantine_fraction:
        for rule, (line, value) in sorted(first_failure.items()):
            shown = repr(value)[:80]
            errors.append(
                f"{path}: row {line}: rule {rule}: value {shown} ({counts[rule]} rows; "
                f"{share:.1%} of rows quarantined > {config.max_quarantine_fraction:.1%})"
            )
    marker_rows = int(frame["role_marker"].sum()) if "role_marker" in frame else 0
    return SplitResult(valid, quarantined, counts, marker_rows, errors, result.to_json_dict())


def _shown_value(frame: pd.DataFrame, rule: str, index: int, value: Any) -> Any:
    """The text a person needs to see for a broken rule (the response or prompt, not the derived flag)."""
    if rule == "role_marker_in_response":
        return frame.at[index, "chosen" if frame.at[index, "chosen_role_marker"] else "rejected"]
    if "marker_content" in frame:  # a ptx split
        column = {"role_marker_in_content": "marker_content", "empty_content": "text", "duplicate": "text"}.get(rule)
        return frame.at[index, column] if column else value
    column = {"duplicate": "prompt", "identical_responses": "chosen", "identical_after_truncation": "chosen"}.get(rule)
    return frame.at[index, column] if column else value


def split_kind(split: str) -> str:
    """The kind (:data:`KINDS`) of a split name: ``"pairs"``, ``"prompts"`` or ``"ptx"``.

    Raises:
        ValueError: unknown split.
    """
    for names, kind in ((PAIR_SPLITS, "pairs"), (PROMPT_SPLITS, "prompts"), (PTX_SPLITS, "ptx")):
        if split in names:
            return kind
    raise ValueError(f"unknown split {split!r}")
