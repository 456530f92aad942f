"""Generation as PPO, validation and evaluation use it: sample one response per prompt (:mod:`rlhf.models.sampling`)
and score it with a reward model at the end-of-turn token, an unfinished or empty response treated as
:class:`GenerationSettings` says (params.yaml section ``generation``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.models.forward import position_ids_from_mask, sequence_scores
from rlhf.models.sampling import Rollout, sample
from rlhf.models.trunk import SharedTrunk
from rlhf.ranges import check_ranges
from rlhf.runtime.device import PhaseTimer, timed

NO_EOS_CHOICES = ("penalty", "constant", "score")


@dataclass
class GenerationSettings:
    """How responses are sampled and how an unfinished one is scored (params.yaml section ``generation``).

    PPO (rollouts and validation) and the evaluation read this one section, so
    they always score responses the same way.
    """

    max_new_tokens: int = 128
    temperature: float = 0.7
    # a response cut at max_new_tokens without EOS: penalty (TRL: score - no_eos_value), constant (the N+
    # implementation details: the score becomes no_eos_value) or score (read as if it had ended)
    no_eos: str = "constant"
    no_eos_value: float | None = -1.0
    empty_response: str = "no_eos"  # no_eos (an EOS-first or blank response counts as unfinished) | score
    cache: str = "static"  # the KV cache of sampling: static | dynamic (rlhf.models.sampling.sample): the same tokens

    def __post_init__(self) -> None:
        """Refuse unknown choices and a value that the choice would not use.

        Raises:
            ValueError: names the key and the rule; ``max_new_tokens`` below 1 or ``temperature`` not above 0
                (:func:`rlhf.ranges.check_ranges`); a ``penalty`` not above 0 (subtracted, it would pay for a
                response that never ends).
        """
        if self.no_eos not in NO_EOS_CHOICES:
            raise ValueError(f"generation.no_eos must be one of {NO_EOS_CHOICES}, got {self.no_eos!r}")
        if (self.no_eos == "score") != (self.no_eos_value is None):
            raise ValueError(
                f"generation.no_eos_value must be set for no_eos penalty or constant and null for score "
                f"(got no_eos {self.no_eos!r}, no_eos_value {self.no_eos_value!r})"
            )
        if self.no_eos == "penalty" and self.no_eos_value <= 0:
            raise ValueError(
                f"generation.no_eos_value must be above 0 for no_eos penalty (it is subtracted: "
                f"{self.no_eos_value!r} would reward a response that never ends)"
            )
        if self.empty_response not in ("no_eos", "score"):
            raise ValueError(f"generation.empty_response must be no_eos or score, got {self.empty_response!r}")
        if self.cache not in ("dynamic", "static"):
            raise ValueError(f"generation.cache must be dynamic or static, got {self.cache!r}")
        check_ranges("generation", self, at_least_1=("max_new_tokens",), positive=("temperature",))


def treat_unfinished(scores: torch.Tensor, unfinished: torch.Tensor, settings: GenerationSettings) -> torch.Tensor:
    """The score an unfinished response gets: ``score - value`` (penalty), ``value`` (constant) or the score.

    Args:
        scores: ``(B,)`` float, raw reward-model scores.
        unfinished: ``(B,)`` bool, True where the response has no EOS (or is empty, see
            :func:`unfinished_responses`).
        settings: :class:`GenerationSettings`.

    Returns:
        ``(B,)`` float; finished responses keep their score.
    """
    if settings.no_eos == "penalty":
        return scores - settings.no_eos_value * unfinished.to(scores.dtype)
    if settings.no_eos == "constant":
        return torch.where(unfinished, torch.full_like(scores, settings.no_eos_value), scores)
    return scores


def unfinished_responses(
    rollout: Rollout, tokenizer: PreTrainedTokenizerBase, settings: GenerationSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which responses the reward model never learned to score: no EOS, or (unless configured) empty.

    A response is empty when its text before the EOS is blank (EOS first,
    or only whitespace and special tokens).

    Returns:
        ``(unfinished (B,) bool, empty (B,) bool)``.
    """
    start = rollout.response_start
    content = rollout.response_mask & (rollout.input_ids[:, start:] != tokenizer.eos_token_id)
    rows, keeps = rollout.input_ids[:, start:].tolist(), content.tolist()  # two host round trips per rollout
    texts = tokenizer.batch_decode(
        [[t for t, keep in zip(row, flags, strict=True) if keep] for row, flags in zip(rows, keeps, strict=True)],
        skip_special_tokens=True,
    )
    empty = torch.tensor([not text.strip() for text in texts], dtype=torch.bool, device=rollout.ended.device)
    unfinished = ~rollout.ended
    if settings.empty_response == "no_eos":
        unfinished = unfinished | empty
    return unfinished, empty


@dataclass
class ScoredRollout:
    """A rollout with its reward-model scores: raw, after the unfinished-response rule, and the flags; ``trunk``:
    the policy's frozen blocks over the rollout, run once for every model that shares them
    (:mod:`rlhf.models.trunk`)."""

    rollout: Rollout
    raw_scores: torch.Tensor  # (B,) float32, the reward model at the last response token
    scores: torch.Tensor  # (B,) float32, after treat_unfinished
    unfinished: torch.Tensor  # (B,) bool
    empty: torch.Tensor  # (B,) bool
    trunk: SharedTrunk


@torch.no_grad()
def sample_and_score(
    policy: PreTrainedModel,
    reward_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    settings: GenerationSettings,
    greedy: bool = False,
    timer: PhaseTimer | None = None,
    seeds: list[int] | None = None,
    kinds: list[str] | None = None,
) -> ScoredRollout:
    """Sample one response per prompt and score it as the settings say (PPO, validation and evaluation).

    Runs in the caller's autocast context; ``timer`` (optional) records ``generation`` and ``reward`` seconds;
    ``seeds``: one generator per prompt (:func:`rlhf.models.sampling.sample`); ``kinds``: each prompt's kind of data,
    its
    response read with that kind's score (:func:`rlhf.models.kind_heads.read_scores`), None: the kind gate's mix.
    """
    with timed(timer, "generation"):
        rollout = sample(
            policy,
            tokenizer,
            prompts,
            settings.max_new_tokens,
            settings.temperature,
            greedy=greedy,
            seeds=seeds,
            cache=settings.cache,
        )
    ids, attn = rollout.input_ids, rollout.attention_mask
    trunk = SharedTrunk(policy, ids, attn, position_ids_from_mask(attn))
    with timed(timer, "reward"):
        raw = sequence_scores(reward_model, ids, attn, trunk.entry(reward_model), kinds)
    unfinished, empty = unfinished_responses(rollout, tokenizer, settings)
    return ScoredRollout(rollout, raw, treat_unfinished(raw, unfinished, settings), unfinished, empty, trunk)
