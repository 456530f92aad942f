"""Experience: sample responses, score them, and turn them into token rewards, advantages and returns.

One rollout: sample from the policy (temperature only), score each response with
the reward model where the reward model learned to read (at the end-of-turn
token; an unfinished or empty response is treated as :class:`GenerationSettings`
says), normalise the scores with running statistics (paper Eq. 18), add the KL
penalty per token (tutorial Eq. 11), and run GAE against the value model's
predictions (paper Eq. 9).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf import losses
from rlhf.device import PhaseTimer, Runtime
from rlhf.distributed import Ranks
from rlhf.models import Rollout, position_ids_from_mask, response_logprobs, sample, sequence_scores, token_scores
from rlhf.ppo_config import PPOConfig
from rlhf.rollout_stats import rollout_stats, sequence_table
from rlhf.training import check_ranges
from rlhf.trunk import SharedTrunk, TrunkEntry

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
    cache: str = "dynamic"  # the KV cache of sampling: dynamic | static (rlhf.models.sample): the same tokens

    def __post_init__(self) -> None:
        """Refuse unknown choices and a value that the choice would not use.

        Raises:
            ValueError: names the key and the rule; ``max_new_tokens`` below 1 or ``temperature`` not above 0
                (:func:`rlhf.training.check_ranges`).
        """
        if self.no_eos not in NO_EOS_CHOICES:
            raise ValueError(f"generation.no_eos must be one of {NO_EOS_CHOICES}, got {self.no_eos!r}")
        if (self.no_eos == "score") != (self.no_eos_value is None):
            raise ValueError(
                f"generation.no_eos_value must be set for no_eos penalty or constant and null for score "
                f"(got no_eos {self.no_eos!r}, no_eos_value {self.no_eos_value!r})"
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
    the policy's frozen blocks over the rollout, run once for every model that shares them (:mod:`rlhf.trunk`)."""

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
    ``seeds``: one generator per prompt (:func:`rlhf.models.sample`); ``kinds``: each prompt's kind of data, its
    response read with that kind's score (:func:`rlhf.kind_heads.read_scores`), None: the kind gate's mix.
    """
    phase = timer if timer is not None else (lambda name: contextlib.nullcontext())
    with phase("generation"):
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
    with phase("reward"):
        raw = sequence_scores(reward_model, ids, attn, trunk.entry(reward_model), kinds)
    unfinished, empty = unfinished_responses(rollout, tokenizer, settings)
    return ScoredRollout(rollout, raw, treat_unfinished(raw, unfinished, settings), unfinished, empty, trunk)


class RunningMoments:
    """Running mean and population std of all reward-model scores seen so far (Chan et al. parallel update).

    ``normalize`` raises while no statistics exist, so turning normalisation on
    cannot silently pass rewards through unchanged.
    """

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    @property
    def std(self) -> float:
        """Population standard deviation of everything seen."""
        return math.sqrt(self.m2 / self.count) if self.count else float("nan")

    def update(self, values: torch.Tensor) -> None:
        """Fold a batch ``(N,)`` of values into the statistics."""
        values = values.double().flatten()
        n = values.numel()
        if n == 0:
            return
        batch_mean = float(values.mean())
        batch_m2 = float(((values - batch_mean) ** 2).sum())
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta**2 * self.count * n / total
        self.count = total

    def normalize(self, values: torch.Tensor, clip: float | None) -> torch.Tensor:
        """Paper Eq. 18 with these statistics.

        Raises:
            RuntimeError: no statistics yet.
        """
        if self.count == 0:
            raise RuntimeError("reward normalisation is on but no reward statistics exist yet")
        return losses.normalize_and_clip(values, self.mean, self.std, clip)

    def state_dict(self) -> dict[str, float]:
        """For checkpoints."""
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore :meth:`state_dict`."""
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def value_predictions(
    value_model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_start: int,
    entry: TrunkEntry | None = None,
) -> torch.Tensor:
    """``V(s_t)`` for each response token: the value head at the position that predicts token ``t``.

    The head's output is mapped by the model's calibration (``config.value_scale``,
    ``config.value_bias``; 1 and 0 unless :func:`calibrate_value_head` set them):
    ``V = head * scale + bias``.

    Args:
        input_ids, attention_mask: ``(B, T)``; response tokens start at ``response_start``.
        entry: the states entering the value model's first unshared block (:class:`rlhf.trunk.SharedTrunk`).

    Returns:
        ``(B, T - response_start)`` float32.
    """
    head = token_scores(value_model, input_ids, attention_mask, entry)[:, response_start - 1 : -1]
    scale = float(getattr(value_model.config, "value_scale", 1.0))
    bias = float(getattr(value_model.config, "value_bias", 0.0))
    return head * scale + bias


