"""Raw preference rows in any supported format -> preference examples of chat messages.

Formats (docs/data.md "Input data"): ``hh`` (whole HH-RLHF dialogue strings),
``pairs`` (prompt/chosen/rejected), ``conversational`` (chosen/rejected message
lists) and ``ranking`` (K ranked responses). An example is ``{"prompt",
"chosen", "rejected"}``, each a list of ``{"role", "content"}`` messages; the
prompt ends with a user turn and each response starts and ends with an assistant
turn (docs/data.md "Input data" says what happens to rows that do not).
"""

from __future__ import annotations

import math
import re
import unicodedata
from typing import Any

Message = dict[str, str]

_HH_TURN = re.compile(r"\n\n(Human|Assistant):[ ]?")
_HH_ROLES = {"Human": "user", "Assistant": "assistant"}
_HH_START = re.compile(r"\s*(?:Human|Assistant):")
ECHO_MIN_WORDS = 3
"""A plain-string response that starts with the whole prompt text is read as prompt + response (the
"completion includes the prompt" layout) when the prompt has at least this many words; a shorter prompt is
echoed by ordinary answers ("Hi" -> "Hi there!") and is left alone."""


_INVISIBLE_CATEGORIES = frozenset({"Cf", "Cc", "Cs", "Cn"})
"""Unicode categories that draw nothing: format characters (zero-width space and joiners, word joiner, BOM,
soft hyphen, bidirectional marks, tags), controls, lone surrogates and unassigned code points."""
_INVISIBLE_CHARACTERS = frozenset("\u034f\u115f\u1160\u17b4\u17b5\u3164\uffa0\u2800") | frozenset(
    map(chr, [*range(0xFE00, 0xFE10), *range(0xE0100, 0xE01F0)])
)
"""Letters and marks that draw nothing: the combining grapheme joiner, the Hangul fillers, the Khmer inherent
vowels, the braille blank and the variation selectors."""


def visible_text(text: str) -> str:
    """``text`` as a reader sees it: invisible characters removed, any run of whitespace one space, stripped.

    What counts as an empty response, two identical responses, a whitespace-only difference, a duplicate or
    one conversation reads this, so ``"Yes\u200b"`` is ``"Yes"`` and ``"\u200b"`` is empty; a combining mark with
    no character before it to combine with (``"\u0301\u0301"``, or after a space) is dropped, so marks alone are
    empty too, while ``"e\u0301"`` stays.
    """
    kept = ""
    for ch in text:
        category = unicodedata.category(ch)
        if ch.isspace() or (category not in _INVISIBLE_CATEGORIES and ch not in _INVISIBLE_CHARACTERS):
            if category.startswith("M") and (not kept or kept[-1].isspace()):
                continue  # a combining mark with no letter before it draws nothing readable
            kept += ch
    return " ".join(kept.split())


def visible_turns(messages: list[Message]) -> list[tuple[str, str]]:
    """``(role, visible content)`` of each message (:func:`visible_text`): what two responses are compared by."""
    return [(m["role"], visible_text(m["content"])) for m in messages]


class RowError(ValueError):
    """A row that cannot become a preference example or a ptx row; the message is the quarantine reason."""


def check_prompt_visible(messages: list[Message], field: str = "prompt") -> None:
    """Refuse a prompt with no visible text in any turn (:func:`visible_text`): the data check's ``empty_prompt``
    rule (:mod:`rlhf.data.validation`), for the commands that read prompts and pairs outside the pipeline.

    Raises:
        RowError: ``'prompt' has no visible text``.
    """
    if not any(visible_text(m["content"]) for m in messages):
        raise RowError(f"{field!r} has no visible text")


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


