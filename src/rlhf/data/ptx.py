"""PPO-ptx rows: their shape, key, held-out share and tokens.

PPO-ptx rows (splits ``ptx_text`` and ``ptx_heldout``) are either
``{"id", "source", "kind", "messages": [{"role", "content"}, ...]}`` (a conversation,
tokenised with the chat template) or ``{"id", "source", "kind", "text": str}`` (plain
pretraining text, tokenised as text + EOS); see :func:`ptx_token_ids`. A row made from a preference pair's
prompt and chosen answer also holds ``response_start``, the index of the answer's first message: validate applies
the pairs' rule to it (the answer is one assistant turn; more held a speaker tag such as HH's "\n\nHuman:").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlhf.data.formats import RowError, as_messages, visible_text
from rlhf.data.splitting import conversation_root, unit_point

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def parse_ptx_row(row: Any) -> dict[str, Any]:
    """Check the shape of a PPO-ptx row: exactly one of ``messages`` (a non-empty list of
    ``{"role": "system" | "user" | "assistant", "content": str}``) or ``text`` (a string).

    Returns:
        ``{"messages": [...]}`` or ``{"text": str}`` (other keys dropped).

    Raises:
        RowError: neither or both keys, or a malformed value (the message is the quarantine reason).
    """
    if not isinstance(row, dict) or ("messages" in row) == ("text" in row):
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise RowError(f"ptx row has keys {keys}; expected exactly one of 'messages' or 'text'")
    if "text" in row:
        if not isinstance(row["text"], str):
            raise RowError(f"ptx field 'text' is {type(row['text']).__name__}, not a string")
        return {"text": row["text"]}
    messages = as_messages(row["messages"], "messages", conversation=True)
    if not messages:
        raise RowError("ptx field 'messages' is an empty list")
    return {"messages": messages}


def ptx_key(row: dict[str, Any]) -> str:
    """What groups PPO-ptx rows for the held-out share: the conversation root of a ``messages`` row
    with a user turn, else its whitespace-normalised contents (``text`` rows: the text)."""
    if "messages" in row and any(m["role"] == "user" for m in row["messages"]):
        return conversation_root(row["messages"])
    contents = [m["content"] for m in row["messages"]] if "messages" in row else [row["text"]]
    return visible_text(" ".join(contents))


def is_ptx_heldout(row: dict[str, Any], heldout_fraction: float) -> bool:
    """Whether a ptx row goes to ``ptx_heldout``: a hash of :func:`ptx_key`, salted so it is
    independent of the split hash, falls below ``heldout_fraction``."""
    return unit_point(ptx_key(row), salt="ptx_heldout\x1f") < heldout_fraction


def ptx_token_ids(tokenizer: PreTrainedTokenizerBase, row: dict[str, Any], max_length: int) -> list[int]:
    """Token ids of one PPO-ptx row, the input of the LM term of PPO-ptx (tutorial Eq. 14).

    A ``messages`` row is the chat template of its messages (no generation prompt;
    template markers included, every token is an LM target); a ``text`` row is
    the text's ids + the EOS id. A control token written inside a content or a text
    (``<|im_end|>``, the pad ``<|endoftext|>``, ``<file_sep>``, ...) is encoded as
    plain text (:func:`rlhf.data.chat.encode_messages`, :func:`rlhf.data.chat.encode_text`),
    so the only special ids are the template's and the final EOS. The ids are
    cut on the right to ``max_length`` (the start is kept).

    Args:
        tokenizer: the policy's tokenizer, with a chat template.
        row: a ptx row (see :func:`parse_ptx_row`).
        max_length: the most tokens to keep (>= 1).

    Returns:
        ``list[int]`` of length ``1..max_length``.

    Raises:
        ValueError: ``max_length < 1``, the row is malformed (names its id and why), or it gives no tokens.
    """
    if max_length < 1:
        raise ValueError(f"ptx max_length must be >= 1, got {max_length}")
    name = row.get("id", "?") if isinstance(row, dict) else "?"
    try:
        parsed = parse_ptx_row(row)
    except RowError as err:
        raise ValueError(f"ptx row {name}: {err}") from None
    from rlhf.data.chat import encode_messages, encode_text  # noqa: PLC0415 torch and transformers load only when tokenising

    if "messages" in parsed:
        ids = encode_messages(tokenizer, parsed["messages"])
    else:
        ids = encode_text(tokenizer, parsed["text"]) + [tokenizer.eos_token_id]
    ids = ids[:max_length]
    if not ids:
        raise ValueError(f"ptx row {name}: no tokens")
    return ids


PTX_KIND = "ptx"
"""The kind of the rows of ``data.ptx_source`` (pretraining text, no preference)."""