def calibrate_value_head(
    value_model: PreTrainedModel,
    values: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    ranks: Ranks,
) -> torch.Tensor:
    """Put a value model initialised from the reward model on the scale of the returns it must predict.

    The reward model's head was trained at the end of a response only; what it reads mid-response has
    its own offset and spread. The first rollout's Monte Carlo returns ``G_t = sum_l gamma^l r_{t+l}``
    (the rewards PPO optimises: normalised score and KL penalty) are regressed on the current
    predictions by least squares over every response token of every rank, ``G ~ a V + b``, and the
    model's calibration becomes ``V' = a V + b``: the best affine predictor of this rollout's returns,
    so the critic starts with explained variance >= 0 where a fixed rescaling of the head can start far
    below (paper section 5.3.3 initialises the critic from the reward model; this puts it on the scale).

    Args:
        value_model: initialised from the reward model; its ``config.value_scale`` / ``value_bias`` are set.
        values: ``(B, R)`` float, its predictions under its current calibration.
        rewards: ``(B, R)`` float, token rewards (:func:`rlhf.losses.token_rewards`).
        mask: ``(B, R)`` bool, True on response tokens.
        gamma: discount in [0, 1].
        ranks: the processes; each passes its share of the batch.

    Returns:
        ``(B, R)`` float32, the predictions after calibration (``a * values + b``).
    """
    _, targets = losses.gae(rewards, torch.zeros_like(values), mask, gamma, 1.0)
    x, y = values[mask].double(), targets[mask].double()
    n, sx, sy, sxx, sxy = ranks.sum(
        torch.stack([x.new_tensor(x.numel()), x.sum(), y.sum(), (x * x).sum(), (x * y).sum()])
    )
    var = sxx / n - (sx / n) ** 2
    slope = ((sxy / n - sx * sy / n**2) / var).item() if var > 0 else 0.0
    intercept = (sy / n - slope * sx / n).item()
    config = value_model.config
    config.value_scale = slope * float(getattr(config, "value_scale", 1.0))
    config.value_bias = slope * float(getattr(config, "value_bias", 0.0)) + intercept
    return (values * slope + intercept).float()


@dataclass
class Experience:
    """A scored buffer of rollouts. Shapes: ``B`` rollouts, ``T`` = prompt + response tokens, ``R`` response tokens."""

    input_ids: torch.Tensor  # (B, T) int64
    attention_mask: torch.Tensor  # (B, T) int64
    response_start: int
    mask: torch.Tensor  # (B, R) bool
    logprobs: torch.Tensor  # (B, R) float32, policy at rollout time (temperature-scaled)
    values: torch.Tensor  # (B, R) float32, value model at rollout time
    advantages: torch.Tensor  # (B, R) float32
    returns: torch.Tensor  # (B, R) float32
    raw_scores: torch.Tensor  # (B,) float32
    ended: torch.Tensor  # (B,) bool, an EOS was generated
    # the states entering the policy's / value model's first trained block: PPO's epochs run only the blocks
    # above (their frozen blocks cannot change within an iteration); None: the plain path (rlhf.trunk)
    policy_entry: TrunkEntry | None = None
    value_entry: TrunkEntry | None = None