def split_pair(
    chosen: list[Message], rejected: list[Message], hh_markup: bool = False
) -> tuple[list[Message], list[Message], list[Message]]:
    """Split two dialogues at their longest common prefix into (prompt, chosen response, rejected response).

    The prompt is the shared messages up to and including the user turn before
    the first assistant turn that differs; each response is everything after
    it (several assistant turns in a row stay one response), less any trailing
    user or system turns: the reward model reads its score at the end of the
    last turn, so a response must end with an assistant turn (a "thanks" from
    the user after the answer is dropped). With ``hh_markup`` they are kept: an HH
    dialogue ends with the assistant's answer, so a Human turn after it was a
    speaker tag written inside the answer, which validate quarantines
    (``response_last_turn``; one in the middle: ``role_marker_in_response``).

    Args:
        chosen: messages of the preferred dialogue.
        rejected: messages of the dispreferred dialogue.
        hh_markup: both were written in HH markup (:func:`parse_hh_dialogue`).

    Returns:
        ``(prompt, chosen_response, rejected_response)``, lists of messages.

    Raises:
        RowError: no shared user turn, a response that does not start with an
            assistant turn (the dialogues differ before the answer), a response
            that is empty, or both responses are identical.
    """
    common = 0
    while common < min(len(chosen), len(rejected)) and chosen[common] == rejected[common]:
        common += 1
    cut = common
    while cut > 0 and chosen[cut - 1]["role"] != "user":
        cut -= 1
    if cut == 0:
        raise RowError("the dialogues share no user turn")
    trim = (lambda response: response) if hh_markup else _trim_end
    prompt, chosen_response, rejected_response = chosen[:cut], trim(chosen[cut:]), trim(rejected[cut:])
    if visible_turns(chosen_response) == visible_turns(rejected_response):
        raise RowError("chosen and rejected responses are identical")
    for name, response in (("chosen", chosen_response), ("rejected", rejected_response)):
        if response and response[0]["role"] != "assistant":
            raise RowError(
                f"{name} response starts with a {response[0]['role']} turn, not an assistant turn "
                "(the dialogues differ before the answer)"
            )
        if not any(visible_text(m["content"]) for m in response if m["role"] == "assistant"):
            raise RowError(f"{name} response is empty")
    return prompt, chosen_response, rejected_response


