"""Raw preference rows in any supported format -> preference examples of chat messages.

Formats (README "Input data"): ``hh`` (whole HH-RLHF dialogue strings),
``pairs`` (prompt/chosen/rejected), ``conversational`` (chosen/rejected message
lists) and ``ranking`` (K ranked responses). An example is ``{"prompt",
"chosen", "rejected"}``, each a list of ``{"role", "content"}`` messages; the
prompt ends with a user turn.
"""

from __future__ import annotations

import re
from typing import Any

Message = dict[str, str]

_HH_TURN = re.compile(r"\n\n(Human|Assistant):[ ]?")
_HH_ROLES = {"Human": "user", "Assistant": "assistant"}


class RowError(ValueError):
    """A row that cannot become a preference example or a ptx row; the message is the quarantine reason."""


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


def as_messages(value: Any, field: str, conversation: bool = False) -> list[Message]:
    """A field as a list of ``{"role", "content"}`` messages (roles system/user/assistant, string content).

    A string (allowed unless ``conversation``) becomes one user message for the
    ``prompt`` field, one assistant message otherwise.

    Raises:
        RowError: anything else; the message names the field.
    """
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
    prompt = as_messages(prompt_value, "prompt")
    if not prompt or prompt[-1]["role"] != "user":
        raise RowError("prompt does not end with a user turn")
    prompt, chosen, rejected = split_pair(
        prompt + as_messages(chosen_value, "chosen"), prompt + as_messages(rejected_value, "rejected")
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
                as_messages(row["chosen"], "chosen", conversation=True),
                as_messages(row["rejected"], "rejected", conversation=True),
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