@torch.no_grad()
def make_experience(
    models: tuple[PreTrainedModel, PreTrainedModel, PreTrainedModel, PreTrainedModel],
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    config: PPOConfig,
    settings: GenerationSettings,
    moments: RunningMoments,
    kl_coef: float,
    runtime: Runtime,
    calibrate_value: bool = False,
    seeds: list[int] | None = None,
    kinds: list[str] | None = None,
) -> tuple[Experience, dict[str, float]]:
    """Roll out, score and turn a batch of prompts into advantages and returns.

    With several processes each rank passes its share of the batch (:meth:`rlhf.distributed.Ranks.shard`)
    and builds the experience of its prompts; what spans the batch is taken over all ranks: the running
    reward statistics fold in every rank's scores, and the stats describe the whole batch.

    Args:
        models: ``(policy, reference, reward_model, value_model)``, dropout off.
        tokenizer: shared tokenizer.
        prompts: token lists (chat template with generation header).
        config: :class:`PPOConfig`; settings: :class:`GenerationSettings`.
        moments: running reward statistics (updated here when normalisation is on).
        kl_coef: the current beta.
        runtime: device and precision; every forward pass runs under ``runtime.autocast()``.
        calibrate_value: fit the value model's calibration to this rollout's returns
            (:func:`calibrate_value_head`) before the advantages are computed.
        seeds: one generator seed per prompt (:func:`rlhf.sampling.prompt_seed`), so the tokens a prompt gets
            do not depend on the rank or the rows beside it; None: torch's global generator.
        kinds: each prompt's kind of data (:func:`sample_and_score`); None: the reward model's kind gate.

    Returns:
        ``(experience, stats)``; stats are the iteration's monitoring signals and the seconds of each
        phase: ``ppo/time/{generation,reward,policy_logprobs,reference,values}``.
    """
    policy, reference, reward_model, value_model = models
    timer = PhaseTimer(runtime)
    with runtime.autocast():
        scored = sample_and_score(
            policy, reward_model, tokenizer, prompts, settings, timer=timer, seeds=seeds, kinds=kinds
        )
        rollout, trunk = scored.rollout, scored.trunk
        ids, attn, start = rollout.input_ids, rollout.attention_mask, rollout.response_start
        with timer("policy_logprobs"):
            policy_entry = trunk.entry(policy)
            logprobs, logits = response_logprobs(
                policy, ids, attn, start, settings.temperature, with_logits=True, entry=policy_entry
            )
            entropy = losses.entropy_from_logits(logits)
            del logits
        with timer("reference"):
            ref_logprobs, _ = response_logprobs(
                reference, ids, attn, start, settings.temperature, entry=trunk.entry(reference)
            )
    mask, scores = rollout.response_mask, scored.scores
    if config.reward_normalize:
        moments.update(runtime.ranks.gather(scores))  # every rank's scores, in the global order
        scores = moments.normalize(scores, config.reward_clip)
    elif config.reward_clip is not None:
        scores = scores.clamp(-config.reward_clip, config.reward_clip)
    with timer("values"), runtime.autocast():
        value_entry = trunk.entry(value_model)
        values = value_predictions(value_model, ids, attn, start, value_entry)
    logratio = torch.where(mask, logprobs - ref_logprobs, 0.0)
    rewards = losses.token_rewards(logratio, scores, mask, kl_coef)
    if calibrate_value:
        values = calibrate_value_head(value_model, values, rewards, mask, config.gamma, runtime.ranks)
    advantages, returns = losses.gae(rewards, values, mask, config.gamma, config.lam)
    experience = Experience(
        ids,
        attn,
        start,
        mask,
        logprobs,
        values,
        advantages,
        returns,
        scored.raw_scores,
        rollout.ended,
        policy_entry,
        value_entry,
    )
    table = runtime.ranks.gather(sequence_table(scored, scores, logprobs, logratio, entropy, experience))
    return experience, {**rollout_stats(table), "ppo/kl_coef": kl_coef, **timer.stats("ppo/time")}


@torch.no_grad()
def validation_stats(
    policy: PreTrainedModel,
    reference: PreTrainedModel,
    reward_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    settings: GenerationSettings,
    runtime: Runtime,
    kinds: list[str] | None = None,
) -> dict[str, float]:
    """Greedy responses on held-out prompts, scored as in training: what the best policy is kept by (``kinds``:
    each prompt's kind of data, :func:`sample_and_score`).

    Every forward pass runs under ``runtime.autocast()``. With several processes each rank passes all the
    prompts, answers its share (:meth:`rlhf.distributed.Ranks.shard`), and every rank returns the means over all.

    Returns:
        ``ppo/validation/reward`` (mean score after the unfinished-response rule),
        ``ppo/validation/eos_rate``, ``ppo/validation/length`` (tokens) and
        ``ppo/validation/kl`` (sequence k1 to the reference, nats/response).
    """
    ranks = runtime.ranks
    mine = ranks.shard(prompts)
    my_kinds = ranks.shard(kinds) if kinds is not None else None
    with runtime.autocast():
        scored = sample_and_score(policy, reward_model, tokenizer, mine, settings, greedy=True, kinds=my_kinds)
        rollout, trunk = scored.rollout, scored.trunk
        ids, attn, start = rollout.input_ids, rollout.attention_mask, rollout.response_start
        logprobs, _ = response_logprobs(policy, ids, attn, start, settings.temperature, entry=trunk.entry(policy))
        ref_logprobs, _ = response_logprobs(
            reference, ids, attn, start, settings.temperature, entry=trunk.entry(reference)
        )
    mask = rollout.response_mask
    kl = torch.where(mask, logprobs - ref_logprobs, 0.0).sum(-1)
    rows = torch.stack([scored.scores, rollout.ended, mask.sum(-1), kl], dim=1).double()
    reward, eos_rate, length, kl = ranks.gather(rows).mean(0).tolist()
    return {
        "ppo/validation/reward": reward,
        "ppo/validation/eos_rate": eos_rate,
        "ppo/validation/length": length,
        "ppo/validation/kl": kl,
    }
