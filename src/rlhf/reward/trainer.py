"""Stage 2: the Bradley-Terry reward model, its training and its measurements."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.data.chat import Encoded, encode_chat, pad, pad_masks
from rlhf.data.kinds import DEFAULT_KIND, kind_of
from rlhf.likelihood import language_model_loss, target_tokens
from rlhf.losses import last_token_index
from rlhf.models.forward import position_ids_from_mask
from rlhf.models.kind_heads import head_kinds, own_kind_scores
from rlhf.models.shared_prompt import can_pack, group_states, pack, packed_hidden, packed_length, score_sequences
from rlhf.ranges import check_ranges
from rlhf.reward.augment import AUGMENTED, short_rejections
from rlhf.reward.length_bias import debiased_pair_loss, fit_length_expert
from rlhf.runtime.device import Runtime
from rlhf.training.checkpoint import Checkpointer
from rlhf.training.supervised import LogFn, LoopConfig, freeze_lower_layers, supervised_loop


@dataclass
class RewardConfig(LoopConfig):
    """Reward-model hyperparameters (params.yaml section ``reward``)."""

    section: ClassVar[str] = "reward"
    steps: int = 200
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 10
    trainable_layers: int | None = 0  # the top blocks of the (kept) backbone that train (0: the score head alone)
    num_hidden_layers: int | None = 20  # keep only the backbone's first N blocks (None: all; loading.py)
    max_length: int = 256  # tokens of prompt + response it trains and reads at (a long prompt is cut from the left)
    margin: float = 0.0  # Bradley-Terry margin (0: tutorial Eq. 6 exactly)
    lm_coef: float = 0.0  # the paper's beta_rm: weight of an LM imitation term on the chosen response
    eval_batch_size: int = 16  # pairs per scoring pass (centring and the held-out split)
    center_max_examples: int | None = 128  # chosen responses of rm_train whose mean score becomes 0 (None: all)
    length_expert: bool = True  # product of experts with a length expert fitted first, dropped after training
    length_decorrelation: float = 1.0  # coefficient of |the pairs' mean preference for the longer| (after ODIN)
    length_by_kind: bool = True  # the expert fitted and the preference taken on each kind of data apart
    length_decorrelation_exempt: tuple[str, ...] = ("harmless",)  # kinds whose pairs take no length term
    short_rejections: float = 0.5  # share of these kinds' pairs that also get a short reply as rejected (augment)
    short_rejection_kinds: tuple[str, ...] = ("helpful",)
    kind_heads: bool = True  # a score per kind of data, mixed by a learned kind gate (rlhf.models.kind_heads)
    balance_kinds: bool = True  # every batch holds each kind's share of the pairs (not what length grouping brings)
    checkpoint_every: int = 0  # never: with the head alone a resume would compute the states again anyway
    group_by_length: bool = False  # with the head alone a batch's length costs nothing

    def __post_init__(self) -> None:
        """Raises ValueError: the shared loop's checks (:class:`rlhf.training.supervised.LoopConfig`); ``max_length``,
        ``eval_batch_size``, ``center_max_examples`` or ``num_hidden_layers`` below 1; ``margin``, ``lm_coef`` or
        ``length_decorrelation`` below 0 (:func:`rlhf.ranges.check_ranges`, naming the key); ``trainable_layers``
        more than the ``num_hidden_layers`` kept (it counts their top blocks); ``lm_coef`` above 0 with
        ``trainable_layers`` 0 (the imitation term would train nothing); ``length_decorrelation_exempt`` naming kinds
        with ``length_by_kind`` false (the term is then one over all kinds, which cannot leave a kind out)."""
        super().__post_init__()
        check_ranges(
            self.section,
            self,
            at_least_1=("max_length", "eval_batch_size", "center_max_examples", "num_hidden_layers"),
            non_negative=("margin", "lm_coef", "length_decorrelation"),
        )
        if self.lm_coef > 0 and self.trainable_layers == 0:
            raise ValueError(
                f"{self.section}.lm_coef > 0 trains the backbone's blocks: it needs trainable_layers above 0 "
                "(0 trains the score head alone)"
            )
        if self.length_decorrelation_exempt and not self.length_by_kind:
            raise ValueError(
                f"{self.section}.length_decorrelation_exempt names kinds of data "
                f"({', '.join(self.length_decorrelation_exempt)}): it needs length_by_kind: true, which takes the "
                "length term on each kind apart (with length_by_kind: false set it to [])"
            )
        kept, trained = self.num_hidden_layers, self.trainable_layers
        if kept is not None and trained is not None and trained > kept:
            raise ValueError(
                f"{self.section}.trainable_layers ({trained}) counts the top blocks of the {kept} that "
                f"{self.section}.num_hidden_layers keeps: at most {kept} (null trains all of them)"
            )


@dataclass
class JudgeConfig(RewardConfig):
    """The judge's hyperparameters (params.yaml section ``judge``): a reward model trained the same way on its own
    pairs, for evaluation only (PPO never reads it); only the section and the defaults differ."""

    section: ClassVar[str] = "judge"
    num_hidden_layers: int | None = None  # every block: the shallower reward model's cut cost the judge on helpful
    seed: int = 1
    center_max_examples: int | None = 64


def encode_pairs(
    tokenizer: PreTrainedTokenizerBase, examples: list[dict[str, Any]], max_length: int
) -> list[tuple[Encoded, Encoded]]:
    """Tokenise each pair as ``(prompt + chosen, prompt + rejected)`` with the chat template."""
    return [
        (
            encode_chat(tokenizer, ex["prompt"], ex["chosen"], max_length),
            encode_chat(tokenizer, ex["prompt"], ex["rejected"], max_length),
        )
        for ex in examples
    ]


def _lm_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """Language-model logits from a reward model's hidden states through the tied input embeddings."""
    if not getattr(model.config, "tie_word_embeddings", False):
        raise ValueError("reward.lm_coef > 0 needs a model with tied input/output embeddings")
    return hidden @ model.get_input_embeddings().weight.T


