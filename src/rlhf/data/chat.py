"""Chat encoding: conversations to token ids with the chat template, control tokens kept as text, padding.

Every piece of content (a message, a ptx text) is encoded as text: a control
token written in it (``<|im_end|>``, ``<|im_start|>``, the pad) never becomes its
special id. The sequence the reward model scores ends at the last end-of-turn
token, exactly as a PPO rollout does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import mark_control_tokens


@dataclass
class Encoded:
    """One tokenised conversation: ``input_ids`` and a same-length mask of assistant response tokens."""

    input_ids: list[int]
    response_mask: list[bool]


def _control_added_tokens(tokenizer: PreTrainedTokenizerBase) -> dict[int, str]:
    return {
        index: token.content
        for index, token in tokenizer.added_tokens_decoder.items()
        if token.special or not token.content.isspace()  # an added "\n" (Gemma) is ordinary text
    }


def control_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """Every added token of the tokenizer: its special tokens (``<|im_start|>``, ``<|im_end|>``, the pad
    ``<|endoftext|>``) and the others in its added vocabulary (SmolLM2's ``<repo_name>``, ``<file_sep>``,
    ``<empty_output>``, ...; whitespace-only ones aside), longest first. Written inside a message or a
    text they are plain text (:func:`encode_messages`, :func:`encode_text`)."""
    names = set(_control_added_tokens(tokenizer).values()) | set(tokenizer.all_special_tokens)
    return tuple(sorted(names, key=lambda name: (-len(name), name)))


def control_token_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Ids of :func:`control_tokens`: none of them may come from the content of a message or a text."""
    return set(_control_added_tokens(tokenizer)) | set(tokenizer.all_special_ids)


def _mark_control_tokens(tokenizer: PreTrainedTokenizerBase, value: Any) -> Any:
    """Mark every control token inside user-supplied strings (transformers' ``mark_control_tokens``), so
    that tokenising with ``sanitize_control_tokens=True`` encodes them as plain text."""
    pattern = re.compile("|".join(map(re.escape, control_tokens(tokenizer))) or "(?!)")
    return mark_control_tokens(value, pattern)


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a text with any control token written in it encoded as plain text (no special id).

    ``<|im_end|>`` inside a text becomes the ids of ``<``, ``|``, ``im``, ... (as
    ``split_special_tokens=True`` does for special tokens, here for every added token).
    """
    return tokenizer(_mark_control_tokens(tokenizer, text), add_special_tokens=False, sanitize_control_tokens=True)[
        "input_ids"
    ]


def encode_messages(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = False
) -> list[int]:
    """Token ids of messages in the chat template; control tokens come only from the template.

    The template's own markers (``<|im_start|>``, ``<|im_end|>``) are special
    tokens; a control token written inside a message's content (any of
    :func:`control_tokens`) is encoded as plain text, so a prompt cannot forge a
    turn and a response cannot end early or hold the pad id. Text without control
    tokens gets exactly the ids of the rendered template tokenised whole.
    """
    return _tokens(tokenizer, _rendered(tokenizer, messages, add_generation_prompt))


def _rendered(tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The chat template's text of ``messages``, control tokens in their contents marked."""
    return tokenizer.apply_chat_template(
        _mark_control_tokens(tokenizer, list(messages)), tokenize=False, add_generation_prompt=add_generation_prompt
    )


def _tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, sanitize_control_tokens=True)["input_ids"]


