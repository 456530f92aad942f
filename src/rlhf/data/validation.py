"""The preference-data suite: Great Expectations rules over the processed splits, with quarantine.

Each rule is one expectation over a column derived from the rows (text,
flags, token lengths). Split kinds: ``pairs`` (prompt/chosen/rejected),
``prompts`` and ``ptx`` (PPO-ptx rows, ``{"messages"}`` or ``{"text"}``, whose
rules read each message's content, never the chat template's own markers).
A row that breaks any rule is quarantined with the names of the rules it
broke; the rest is valid. Rows in = valid rows + quarantined rows, always.
Control tokens (``<|im_end|>``, ``<|endoftext|>``, ``<file_sep>``, ...) are read
twice: as text written in a content (``control_token_in_content``, a setting) and
as ids in the token sequence the model will see (``control_token_id``, always:
the sequence must hold exactly the special ids the chat template writes). The
split fails when it is empty or when the share of quarantined rows exceeds
``max_quarantine_fraction``; the failure message has one line per broken rule
(file, row, rule, value).
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import great_expectations as gx
import pandas as pd
from great_expectations.data_context.types.base import ProgressBarsConfig
from transformers import PreTrainedTokenizerBase

from rlhf.data.chat import control_token_ids, control_tokens, encode_chat, encode_prompt, encode_text
from rlhf.data.formats import RowError, visible_text
from rlhf.data.ptx import parse_ptx_row, ptx_token_ids

ROLE_MARKER = re.compile(r"(?:^|\s)(?:Human|Assistant|User|System):")
"""A speaker tag inside a response or a ptx message, at a line start or mid-line ("... Human: what? Assistant: ...")."""
PAIR_SPLITS = ("sft", "rm_train", "rm_eval", "judge_train", "judge_eval")
PROMPT_SPLITS = ("ppo_prompts", "eval_prompts")
PTX_SPLITS = ("ptx_text", "ptx_heldout")
KINDS = ("pairs", "prompts", "ptx")


@dataclass
class ValidationConfig:
    """Suite settings (params.yaml section ``validate``)."""

    max_length: int = 256  # tokens of prompt + response as the reward model reads them (the stage passes its own)
    max_prompt_tokens: int = 2048
    max_response_tokens: int = 1024
    role_markers: str = "quarantine"  # quarantine | keep: "Human:"/"Assistant:" inside a response or ptx content
    control_tokens: str = "quarantine"  # quarantine | keep: a control token's text (<|im_end|>, ...) in any content
    max_ptx_tokens: int = 2048  # tokens of a ptx row as PPO-ptx reads it (chat template or text + EOS)
    max_quarantine_fraction: float = 0.05  # a split with more of its rows quarantined fails the stage


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
    """What duplicates and identical responses are compared by: NFKC, then the visible text."""
    return visible_text(unicodedata.normalize("NFKC", text or ""))


class _ControlTokens:
    """Control tokens of a tokenizer, as text (in a content) and as ids (in an encoded sequence)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.ids = control_token_ids(tokenizer)
        self.pattern = re.compile("|".join(map(re.escape, control_tokens(tokenizer))) or "(?!)")
        self.tokenizer = tokenizer
        self._expected: dict[tuple, Counter] = {}

    def in_text(self, texts: list[str | None]) -> str | None:
        """The first text that holds a control token's text, or None."""
        return next((t for t in texts if t and self.pattern.search(t)), None)

    def counts(self, ids: list[int]) -> Counter:
        return Counter(i for i in ids if i in self.ids)

    def expected(self, mode: str, roles: tuple[str, ...], response_roles: tuple[str, ...] = ()) -> Counter:
        """The control ids of the same turns with neutral contents (they depend only on the roles):
        ``mode`` is ``"prompt"`` (:func:`encode_prompt`), ``"chat"`` (:func:`encode_chat`, prompt and
        response roles), ``"ptx"`` (:func:`ptx_token_ids` of messages) or ``"text"`` (a ptx text row)."""
        key = (mode, roles, response_roles)
        if key not in self._expected:
            blank = [{"role": role, "content": "x"} for role in roles]
            if mode == "prompt":
                ids = encode_prompt(self.tokenizer, blank, 10**9)
            elif mode == "chat":
                response = [{"role": role, "content": "x"} for role in response_roles]
                ids = encode_chat(self.tokenizer, blank, response, 10**9).input_ids
            else:
                ids = ptx_token_ids(self.tokenizer, {"messages": blank} if mode == "ptx" else {"text": "x"}, 10**9)
            self._expected[key] = self.counts(ids)
        return self._expected[key]


