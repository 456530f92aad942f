"""Short replies as extra rejected responses: the empty-answer hack closed by data.

A reward model never shown a one-line answer to a request that needed more scores it however its features
happen to fall, and an empty or one-word reply beat the chosen response on most held-out helpful prompts
(``rm/kind/helpful/empty_beats_chosen``): PPO then learns to say less. On the kinds of data where that is wrong
(``helpful``: the raters chose the more helpful answer), a share of the training pairs whose chosen response is
a substantive answer gets a second pair: the same prompt and chosen response against a short reply drawn from
the training data itself (its responses of at most :data:`SHORT_WORDS` words: "Yes.", "You're welcome!",
"Why?"), never the replies the measure tries (:data:`rlhf.reward.length_bias.SHORT_REPLIES` and the empty answer),
so the measure stays a test of what was learned. These pairs are the data's, not the raters' length preference:
the trainer leaves them out of the length expert and the length term (:func:`rlhf.reward.trainer.train_reward_model`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlhf.data.formats import visible_text
from rlhf.data.kinds import kind_of
from rlhf.data.splitting import unit_point
from rlhf.reward.length_bias import SHORT_REPLIES

SHORT_WORDS = 4
"""A reply of at most this many words is short."""
LONG_WORDS = 20
"""A chosen response of at least this many words is a substantive answer, which a short reply does not replace."""
AUGMENTED = "augmented"
"""The key that marks an extra pair (True)."""


def _words(messages: list[dict[str, str]]) -> int:
    return len(" ".join(m["content"] for m in messages).split())


def short_replies(examples: Sequence[dict[str, Any]]) -> list[str]:
    """The data's short replies: every one-message response (chosen or rejected) of at most :data:`SHORT_WORDS`
    words, by visible text, once each, sorted; the measure's own replies and the empty one left out."""
    measured = {visible_text(r) for r in SHORT_REPLIES} | {""}
    found = {
        visible_text(response[0]["content"])
        for example in examples
        for response in (example["chosen"], example["rejected"])
        if len(response) == 1 and _words(response) <= SHORT_WORDS
    }
    return sorted(found - measured)


def short_rejections(examples: Sequence[dict[str, Any]], share: float, kinds: Sequence[str]) -> list[dict[str, Any]]:
    """The extra pairs: for each example of one of ``kinds`` whose chosen response has at least
    :data:`LONG_WORDS` words and whose id hashes below ``share``, ``{prompt, chosen, rejected: [a short reply],
    kind, source, id: <id>+short, augmented: True}``; the reply is one of :func:`short_replies`, picked by a
    second hash of the id (deterministic, independent of the order of ``examples``).

    Args:
        examples: training pairs ``{"id", "prompt", "chosen", "rejected", "kind"}`` (message lists).
        share: the share of the eligible pairs that get an extra pair, in [0, 1].
        kinds: the kinds of data where a short reply is worse than a substantive answer.

    Returns:
        The extra pairs, in the order of ``examples``; ``[]`` when ``share`` is 0 or the data has no short reply.

    Raises:
        ValueError: ``share`` outside [0, 1].
    """
    if not 0 <= share <= 1:
        raise ValueError(f"the share of short rejections must be in [0, 1], got {share}")
    pool = short_replies(examples) if share > 0 else []
    extra = []
    for example in examples:
        key = str(example.get("id", ""))
        if not pool or kind_of(example) not in kinds or _words(example["chosen"]) < LONG_WORDS:
            continue
        if unit_point(key, salt="short-rejection") < share:
            reply = pool[int(unit_point(key, salt="short-reply") * len(pool))]
            extra.append(
                {
                    **example,
                    "id": f"{key}+short",
                    "rejected": [{"role": "assistant", "content": reply}],
                    AUGMENTED: True,
                }
            )
    return extra