def encode_chat(
    tokenizer: PreTrainedTokenizerBase, prompt: list[dict], response: list[dict], max_length: int
) -> Encoded:
    """Tokenise prompt + response with the chat template; mark the assistant tokens of the response.

    Each assistant message of the response is marked from the end of its
    generation header (``<|im_start|>assistant\\n``) to its end token; user turns
    inside a response are context, not targets. Each turn's text is tokenised on its own, after the ids
    before it, so the ids of the prompt with its generation header (:func:`encode_prompt`, what PPO
    samples from) are always a prefix of these: a response starting with ``"\\n\\n"`` would otherwise merge
    with the header's newline into one token. Where no turn starts that way the ids equal the template's
    text tokenised whole. The sequence ends at the last
    end-of-turn token (the template's trailing newline is dropped), so the reward
    model reads its score at the EOS exactly as in a PPO rollout. Sequences over
    ``max_length`` lose tokens from the left (the response end is kept). Control
    tokens written inside a message are plain text (see :func:`encode_messages`):
    the only special ids are the template's.

    Args:
        tokenizer: with a chat template.
        prompt: messages ending with a user turn.
        response: messages following the prompt.
        max_length: maximum number of tokens (> 0).

    Returns:
        :class:`Encoded` with ``len(input_ids) <= max_length``.

    Raises:
        ValueError: the chat template renders the start of a conversation differently once a turn follows
            (no prefix can hold then).
    """
    messages = list(prompt)
    text = _rendered(tokenizer, messages)
    input_ids = _tokens(tokenizer, text)
    mask = [False] * len(input_ids)

    def extend(longer: str, target: bool) -> None:  # tokenise only what the template added: a prefix stays one
        nonlocal text
        if not longer.startswith(text):
            raise ValueError("the chat template renders a conversation's start differently once a turn follows")
        added = _tokens(tokenizer, longer[len(text) :])
        input_ids.extend(added)
        mask.extend([target] * len(added))
        text = longer

    for message in response:
        if message["role"] == "assistant":
            extend(_rendered(tokenizer, messages, add_generation_prompt=True), False)
        messages.append(message)
        extend(_rendered(tokenizer, messages), message["role"] == "assistant")
    if tokenizer.eos_token_id in input_ids:
        # end at the last end-of-turn token: the template's trailing newline is not part of
        # the response, and the reward is read at the EOS exactly as in a PPO rollout
        end = len(input_ids) - input_ids[::-1].index(tokenizer.eos_token_id)
        input_ids, mask = input_ids[:end], mask[:end]
    return Encoded(input_ids=input_ids[-max_length:], response_mask=mask[-max_length:])


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: list[dict], max_length: int) -> list[int]:
    """Tokenise a prompt with the generation header (``<|im_start|>assistant\\n``), left-truncated to ``max_length``.

    Control tokens written inside a message are plain text (see :func:`encode_messages`).
    """
    return encode_messages(tokenizer, prompt, add_generation_prompt=True)[-max_length:]


def pad(
    tokenizer: PreTrainedTokenizerBase, sequences: list[list[int]], side: str, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token lists with the tokenizer's pad id into ``(input_ids, attention_mask)`` on ``device``.

    Args:
        tokenizer: its ``pad_token_id`` fills the padding.
        sequences: token lists.
        side: ``"left"`` (prompts to generate from) or ``"right"``.
        device: where the batch is created (the stage's :class:`rlhf.runtime.device.Runtime` device).

    Returns:
        ``(input_ids, attention_mask)``, both ``(B, T)`` int64, ``T`` the longest sequence.
    """
    length = max((len(s) for s in sequences), default=0)
    ids = _pad_rows(sequences, length, side, tokenizer.pad_token_id)
    mask = _pad_rows([[1] * len(s) for s in sequences], length, side, 0)
    return torch.tensor(ids, dtype=torch.long, device=device), torch.tensor(mask, dtype=torch.long, device=device)


def pad_masks(masks: list[list[bool]], length: int, side: str, device: torch.device) -> torch.Tensor:
    """Pad boolean lists with False to ``length`` on ``side``; returns ``(B, length)`` bool on ``device``."""
    return torch.tensor(_pad_rows(masks, length, side, False), dtype=torch.bool, device=device)


def _pad_rows(rows: list[list[Any]], length: int, side: str, value: Any) -> list[list[Any]]:
    if side not in ("left", "right"):
        raise ValueError(f"padding side {side!r}: use 'left' or 'right'")
    return [
        ([value] * (length - len(r)) + list(r)) if side == "left" else (list(r) + [value] * (length - len(r)))
        for r in rows
    ]


def check_reads_whole(reader: str, max_length: int | None, prompt: tuple[str, int], response: tuple[str, int]) -> None:
    """Refuse a reward model (or judge) that would read a prompt and response cut: its trained ``max_length``
    must cover the longest prompt plus the longest response it scores.

    Encoding cuts from the left (:func:`rlhf.data.chat.encode_chat`), so a model that reads fewer tokens loses the
    start of the prompt, and a model trained at a shorter length scores a length it never saw.

    Args:
        reader: what reads, for the message (``reward.max_length``, ``models/reward_champion``).
        max_length: its length in tokens; None: unknown (a model saved before the length was recorded), not checked.
        prompt, response: ``(key, tokens)`` of the longest prompt and response it scores (``ppo.max_prompt_length``).

    Raises:
        ValueError: one line naming the three keys and values.
    """
    needed = prompt[1] + response[1]
    if max_length is not None and max_length < needed:
        raise ValueError(
            f"{reader} is {max_length} tokens, but it scores {prompt[0]} ({prompt[1]}) + {response[0]} "
            f"({response[1]}) = {needed}: a prompt and response would be cut; set it to at least {needed}"
        )