def _ptx_record(row: Any, index: int, tokenizer: PreTrainedTokenizerBase, control: _ControlTokens) -> dict[str, Any]:
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
    answer = _pair_answer(row, messages)
    if marker is None and len(answer) > 1:  # the pairs' rule: an answer of several turns held a speaker tag
        marker = "\n\n".join(f"{m['role']}: {m['content']}" for m in answer)
    control_text = control.in_text(contents)
    ptx_ids: list[int] = []
    control_ids_ok = True
    if parsed is not None and utf8:
        ptx_ids = ptx_token_ids(tokenizer, row, 10**9)
        mode = "ptx" if "messages" in parsed else "text"
        control_ids_ok = control.counts(ptx_ids) == control.expected(mode, tuple(_roles(messages)))
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
        "contents_nonempty": bool(contents) and all(visible_text(c) for c in contents),
        "role_marker": marker is not None,
        "marker_content": _safe(marker),
        "control_text": control_text is not None,
        "control_content": _safe(control_text),
        "control_ids_ok": control_ids_ok,
        "ptx_tokens": len(ptx_ids),
        "key": _safe(key),
    }


def _pair_answer(row: Any, messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The chosen answer's turns of a ptx row made from a pair (its ``response_start``), [] for other rows."""
    start = row.get("response_start") if isinstance(row, dict) else None
    return messages[start:] if isinstance(start, int) and not isinstance(start, bool) and start >= 0 else []


def _roles(messages: Any) -> list[str]:
    return [m.get("role") for m in messages] if isinstance(messages, list) else []


def derive_columns(
    rows: list[dict[str, Any]], kind: str, tokenizer: PreTrainedTokenizerBase, config: ValidationConfig
) -> pd.DataFrame:
    """The columns the expectations read, one row per input row.

    Args:
        rows: the split's rows.
        kind: one of :data:`KINDS`.
        tokenizer: the base tokenizer (token lengths, truncation, control-token ids).
        config: :class:`ValidationConfig`.
    """
    control = _ControlTokens(tokenizer)
    records = []
    for row in rows:
        if kind == "ptx":
            records.append(_ptx_record(row, len(records), tokenizer, control))
            continue
        prompt = _text(row.get("prompt"))
        record = {"prompt": _safe(prompt), "prompt_visible": _safe(visible_text(prompt or "")), "prompt_tokens": 0}
        responses = ("chosen", "rejected") if kind == "pairs" else ()
        texts = {name: _text(row.get(name)) for name in responses}
        record["fields_ok"] = (
            prompt is not None
            and isinstance(row.get("prompt"), list)
            and all(t is not None and isinstance(row.get(n), list) for n, t in texts.items())
        )
        record["utf8_ok"] = all(_utf8(t) for t in [prompt, *texts.values()])
        encodable = record["fields_ok"] and record["utf8_ok"]
        roles = {name: tuple(_roles(row.get(name))) for name in ("prompt", *responses)}
        record["prompt_last_turn_ok"] = not encodable or roles["prompt"][-1:] == ("user",)
        record["response_first_turn_ok"] = not encodable or all(roles[n][:1] == ("assistant",) for n in responses)
        record["response_last_turn_ok"] = not encodable or all(roles[n][-1:] == ("assistant",) for n in responses)
        record["roles"] = "; ".join(f"{name}: {', '.join(map(str, roles[name]))}" for name in ("prompt", *responses))
        contents = (
            [m.get("content") for name in ("prompt", *responses) for m in row.get(name) or []] if encodable else []
        )
        control_text = control.in_text(contents)
        record["control_text"], record["control_content"] = control_text is not None, _safe(control_text)
        record["control_ids_ok"] = True
        if encodable:
            prompt_ids = encode_prompt(tokenizer, row["prompt"], 10**9)
            record["prompt_tokens"] = len(prompt_ids)
            record["control_ids_ok"] = control.counts(prompt_ids) == control.expected("prompt", roles["prompt"])
        encoded = {}
        for name, text in texts.items():
            record[name], record[f"{name}_visible"] = _safe(text), _safe(visible_text(text or ""))
            record[f"{name}_tokens"] = len(encode_text(tokenizer, text)) if text and record["utf8_ok"] else 0
            # a speaker tag in the text, or an answer of several turns: HH's "\n\nHuman:" or "\n\nAssistant:"
            # written inside an answer parses as another turn, and is the same rule broken (a response that starts
            # or ends with a turn not the assistant's breaks response_first_turn or response_last_turn instead)
            turns = roles[name]
            several = len(turns) > 1 and turns[0] == turns[-1] == "assistant"
            record[f"{name}_role_marker"] = bool(ROLE_MARKER.search(text or "")) or several
            if encodable:
                encoded[name] = encode_chat(tokenizer, row["prompt"], row[name], 10**9).input_ids
                expected = control.expected("chat", roles["prompt"], roles[name])
                record["control_ids_ok"] &= control.counts(encoded[name]) == expected
        if kind == "pairs":
            record["distinct"] = _normalized(texts["chosen"]) != _normalized(texts["rejected"])
            same = (
                encodable
                and record["distinct"]
                and encoded["chosen"][-config.max_length :] == encoded["rejected"][-config.max_length :]
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
        return rules + _control_rules(config)
    rules = [
        ("fields", E.ExpectColumnValuesToBeInSet(column="fields_ok", value_set=[True])),
        ("utf8", E.ExpectColumnValuesToBeInSet(column="utf8_ok", value_set=[True])),
        ("empty_prompt", E.ExpectColumnValuesToMatchRegex(column="prompt_visible", regex=r"\S")),
        ("duplicate", E.ExpectColumnValuesToBeInSet(column="is_duplicate", value_set=[False])),
        (
            "prompt_tokens",
            E.ExpectColumnValuesToBeBetween(column="prompt_tokens", min_value=1, max_value=config.max_prompt_tokens),
        ),
        ("prompt_last_turn", E.ExpectColumnValuesToBeInSet(column="prompt_last_turn_ok", value_set=[True])),
        *_control_rules(config),
    ]
    if kind == "pairs":
        rules += [
            ("empty_chosen", E.ExpectColumnValuesToMatchRegex(column="chosen_visible", regex=r"\S")),
            ("empty_rejected", E.ExpectColumnValuesToMatchRegex(column="rejected_visible", regex=r"\S")),
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
                "response_first_turn",
                E.ExpectColumnValuesToBeInSet(column="response_first_turn_ok", value_set=[True]),
            ),
            ("response_last_turn", E.ExpectColumnValuesToBeInSet(column="response_last_turn_ok", value_set=[True])),
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


def _control_rules(config: ValidationConfig) -> list[tuple[str, Any]]:
    """The control-token rules of every kind: ids always, the text in a content unless ``control_tokens: keep``."""
    E = gx.expectations
    rules = [("control_token_id", E.ExpectColumnValuesToBeInSet(column="control_ids_ok", value_set=[True]))]
    if config.control_tokens == "quarantine":
        rules.append(
            ("control_token_in_content", E.ExpectColumnValuesToBeInSet(column="control_text", value_set=[False]))
        )
    return rules


EMPTY_HINT = "check the source's size and data.fractions"
"""What the error for an empty split tells the user to check, unless the caller knows more."""


def validate_split(
    path: str,
    rows: list[dict[str, Any]],
    kind: str,
    tokenizer: PreTrainedTokenizerBase,
    config: ValidationConfig,
    may_be_empty: bool = False,
    empty_hint: str = EMPTY_HINT,
) -> SplitResult:
    """Run the suite on one split; quarantine the rows that break a rule.

    Args:
        path: the file the rows came from (named in messages).
        rows: its rows, in file order (row numbers are 1-based lines).
        kind: one of :data:`KINDS`.
        tokenizer: the base tokenizer.
        config: :class:`ValidationConfig`.
        may_be_empty: no stage reads this split (``sft`` when ``sft.steps`` is 0), so no rows is no error.
        empty_hint: what the error for an empty split tells the user to check.

    Returns:
        :class:`SplitResult`; ``errors`` is non-empty when the split is empty (unless ``may_be_empty``) or
        its quarantined share exceeds ``max_quarantine_fraction`` (one line per broken rule).

    Raises:
        ValueError: an unknown ``role_markers`` or ``control_tokens`` setting, or kind.
    """
    for setting in ("role_markers", "control_tokens"):
        if getattr(config, setting) not in ("quarantine", "keep"):
            raise ValueError(f"validate.{setting} must be quarantine or keep, got {getattr(config, setting)!r}")
    if kind not in KINDS:
        raise ValueError(f"unknown split kind {kind!r}")
    if not rows:
        empty = f"{path}: the split is empty (an empty input is an error, not a pass; {empty_hint})"
        return SplitResult([], [], {}, 0, [] if may_be_empty else [empty])
    frame = derive_columns(rows, kind, tokenizer, config)
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)  # 4 bars a split, several times each
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
    if rule in ("control_token_in_content", "control_token_id"):
        return frame.at[index, "control_content"] or frame.at[index, "text" if "text" in frame else "prompt"]
    if rule in ("prompt_last_turn", "response_first_turn", "response_last_turn"):
        return frame.at[index, "roles"]
    if "marker_content" in frame:  # a ptx split
        column = {"role_marker_in_content": "marker_content", "empty_content": "text", "duplicate": "text"}.get(rule)
        return frame.at[index, column] if column else value
    column = {
        "duplicate": "prompt",
        "identical_responses": "chosen",
        "identical_after_truncation": "chosen",
        "empty_prompt": "prompt",  # the text as written (its invisible characters show in repr), not its visible part
        "empty_chosen": "chosen",
        "empty_rejected": "rejected",
    }.get(rule)
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