def response_lengths(pairs: list[tuple[Encoded, Encoded]]) -> tuple[list[int], list[int]]:
    """The chosen and the rejected response lengths of encoded pairs, in tokens (host-side lists)."""
    return [sum(c.response_mask) for c, _ in pairs], [sum(r.response_mask) for _, r in pairs]


def reward_step(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    pairs: list[tuple[Encoded, Encoded]],
    config: RewardConfig,
    runtime: Runtime,
    expert_weight: float | list[float] = 0.0,
    groups: list[int] | None = None,
    kind_index: list[int] | None = None,
    states: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Callable[[list[int], list[int]], tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """The reward model's ``step_fn(part, batch)`` of :func:`rlhf.training.supervised.supervised_loop` over encoded
    pairs.

    It returns the part's share of the batch's loss: the length-debiased Bradley-Terry terms of its pairs
    (tutorial Eq. 6 under the product of experts with the length expert of weight ``expert_weight``, plus
    ``config.length_decorrelation`` times its pass's length preference:
    :func:`rlhf.reward.length_bias.debiased_pair_loss`)
    summed and divided by the *whole* batch's pairs, plus ``lm_coef`` times its share of the chosen
    responses' token-mean NLL (paper Eq. 2); and its shares of the training accuracy, margin and length
    preference. The accuracy and margin are of the reward model's own scores (the expert left out).
    ``expert_weight``: one weight, or one per pair (its kind's); ``groups``: each pair's kind index, within which
    the length preference is taken (None: all pairs one group; -1: a pair outside every group's term).
    ``kind_index``: with kind heads (:mod:`rlhf.models.kind_heads`), each pair's kind as its position in the model's
    kinds: its Bradley-Terry term reads that kind's score, and the loss adds the gate's cross-entropy of the kind
    averaged over the batch's responses (``rm/train_kind_loss``).

    A pair's chosen and rejected encodings share their prompt: each pair is one row, its common prefix run
    once (:mod:`rlhf.models.shared_prompt`; the plain batch of ``2 x part`` rows where the model cannot take it).
    ``states``: the pairs' chosen and rejected states of :func:`frozen_pair_states` (``(P, H)`` each), read by the
    score head instead of running the backbone (a model that trains its head alone).
    """
    chosen_targets = [target_tokens(chosen.response_mask) for chosen, _ in pairs]
    chosen_lengths, rejected_lengths = (torch.tensor(n, device=runtime.device) for n in response_lengths(pairs))
    read = _packed_pair_scores if can_pack(model) else _plain_pair_scores
    if states is not None:
        read = _cached_pair_scores(states, pairs)
    weights = torch.as_tensor(expert_weight, dtype=torch.float32, device=runtime.device)
    index = None if groups is None else torch.tensor(groups, device=runtime.device)
    members = None  # (G, P) bool; G is 0 when every pair is outside the term (no group, no term)
    if index is not None:
        members = index[None] == torch.arange(max(groups, default=-1) + 1, device=runtime.device)[:, None]
    heads = len(head_kinds(model))
    own_kind = None if not heads else torch.tensor(kind_index, device=runtime.device)

    def step(part: list[int], batch: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        part_pairs = [pairs[i] for i in part]
        chosen, rejected, hidden, input_ids, target = read(model, tokenizer, part_pairs, runtime, config.lm_coef > 0)
        # every mean is over the whole batch's pairs (or chosen tokens), whichever part of it this is
        rows_of = torch.tensor(part, device=runtime.device)
        kinds_of = None if own_kind is None else own_kind[rows_of]
        (chosen, chosen_nll), (rejected, rejected_nll) = (
            own_kind_scores(o, kinds_of, heads) for o in (chosen, rejected)
        )
        loss, preference = debiased_pair_loss(
            chosen,
            rejected,
            chosen_lengths[rows_of],
            rejected_lengths[rows_of],
            weights[rows_of] if weights.dim() else weights,
            config.length_decorrelation,
            config.margin,
            count=len(batch),
            groups=None if members is None else members[:, rows_of],
        )
        metrics = {
            "rm/train_accuracy": (chosen > rejected).float().sum() / len(batch),
            "rm/train_margin": (chosen - rejected).detach().sum() / len(batch),
            "rm/train_length_preference": preference * len(part) / len(batch),
        }
        if heads:  # the gate learns each response's kind: the mean over the batch's responses
            kind_loss = (chosen_nll.sum() + rejected_nll.sum()) / (2 * len(batch))
            loss = loss + kind_loss
            metrics["rm/train_kind_loss"] = kind_loss.detach()
        if config.lm_coef > 0:
            count = sum(chosen_targets[i] for i in batch)
            lm_loss = language_model_loss(_lm_logits(model, hidden), input_ids, target, count)
            loss = loss + config.lm_coef * lm_loss
            metrics["rm/lm_loss"] = lm_loss.detach()
        return loss, metrics

    return step


def _packed_pair_scores(model, tokenizer, pairs: list[tuple[Encoded, Encoded]], runtime: Runtime, targets: bool):
    """``(chosen (P, O), rejected (P, O), hidden, input_ids, chosen-response targets (rows, L) bool or None)``,
    one row a pair: the head's ``O`` outputs at each response's last token (:mod:`rlhf.models.kind_heads`); the targets
    only when ``targets``."""
    packed = pack([[c.input_ids, r.input_ids] for c, r in pairs], tokenizer.pad_token_id, runtime.device)
    hidden = packed_hidden(model, packed)
    outputs = model.score(hidden).float()[packed.row, packed.last]
    outputs = outputs.view(len(pairs), 2, outputs.shape[-1])
    masks = [mask for c, r in pairs for mask in (c.response_mask, [False] * len(r.input_ids))]
    return outputs[:, 0], outputs[:, 1], hidden, packed.input_ids, packed.spread(masks) if targets else None


def _plain_pair_scores(model, tokenizer, pairs: list[tuple[Encoded, Encoded]], runtime: Runtime, targets: bool):
    """As :func:`_packed_pair_scores`, each encoding its own row: the chosen ones, then the rejected ones."""
    rows = [c for c, _ in pairs] + [r for _, r in pairs]
    input_ids, attention_mask = pad(tokenizer, [e.input_ids for e in rows], "right", runtime.device)
    hidden = getattr(model, model.base_model_prefix)(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
    ).last_hidden_state
    last = last_token_index(attention_mask)
    scores = model.score(hidden).float()[torch.arange(len(rows), device=runtime.device), last]
    masks = [c.response_mask for c, _ in pairs] + [[False] * len(r.input_ids) for _, r in pairs]
    target = pad_masks(masks, input_ids.shape[1], "right", runtime.device) if targets else None
    return scores[: len(pairs)], scores[len(pairs) :], hidden, input_ids, target


def frozen_pair_states(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    pairs: list[tuple[Encoded, Encoded]],
    batch_size: int,
    runtime: Runtime,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The states the score head reads, at each pair's chosen and rejected last token, computed once.

    For a reward model that trains its score head alone (``trainable_layers: 0``) the backbone's output does not
    change while it trains, so every epoch can read it from here at the cost of the head's arithmetic (issue 48:
    "frozen blocks' states computed once for every epoch"). They are what :func:`reward_step` would compute
    (the same rows under ``runtime.autocast()``), without a graph. Each distinct sequence is computed once: the
    pairs that share a chosen response (a short rejection's pair and its own, :mod:`rlhf.reward.augment`) are one
    group, the prompt and the chosen response run once for all their rejections
    (:func:`rlhf.models.shared_prompt.group_states`).

    Args:
        pairs: encoded ``(chosen, rejected)`` pairs (:func:`encode_pairs`).
        batch_size: sequences per forward pass (at least one group), as
            :func:`rlhf.models.shared_prompt.score_groups` takes them: on the demo's pairs 16 sequences a pass took
            0.78x the time of 32 (docs/results.md, eighth round).

    Returns:
        ``(chosen, rejected)``: ``(P, H)`` float32 each, on ``runtime.device``; ``H`` the backbone's hidden size.
    """
    groups: dict[tuple[int, ...], list[tuple[int, ...]]] = {}  # each chosen response: it, then its rejections
    for chosen, rejected in pairs:
        members = groups.setdefault(tuple(chosen.input_ids), [tuple(chosen.input_ids)])
        if tuple(rejected.input_ids) not in members:
            members.append(tuple(rejected.input_ids))
    row = {}  # (chosen, member): its row of the states
    for key, members in groups.items():
        for member in members:
            row[key, member] = len(row)
    states = group_states(model, tokenizer, [list(map(list, m)) for m in groups.values()], batch_size, runtime)
    keys = [(tuple(c.input_ids), tuple(r.input_ids)) for c, r in pairs]
    return states[[row[c, c] for c, _ in keys]], states[[row[c, r] for c, r in keys]]


def _cached_pair_scores(states: tuple[torch.Tensor, torch.Tensor], pairs: list[tuple[Encoded, Encoded]]):
    """A reader with :func:`_packed_pair_scores`'s results whose outputs come from the states of
    :func:`frozen_pair_states` (the same pairs, in the same order) through the score head; no hidden, no targets."""
    index = {id(pair): i for i, pair in enumerate(pairs)}

    def read(model, tokenizer, part_pairs, runtime: Runtime, targets: bool):
        rows = torch.tensor([index[id(pair)] for pair in part_pairs], device=runtime.device)
        return model.score(states[0][rows]).float(), model.score(states[1][rows]).float(), None, None, None

    return read


def train_reward_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: list[dict[str, Any]],
    config: RewardConfig,
    log: LogFn,
    runtime: Runtime,
    checkpointer: Checkpointer | None = None,
    progress: bool = True,
) -> dict[str, float]:
    """Train ``model`` in place with the Bradley-Terry loss, plus the optional imitation term.

    Loss: tutorial Eq. 6 (``-log sigmoid(r_w - r_l - margin)``), length-debiased (:mod:`rlhf.reward.length_bias`):
    with ``config.length_expert`` the pair's log-odds add the frozen length expert's
    ``w (log(1 + |y_w|) - log(1 + |y_l|))``, ``w`` fitted on these pairs first
    (:func:`rlhf.reward.length_bias.fit_length_expert`) and dropped afterwards; ``config.length_decorrelation``
    weighs the pairs' preference for the longer (:func:`rlhf.reward.length_bias.length_preference`). With
    ``config.length_by_kind`` both are per kind of data (:func:`rlhf.data.kinds.kind_of`): a weight fitted on each
    kind's pairs, the preference taken within each kind. With ``config.short_rejections`` the examples gain the
    extra pairs of :func:`rlhf.reward.augment.short_rejections` (a short reply of the data as the rejected response, on
    ``config.short_rejection_kinds``), which neither the expert nor the length term reads. The kinds
    ``config.length_decorrelation_exempt`` names take no length term (their expert stays). With
    ``config.balance_kinds`` every batch holds each kind's share of the pairs (the ``strata`` of
    :func:`rlhf.training.supervised.minibatch_indices`). A model with kind heads
    (:func:`rlhf.models.loading.load_scalar_model` given the kinds: :mod:`rlhf.models.kind_heads`) trains each pair's
    own kind's
    score and its kind gate (:func:`reward_step`). Plus
    ``lm_coef`` times the language-model loss on the chosen response (paper Eq. 2, its ``beta_rm``;
    section 4.2 used 1.0). The chosen and rejected sequences of a
    batch go through the model in one right-padded batch.

    Args:
        model: sequence-classification model with one label, initialised from SFT.
        tokenizer: the SFT tokenizer.
        examples: rows with ``prompt``, ``chosen``, ``rejected``.
        config: :class:`RewardConfig`.
        log: ``log(metrics, step)``.
        runtime: device and precision; ``model`` already placed with ``runtime.trained``.
        checkpointer: resume point.

    Returns:
        Summary metrics (``rm/loss_first``, ``rm/loss_last``, ``rm/steps``, ``rm/train_pairs``,
        ``rm/epochs``: pairs seen / training pairs, ``rm/short_rejections``: the extra pairs among them,
        ``rm/length_expert_weight``: 0 without the expert, fitted on all the data's pairs; and
        ``rm/kind/<kind>/length_expert_weight``, each kind's, with several kinds by kind).
    """
    extra = short_rejections(examples, config.short_rejections, config.short_rejection_kinds)
    examples = [*examples, *extra]
    pairs = encode_pairs(tokenizer, examples, config.max_length)
    freeze_lower_layers(model, config.trainable_layers)
    data_kinds = [kind_of(ex) for ex in examples]
    kinds = data_kinds if config.length_by_kind else [DEFAULT_KIND] * len(examples)
    names = sorted(set(kinds))
    groups = [-1 if ex.get(AUGMENTED) else names.index(kind) for ex, kind in zip(examples, kinds, strict=True)]
    chosen_lengths, rejected_lengths = response_lengths(pairs)
    weights = [0.0] * len(names)
    for g in range(len(names) if config.length_expert else 0):
        members = [i for i, group in enumerate(groups) if group == g]
        weights[g] = fit_length_expert([chosen_lengths[i] for i in members], [rejected_lengths[i] for i in members])
    expert = [weights[g] if g >= 0 else 0.0 for g in groups]  # the extra pairs: no expert, no length term
    exempt = set(config.length_decorrelation_exempt)
    term_groups = [-1 if g < 0 or names[g] in exempt else g for g in groups]  # their raters' length preference kept
    heads = head_kinds(model)
    kind_index = [heads.index(kind) for kind in data_kinds] if heads else None
    states = None
    if config.trainable_layers == 0:  # the head alone: the backbone's states once, the final norm's gain with them
        model.requires_grad_(False)
        model.score.requires_grad_(True)
        states = frozen_pair_states(model, tokenizer, pairs, config.eval_batch_size, runtime)
    step = reward_step(
        model,
        tokenizer,
        pairs,
        config,
        runtime=runtime,
        expert_weight=expert,
        groups=term_groups,
        kind_index=kind_index,
        states=states,
    )

    summary = supervised_loop(
        model,
        step,
        len(pairs),
        config,
        prefix="rm",
        log=log,
        runtime=runtime,
        # batches of similar row length: a pair's packed row, or its longer encoding on the plain path
        lengths=[
            packed_length([c.input_ids, r.input_ids]) if can_pack(model) else max(len(c.input_ids), len(r.input_ids))
            for c, r in pairs
        ],
        strata=data_kinds if config.balance_kinds else None,
        checkpointer=checkpointer,
        progress=progress,
    )
    # how much of rm_train the model saw: 1.0 means every pair once
    real = len(pairs) - len(extra)
    overall = fit_length_expert(chosen_lengths[:real], rejected_lengths[:real]) if config.length_expert else 0.0
    return {
        **summary,
        "rm/train_pairs": float(len(pairs)),
        "rm/short_rejections": float(len(extra)),
        "rm/epochs": config.steps * config.batch_size / len(pairs),
        "rm/length_expert_weight": weights[0] if len(names) == 1 else overall,
        **({f"rm/kind/{k}/length_expert_weight": weights[g] for g, k in enumerate(names)} if len(names) > 1 else {}),
    }


def center_rewards(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    demonstrations: list[list[int]],
    batch_size: int,
    runtime: Runtime,
    kinds: list[str] | None = None,
) -> float:
    """Shift the reward model so the mean score of the demonstrations is 0; returns the offset.

    Tutorial stage 2 ("shifted so that their average is 0"; InstructGPT centred
    on its demonstrations). The offset is stored as ``config.reward_offset`` and
    subtracted by :func:`rlhf.models.forward.sequence_scores`, so it travels with the model.

    Args:
        demonstrations: token sequences of prompt + chosen response (the RM training split).
        kinds: each demonstration's kind of data, read with that kind's score as every scored row of the pipeline
            is (:func:`rlhf.models.kind_heads.read_scores`); None: the kind gate's mix.
    """
    model.config.reward_offset = 0.0
    offset = float(score_sequences(model, tokenizer, demonstrations, batch_size, runtime, kinds).mean())
    model.config.reward_offset = offset
    return offset
