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
    messages = [
        {"role": _HH_ROLES[role], "content": content.strip()}
        for role, content in zip(parts[1::2], parts[2::2], strict=True)
    ]
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


def _messages(value: Any, field: str, conversation: bool = False) -> list[Message]:
    if isinstance(value, str) and not conversation:
        return [{"role": "user" if field == "prompt" else "assistant", "content": value}]
    if isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in ("system", "user", "assistant")
        for m in value
    ):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise RowError(
        f"field '{field}' is not {'a list' if conversation else 'a string or a list'} "
        "of {role, content} messages with string content"
    )


FORMATS = ("auto", "hh", "pairs", "conversational", "ranking")


def detect_format(row: Any) -> str:
    """Name the format of a raw row.

    - ``"hh"``: ``chosen``/``rejected`` hold whole dialogue strings (``"\\n\\nHuman: ..."``).
    - ``"conversational"``: ``chosen``/``rejected`` hold whole conversations as
      ``{"role", "content"}`` lists (no ``prompt``; the prompt is the shared prefix).
    - ``"pairs"``: ``prompt``/``chosen``/``rejected``, each a string or a message list.
    - ``"ranking"``: ``prompt`` and ``responses`` (K responses), with optional
      ``ranks`` (lower is better, equal ranks are ties); without ``ranks`` the
      responses are ordered best first.

    Raises:
        RowError: the row is not an object with the keys of a known format.
    """
    if not isinstance(row, dict):
        raise RowError(f"row is {type(row).__name__}, not a JSON object")
    if {"prompt", "responses"} <= row.keys():
        return "ranking"
    if {"prompt", "chosen", "rejected"} <= row.keys():
        return "pairs"
    if {"chosen", "rejected"} <= row.keys():
        return "conversational" if isinstance(row["chosen"], list) else "hh"
    raise RowError(f"row has keys {sorted(row)}; expected chosen/rejected, prompt/chosen/rejected or prompt/responses")


def expand_ranking(responses: list[Any], ranks: list[Any] | None) -> list[tuple[Any, Any]]:
    """All ``(better, worse)`` pairs of K ranked responses: K(K-1)/2, minus one per tied pair (InstructGPT).

    Args:
        responses: K responses.
        ranks: K numbers, lower is better; None means the responses are ordered best first.

    Raises:
        RowError: ``ranks`` is not a list of K numbers, or fewer than two responses.
    """
    if not isinstance(responses, list) or len(responses) < 2:
        raise RowError("field 'responses' must be a list of at least 2 responses")
    ranks = list(range(len(responses))) if ranks is None else ranks
    if (
        not isinstance(ranks, list)
        or len(ranks) != len(responses)
        or not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in ranks)
    ):
        raise RowError(f"field 'ranks' must be a list of {len(responses)} numbers")
    pairs = []
    for i in range(len(responses)):
        for j in range(i + 1, len(responses)):
            if ranks[i] != ranks[j]:
                better, worse = (i, j) if ranks[i] < ranks[j] else (j, i)
                pairs.append((responses[better], responses[worse]))
    return pairs


def _pair_from_prompt(prompt_value: Any, chosen_value: Any, rejected_value: Any) -> dict[str, list[Message]]:
    prompt = _messages(prompt_value, "prompt")
    if not prompt or prompt[-1]["role"] != "user":
        raise RowError("prompt does not end with a user turn")
    prompt, chosen, rejected = split_pair(
        prompt + _messages(chosen_value, "chosen"), prompt + _messages(rejected_value, "rejected")
    )
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def to_examples(row: Any, fmt: str = "auto", mapping: dict[str, str] | None = None) -> list[dict[str, list[Message]]]:
    """Turn one raw row into preference examples ``{"prompt", "chosen", "rejected"}`` (message lists).

    A ranking row gives one example per ordered pair; every other format gives one.

    Args:
        row: a parsed JSON row.
        fmt: one of :data:`FORMATS`.
        mapping: renames the row's keys first (``{"question": "prompt", ...}``).

    Raises:
        RowError: the row does not parse; the message says why.
        ValueError: an unknown format name.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown data format {fmt!r}; expected one of {FORMATS}")
    if isinstance(row, RowError):
        raise row
    if mapping and isinstance(row, dict):
        row = {mapping.get(key, key): value for key, value in row.items()}
    fmt = detect_format(row) if fmt == "auto" else fmt
    try:
        if fmt == "hh":
            prompt, chosen, rejected = split_pair(parse_hh_dialogue(row["chosen"]), parse_hh_dialogue(row["rejected"]))
            return [{"prompt": prompt, "chosen": chosen, "rejected": rejected}]
        if fmt == "conversational":
            prompt, chosen, rejected = split_pair(
                _messages(row["chosen"], "chosen", conversation=True),
                _messages(row["rejected"], "rejected", conversation=True),
            )
            return [{"prompt": prompt, "chosen": chosen, "rejected": rejected}]
        if fmt == "pairs":
            return [_pair_from_prompt(row["prompt"], row["chosen"], row["rejected"])]
        examples, reasons = [], []
        for better, worse in expand_ranking(row["responses"], row.get("ranks")):
            try:
                examples.append(_pair_from_prompt(row["prompt"], better, worse))
            except RowError as err:
                reasons.append(str(err))
        if not examples:
            raise RowError(f"ranking gives no usable pair ({reasons[0] if reasons else 'all responses tie'})")
        return examples
    except (KeyError, TypeError) as err:
        raise RowError(f"row does not fit format {fmt!r}: missing or wrong field {err}") from err


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


@dataclass
class Source:
    """One input of the prepare stage: where it is, its rows, their format and key mapping."""

    path: str
    rows: Iterator[tuple[int, Any]]
    format: str = "auto"
    mapping: dict[str, str] | None = None


def prepare_rows(sources: list[Source], fractions: dict[str, float]) -> PreparedData:
    """Parse raw rows of one or more sources, quarantine the unparseable ones and split the rest by prompt hash.

    Output rows: ``sft``, ``rm_train``, ``rm_eval`` hold whole pairs
    ``{"id", "source", "prompt", "chosen", "rejected"}``; ``ppo_prompts`` and
    ``eval_prompts`` hold ``{"id", "source", "prompt"}`` (one row per distinct
    prompt); ``ptx_text`` holds ``{"id", "source", "text"}`` (the chosen dialogue
    as plain text). Quarantine rows are ``{"source", "line", "reason", "row"}``.
    Each row keeps the path of its source.

    Args:
        sources: the inputs, concatenated in order.
        fractions: split fractions (see :func:`assign_split`).
    """
    splits: dict[str, list[dict[str, Any]]] = {name: [] for name in SPLITS}
    quarantine: list[dict[str, Any]] = []
    seen_prompts: set[tuple[str, str]] = set()
    rows_in = 0
    for source, line, row in ((src, line, row) for src in sources for line, row in src.rows):
        rows_in += 1
        try:
            examples = to_examples(row, source.format, source.mapping)
        except RowError as err:
            quarantine.append(
                {
                    "source": source.path,
                    "line": line,
                    "reason": str(err),
                    "row": None if isinstance(row, RowError) else row,
                }
            )
            continue
        for number, example in enumerate(examples):
            key = prompt_key(example["prompt"])
            split = assign_split(example["prompt"], fractions)
            record = {"id": f"{key[:16]}-{line}" + (f"-{number}" if len(examples) > 1 else ""), "source": source.path}
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