def _trim_end(response: list[Message]) -> list[Message]:
    """The response up to its last assistant turn (trailing user or system turns dropped)."""
    last = max((i for i, m in enumerate(response) if m["role"] == "assistant"), default=-1)
    return response[: last + 1]


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
        ranks: K finite numbers, lower is better; None means the responses are ordered best first.

    Raises:
        RowError: ``ranks`` is not a list of K finite numbers (a NaN never equals itself, so it would make
            every pair it is in a preference; JSON's ``NaN`` and ``Infinity`` parse), or fewer than two
            responses.
    """
    if not isinstance(responses, list) or len(responses) < 2:
        raise RowError("field 'responses' must be a list of at least 2 responses")
    ranks = list(range(len(responses))) if ranks is None else ranks
    if not isinstance(ranks, list) or len(ranks) != len(responses) or not all(_finite_number(r) for r in ranks):
        raise RowError(f"field 'ranks' must be a list of {len(responses)} finite numbers")
    pairs = []
    for i in range(len(responses)):
        for j in range(i + 1, len(responses)):
            if ranks[i] != ranks[j]:
                better, worse = (i, j) if ranks[i] < ranks[j] else (j, i)
                pairs.append((responses[better], responses[worse]))
    return pairs


def _finite_number(value: Any) -> bool:
    """A JSON number that ranks: any integer (exact, however many digits: ``math.isfinite`` overflows past 309),
    or a finite float (JSON's ``NaN`` and ``Infinity`` parse); never a boolean."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def _markup_messages(text: str) -> list[Message] | None:
    """The messages of a string written in HH markup (``"\\n\\nHuman: ...\\n\\nAssistant: ..."``, the
    leading blank lines optional), or None for plain text."""
    if not _HH_START.match(text):
        return None
    parts = _HH_TURN.split("\n\n" + text.lstrip())
    return [
        {"role": _HH_ROLES[role], "content": content.strip()}
        for role, content in zip(parts[1::2], parts[2::2], strict=True)
    ]


def _prompt_messages(value: Any) -> list[Message]:
    """The ``prompt`` field as messages ending with a user turn: a string in HH markup is parsed (its
    trailing empty ``Assistant:`` dropped), any other string is one user turn."""
    markup = _markup_messages(value) if isinstance(value, str) else None
    if markup is not None:
        prompt = markup[:-1] if markup and markup[-1]["role"] == "assistant" and not markup[-1]["content"] else markup
    else:
        prompt = as_messages(value, "prompt")
    if not prompt or prompt[-1]["role"] != "user":
        raise RowError("prompt does not end with a user turn")
    return prompt


def _same(a: list[Message], b: list[Message]) -> bool:
    """Messages equal in role and in visible content (:func:`visible_text`)."""
    return visible_turns(a) == visible_turns(b)


def _leading_system(messages: list[Message]) -> int:
    count = 0
    while count < len(messages) and messages[count]["role"] == "system":
        count += 1
    return count


def _continuation(prompt: list[Message], value: Any, field: str) -> tuple[list[Message], list[Message]]:
    """A response field as the messages that continue ``prompt``, and the system messages it brings.

    Many public datasets store each response as the whole conversation, the prompt
    included: a response that starts with the prompt's turns, or the last of them
    (a suffix of the prompt's dialogue), has them removed. Leading system messages
    of the response are allowed only before the whole prompt and must equal the
    prompt's own system messages, if it has any; they are returned so the caller
    can put them into the prompt. A plain-string response that starts with the
    prompt's last user turn (:data:`ECHO_MIN_WORDS` words or more, followed by a
    space or the end) has that text removed. A string in HH markup is parsed.

    Returns:
        ``(system_messages_to_add_to_the_prompt, response_messages)``.

    Raises:
        RowError: a system message that does not open a repetition of the whole prompt, one that
            differs from the prompt's, a response that (after the repetition) starts with a
            user or system turn, or a malformed field.
    """
    markup = _markup_messages(value) if isinstance(value, str) else None
    response = markup if markup is not None else as_messages(value, field)
    prompt_system = _leading_system(prompt)
    dialogue = prompt[prompt_system:]
    system = _leading_system(response)
    rest = response[system:]
    repeated = max((k for k in range(1, len(dialogue) + 1) if _same(rest[:k], dialogue[-k:])), default=0)
    if system:
        if repeated != len(dialogue):
            raise RowError(f"{field} response holds a system message that does not open the whole prompt")
        if prompt_system and not _same(response[:system], prompt[:prompt_system]):
            raise RowError(f"{field} response's system message differs from the prompt's")
    rest = rest[repeated:]
    if markup is None and isinstance(value, str) and rest:
        echo, body = dialogue[-1]["content"].strip(), rest[0]["content"].lstrip()
        after = body[len(echo) : len(echo) + 1]
        if len(echo.split()) >= ECHO_MIN_WORDS and body.startswith(echo) and (not after or after.isspace()):
            rest = [{"role": "assistant", "content": body[len(echo) :].lstrip()}]
    if rest and rest[0]["role"] != "assistant":
        raise RowError(f"{field} response starts with a {rest[0]['role']} turn that does not repeat the prompt")
    return (response[:system] if system and not prompt_system else []), rest


def _pair_from_prompt(prompt_value: Any, chosen_value: Any, rejected_value: Any) -> dict[str, list[Message]]:
    """One example from a prompt and two responses, each response reduced to what continues the prompt
    (see :func:`_continuation`); a system message a response brings goes into the prompt (two different
    ones are an error)."""
    prompt = _prompt_messages(prompt_value)
    chosen_system, chosen = _continuation(prompt, chosen_value, "chosen")
    rejected_system, rejected = _continuation(prompt, rejected_value, "rejected")
    if chosen_system and rejected_system and not _same(chosen_system, rejected_system):
        raise RowError("chosen and rejected responses bring different system messages")
    prompt = (chosen_system or rejected_system) + prompt
    prompt, chosen, rejected = split_pair(prompt + chosen, prompt + rejected)
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
            dialogues = parse_hh_dialogue(row["chosen"]), parse_hh_dialogue(row["rejected"])
            prompt, chosen, rejected = split_pair(*dialogues, hh_markup=True)
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
