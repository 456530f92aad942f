"""Preference data: reading rows from any fsspec path, parsing them into chat messages, splitting.

A preference example is ``{"id", "source", "prompt", "chosen", "rejected"}`` where
``prompt``, ``chosen`` and ``rejected`` are lists of ``{"role", "content"}``
messages (the conversational format of transformers' chat templates). The
prompt ends with a user turn; each response is what follows it (usually one
assistant message).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec

Message = dict[str, str]

SPLITS = ("sft", "rm_train", "rm_eval", "ppo_prompts", "ptx_text", "eval_prompts")

_HH_TURN = re.compile(r"\n\n(Human|Assistant):[ ]?")
_HH_ROLES = {"Human": "user", "Assistant": "assistant"}


class RowError(ValueError):
    """A row that cannot become a preference example; the message is the quarantine reason."""


def read_jsonl(path: str, storage_options: dict[str, Any] | None = None) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_number, parsed_json_or_RowError)`` for each non-blank line of a jsonl[.gz] file.

    Args:
        path: any fsspec path or URL (local, ``s3://``, ``hf://datasets/...``, ``https://``);
            a ``.gz`` suffix means gzip.
        storage_options: passed to ``fsspec.open``.

    Yields:
        1-based line number and the parsed object, or a ``RowError`` naming the
        JSON or UTF-8 problem (the caller quarantines it).

    Raises:
        FileNotFoundError: the path does not exist.
    """
    compression = "gzip" if path.endswith(".gz") else None
    with fsspec.open(path, "rb", compression=compression, **(storage_options or {})) as raw:
        for number, line in enumerate(raw, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as err:
                yield number, RowError(f"invalid UTF-8: {err.reason} at byte {err.start}")
            except json.JSONDecodeError as err:
                yield number, RowError(f"invalid JSON: {err.msg}")


def parse_hh_dialogue(text: str) -> list[Message]:
    """Parse an HH-RLHF dialogue string ``"\\n\\nHuman: ...\\n\\nAssistant: ..."`` into messages.

    Two turns of the same role in a row stay two messages (they are merged
    into one response by :func:`split_pair`, never cut apart).

    Args:
        text: a whole dialogue.

    Returns:
        List of ``{"role": "user" | "assistant", "content": str}``.

    Raises:
        RowError: the text is not a string or does not start with a Human turn.
    """
    if not isinstance(text, str):
        raise RowError(f"dialogue is {type(text).__name__}, not a string")
    parts = _HH_TURN.split(text)
    if parts[0].strip() or len(parts) < 3:
        raise RowError("dialogue does not start with '\\n\\nHuman:'")
    messages = [{"role": _HH_ROLES[role], "content": content.strip()} for role, content in zip(parts[1::2], parts[2::2])]
    if messages[0]["role"] != "user":
        raise RowError("dialogue does not start with a Human turn")
    return messages


def split_pair(chosen: list[Message], rejected: list[Message]) -> tuple[list[Message], list[Message], list[Message]]:
    """Split two dialogues at their longest common prefix into (prompt, chosen response, rejected response).

    The prompt is the shared messages up to and including the user turn before
    the first assistant turn that differs; each response is everything after
    it (several assistant turns in a row stay one response).

    Args:
        chosen: messages of the preferred dialogue.
        rejected: messages of the dispreferred dialogue.

    Returns:
        ``(prompt, chosen_response, rejected_response)``, lists of messages.

    Raises:
        RowError: no shared user turn, a response is empty, or both responses are identical.
    """
    common = 0
    while common < min(len(chosen), len(rejected)) and chosen[common] == rejected[common]:
        common += 1
    cut = common
    while cut > 0 and chosen[cut - 1]["role"] != "user":
        cut -= 1
    if cut == 0:
        raise RowError("the dialogues share no user turn")
    prompt, chosen_response, rejected_response = chosen[:cut], chosen[cut:], rejected[cut:]
    if chosen_response == rejected_response:
        raise RowError("chosen and rejected responses are identical")
    for name, response in (("chosen", chosen_response), ("rejected", rejected_response)):
        if not any(m["content"].strip() for m in response if m["role"] == "assistant"):
            raise RowError(f"{name} response is empty")
    return prompt, chosen_response, rejected_response


def _messages(value: Any, field: str) -> list[Message]:
    if isinstance(value, str):
        return [{"role": "user" if field == "prompt" else "assistant", "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in ("system", "user", "assistant") for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise RowError(f"field '{field}' is neither a string nor a list of {{role, content}} messages")


def detect_format(row: Any) -> str:
    """Name the format of a raw row: ``"hh"`` (whole dialogues in chosen/rejected) or ``"pairs"`` (prompt/chosen/rejected).

    Raises:
        RowError: the row is not an object with the keys of a known format.
    """
    if not isinstance(row, dict):
        raise RowError(f"row is {type(row).__name__}, not a JSON object")
    if {"prompt", "chosen", "rejected"} <= row.keys():
        return "pairs"
    if {"chosen", "rejected"} <= row.keys():
        return "hh"
    raise RowError(f"row has keys {sorted(row)}; expected chosen/rejected or prompt/chosen/rejected")


def to_example(row: Any, fmt: str = "auto") -> dict[str, list[Message]]:
    """Turn one raw row into ``{"prompt", "chosen", "rejected"}`` message lists.

    Args:
        row: a parsed JSON row.
        fmt: ``"auto"``, ``"hh"`` or ``"pairs"``.

    Raises:
        RowError: the row does not parse; the message says why.
    """
    if isinstance(row, RowError):
        raise row
    fmt = detect_format(row) if fmt == "auto" else fmt
    if fmt == "hh":
        prompt, chosen, rejected = split_pair(parse_hh_dialogue(row["chosen"]), parse_hh_dialogue(row["rejected"]))
    elif fmt == "pairs":
        prompt = _messages(row["prompt"], "prompt")
        if prompt[-1]["role"] != "user":
            raise RowError("prompt does not end with a user turn")
        chosen, rejected = _messages(row["chosen"], "chosen"), _messages(row["rejected"], "rejected")
        _, chosen, rejected = split_pair(prompt + chosen, prompt + rejected)
    else:
        raise ValueError(f"unknown data format {fmt!r}; expected auto, hh or pairs")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def prompt_key(prompt: list[Message]) -> str:
    """Stable hex sha256 of a prompt's messages; the id of the prompt."""
    return hashlib.sha256(json.dumps(prompt, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def assign_split(prompt: list[Message], fractions: dict[str, float]) -> str:
    """Pick the split of a prompt from a hash of it, so one prompt never lands in two splits.

    Args:
        prompt: the prompt's messages.
        fractions: split name -> fraction, in order; fractions must sum to 1.

    Returns:
        The split name.

    Raises:
        ValueError: the fractions are negative or do not sum to 1 (1e-6).
    """
    if any(f < 0 for f in fractions.values()) or abs(sum(fractions.values()) - 1.0) > 1e-6:
        raise ValueError(f"split fractions must be >= 0 and sum to 1, got {fractions}")
    point = int(prompt_key(prompt)[:15], 16) / 16**15
    edge = 0.0
    for name, fraction in fractions.items():
        edge += fraction
        if point < edge:
            return name
    return name


def dialogue_text(messages: list[Message]) -> str:
    """Plain text of a dialogue (``"Human: ...\\n\\nAssistant: ..."``), used as PPO-ptx language-model text."""
    names = {"user": "Human", "assistant": "Assistant", "system": "System"}
    return "\n\n".join(f"{names[m['role']]}: {m['content']}" for m in messages)


@dataclass
class PreparedData:
    """The result of :func:`prepare_rows`: rows by split and quarantined rows."""

    splits: dict[str, list[dict[str, Any]]]
    quarantine: list[dict[str, Any]]
    rows_in: int


def prepare_rows(rows: Iterator[tuple[int, Any]], source: str, fractions: dict[str, float], fmt: str = "auto") -> PreparedData:
    """Parse raw rows, quarantine the unparseable ones and split the rest by prompt hash.

    Output rows: ``sft``, ``rm_train``, ``rm_eval`` hold whole pairs
    ``{"id", "source", "prompt", "chosen", "rejected"}``; ``ppo_prompts`` and
    ``eval_prompts`` hold ``{"id", "source", "prompt"}`` (one row per distinct
    prompt); ``ptx_text`` holds ``{"id", "source", "text"}`` (the chosen dialogue
    as plain text). Quarantine rows are ``{"source", "line", "reason", "row"}``.

    Args:
        rows: ``(line_number, row)`` pairs, e.g. from :func:`read_jsonl`.
        source: the path the rows came from (kept in each row).
        fractions: split fractions (see :func:`assign_split`).
        fmt: see :func:`to_example`.
    """
    splits: dict[str, list[dict[str, Any]]] = {name: [] for name in SPLITS}
    quarantine: list[dict[str, Any]] = []
    seen_prompts: set[tuple[str, str]] = set()
    rows_in = 0
    for line, row in rows:
        rows_in += 1
        try:
            example = to_example(row, fmt)
        except RowError as err:
            quarantine.append({"source": source, "line": line, "reason": str(err), "row": None if isinstance(row, RowError) else row})
            continue
        key = prompt_key(example["prompt"])
        split = assign_split(example["prompt"], fractions)
        record = {"id": f"{key[:16]}-{line}", "source": source}
        if split in ("ppo_prompts", "eval_prompts"):
            if (split, key) in seen_prompts:
                continue
            seen_prompts.add((split, key))
            splits[split].append({**record, "id": key[:16], "prompt": example["prompt"]})
        elif split == "ptx_text":
            splits[split].append({**record, "text": dialogue_text(example["prompt"] + example["chosen"])})
        else:
            splits[split].append({**record, **example})
    return PreparedData(splits=splits, quarantine=quarantine, rows_in=rows_in)


def write_jsonl(rows: list[dict[str, Any]], handle: io.TextIOBase) -> None:
    """Write rows as one JSON object a line (UTF-8, not ASCII-escaped)."""
    for row in rows:
        handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def load_jsonl(path: str) -> list[dict[str, Any]]:
    """Read a local jsonl file written by :func:`write_jsonl`.

    Raises:
        ValueError: a line is not valid JSON (names the file and line).
    """
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number}: invalid JSON: {err.msg}") from err
    return rows

