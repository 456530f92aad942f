"""Stage 4: compare the policy with the SFT model on held-out prompts, by the proxy and by an independent judge.

The proxy is the reward model PPO optimised: its win rate rises exactly when the policy learns to fool it
(reward hacking; Gao et al. 2023, "Scaling Laws for Reward Model Overoptimization"). The judge is a second
reward model trained on its own split (``tasks/judge.py``) that nothing in training reads; it scores the
response *text* with its own tokenizer, so it may be another backbone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf import likelihood, losses
from rlhf.data.chat import encode_chat, encode_prompt, pad
from rlhf.data.kinds import kind_of
from rlhf.data.ptx import ptx_token_ids
from rlhf.evaluation.by_kind import FIGURES, SCORERS, compare_runs
from rlhf.evaluation.text_measures import distinct_n, is_refusal, refusal_rate
from rlhf.models.forward import response_logprobs
from rlhf.models.generation import GenerationSettings, sample_and_score, treat_unfinished
from rlhf.models.sampling import prompt_seed
from rlhf.models.shared_prompt import score_groups
from rlhf.ranges import check_ranges
from rlhf.runtime.device import PhaseTimer, Runtime, timed
from rlhf.stats import PairedRate, clustered_rate

MODELS = ("sft", "policy")
BASE = "base"  # the third contestant: the model SFT started from, sampled and scored exactly as SFT


@dataclass
class EvalConfig:
    """Evaluation settings (params.yaml section ``evaluate``)."""

    max_prompts: int | None = 32  # N eval prompts, a fair share of each kind (rlhf.evaluation.by_kind.stratified)
    max_new_tokens: int | None = None  # responses' token limit here; None: generation.max_new_tokens (PPO's)
    samples_per_prompt: int = 1  # responses per prompt and model; the interval resamples whole prompts
    batch_size: int = 64  # prompts per sampling call
    max_prompt_length: int = 128
    greedy: bool = False  # greedy decoding instead of sampling at generation.temperature
    samples_in_table: int = 8  # rows of the Markdown sample table in reports/eval/samples.md
    curve_prompts: int = 8  # the first N evaluated prompts (kinds dealt alike): the over-optimisation curve's set
    best_of_n: int = 4  # the largest N of best-of-N on the curve prompts (N = 1, 4, 16, ... up to it); 0: none
    bootstrap_resamples: int = 2000
    judge_max_length: int = 256  # tokens of prompt + response the judge reads (the stage passes its max_length)
    judge_min_length_accuracy: float = 0.35  # below it on either length kind of pair: ranks by length
    ptx_max_length: int = 128  # tokens of a held-out ptx row (the alignment tax's perplexity), as PPO-ptx reads it
    seed: int = 1234

    def __post_init__(self) -> None:
        """Raises ValueError on a count or length below 1, a negative ``best_of_n`` or ``samples_in_table``, or a
        ``judge_min_length_accuracy`` outside [0, 1] (:func:`rlhf.ranges.check_ranges`, naming the key)."""
        check_ranges(
            "evaluate",
            self,
            at_least_1=(
                "max_prompts",
                "max_new_tokens",
                "samples_per_prompt",
                "batch_size",
                "max_prompt_length",
                "curve_prompts",
                "bootstrap_resamples",
                "judge_max_length",
                "ptx_max_length",
            ),
            non_negative=("best_of_n", "samples_in_table"),
            unit=("judge_min_length_accuracy",),
        )


@dataclass
class Scorers:
    """Who scores a response: the proxy (token ids, PPO's tokenizer) and the judge (text, its own tokenizer)."""

    proxy: PreTrainedModel
    judge: PreTrainedModel
    judge_tokenizer: PreTrainedTokenizerBase


@dataclass(frozen=True)
class Sampling:
    """How every response of the evaluation is sampled and scored: who scores, the policy's tokenizer, the
    evaluation's settings, the generation settings PPO used and the device. One object shared by the evaluation
    (:func:`evaluate_policy`, :func:`generate_and_score`), the over-optimisation curve and best-of-N
    (:mod:`rlhf.evaluation.overoptimisation`), instead of the same five arguments at every call. ``timer``, when
    given, sums the seconds of every :func:`generate_and_score` call by phase: ``generation`` (sampling),
    ``reward`` (the proxy's scores), ``logprobs`` (the model's and its reference's, for the KL) and ``judge``."""

    scorers: Scorers
    tokenizer: PreTrainedTokenizerBase
    config: EvalConfig
    settings: GenerationSettings
    runtime: Runtime
    timer: PhaseTimer | None = None


def win_rate(policy_scores: torch.Tensor, baseline_scores: torch.Tensor, resamples: int, seed: int) -> PairedRate:
    """Share of decisive comparisons where the policy's score beats the baseline's, with a 95% interval.

    Ties apart (the product's rule); the interval is a bootstrap over prompts, never narrower than the Wilson
    interval over the prompts with a decisive comparison (:func:`rlhf.stats.clustered_rate`).

    Args:
        policy_scores, baseline_scores: ``(P, K)`` float scores, K samples of each of P prompts.
        resamples, seed: of the bootstrap.

    Raises:
        ValueError: shapes differ or a score is NaN.
    """
    return clustered_rate(policy_scores.cpu(), baseline_scores.cpu(), resamples, seed, what="evaluation prompts")


@torch.no_grad()
def judge_scores(
    sampling: Sampling,
    prompts: list[list[dict]],
    texts: list[str],
    unfinished: torch.Tensor,
    kinds: list[str] | None = None,
) -> torch.Tensor:
    """The judge's score of each response text, after the same unfinished-response rule as the proxy's.

    Each response is encoded as the judge was trained (:func:`rlhf.data.chat.encode_chat` with the judge's
    tokenizer and chat template, read at its EOS), so a truncated response would read as finished: the
    generation section's rule (:func:`rlhf.models.generation.treat_unfinished`) is applied to it as to the proxy's
    score.
    Consecutive responses to the same prompt (the samples of one prompt) are scored as one group, the prompt
    run once (:func:`rlhf.models.shared_prompt.score_groups`).

    Args:
        sampling: the judge (``sampling.scorers``), its reading length and batch size (``sampling.config``), the
            unfinished-response rule (``sampling.settings``) and the device.
        prompts: ``N`` message lists; texts: ``N`` responses; unfinished: ``(N,)`` bool.
        kinds: ``N`` kinds of data, each response read with its kind's score
            (:func:`rlhf.models.kind_heads.read_scores`);
            None: the judge's kind gate.

    Returns:
        ``(N,)`` float32 on the CPU.
    """
    scorers, config = sampling.scorers, sampling.config
    tokenizer = scorers.judge_tokenizer
    groups: list[list[list[int]]] = []
    group_kinds: list[str] = []
    for i, (prompt, text) in enumerate(zip(prompts, texts, strict=True)):
        ids = encode_chat(tokenizer, prompt, [{"role": "assistant", "content": text}], config.judge_max_length)
        if i == 0 or prompt != prompts[i - 1] or (kinds is not None and kinds[i] != kinds[i - 1]):
            groups.append([])
            group_kinds.append(kinds[i] if kinds is not None else "")
        groups[-1].append(ids.input_ids)
    read = group_kinds if kinds is not None else None
    scores = score_groups(scorers.judge, tokenizer, groups, config.batch_size, sampling.runtime, read).float().cpu()
    return treat_unfinished(scores, unfinished.cpu(), sampling.settings)


@torch.no_grad()
def generate_and_score(
    model: PreTrainedModel,
    reference: PreTrainedModel | None,
    prompts: list[list[dict]],
    sampling: Sampling,
    *,
    samples: int = 1,
    first: int = 0,
    kinds: list[str] | None = None,
) -> dict[str, Any]:
    """Sample ``samples`` responses per prompt (or decode greedily) with ``model`` and score them as PPO does, and
    by the judge, as ``sampling`` says (:class:`Sampling`: the scorers, tokenizer, settings and device).

    Prompts are sampled in batches of like length (less padding), the results returned in the input order.
    Sample ``s`` of prompt ``i`` comes from its own generator (:func:`rlhf.models.sampling.prompt_seed` of
    ``config.seed``, ``s``, ``i``), so its random numbers do not depend on the batch size or the prompts beside it
    (in float32 neither does the sample; under bf16 autocast a batch's padding can round a logit differently and
    change a token), and every model sampled on the same prompt draws the same random numbers (SFT and the policy
    are compared on common random numbers; the curve's and best-of-N's first sample of a prompt is the one
    evaluated, taken from the evaluation's run, not drawn again). ``first``: samples
    ``first`` to ``samples - 1`` only (those before are drawn elsewhere); the returned shapes have
    ``samples - first`` columns. ``kinds``: each prompt's kind of data, its responses read with that kind's score
    by the proxy and the judge (:func:`rlhf.models.kind_heads.read_scores`); None: their kind gates.

    Returns:
        ``proxy``, ``judge``, ``kl`` and ``kl_k3`` (nats per response to ``reference``, the k1 and k3 estimates
        summed over the response's tokens; k3 is never negative; NaN, and no forward pass spent on them, when
        ``reference`` is None), ``length`` (tokens): ``(P, samples)`` float32 on the CPU; ``ended``
        ``(P, samples)`` bool; ``texts``: ``P * samples`` strings, prompt-major.
    """
    scorers, tokenizer, config, settings, runtime = (
        sampling.scorers,
        sampling.tokenizer,
        sampling.config,
        sampling.settings,
        sampling.runtime,
    )
    repeated = [p for p in prompts for _ in range(first, samples)]
    repeated_kinds = None if kinds is None else [k for k in kinds for _ in range(first, samples)]
    seeds = [prompt_seed(config.seed, s, i) for i in range(len(prompts)) for s in range(first, samples)]
    encoded = [encode_prompt(tokenizer, p, config.max_prompt_length) for p in repeated]
    temperature = 1.0 if config.greedy else settings.temperature
    out: dict[str, list] = {key: [] for key in ("proxy", "unfinished", "ended", "kl", "kl_k3", "length", "texts")}
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # batches of like length: little padding
    for start in range(0, len(order), config.batch_size):
        with runtime.autocast():
            batch = order[start : start + config.batch_size]
            scored = sample_and_score(
                model,
                scorers.proxy,
                tokenizer,
                [encoded[i] for i in batch],
                settings,
                config.greedy,
                timer=sampling.timer,
                seeds=[seeds[i] for i in batch],
                kinds=[repeated_kinds[i] for i in batch] if repeated_kinds is not None else None,
            )
            rollout = scored.rollout
            ids, attn, begin, mask = (
                rollout.input_ids,
                rollout.attention_mask,
                rollout.response_start,
                rollout.response_mask,
            )
            trunk = scored.trunk
            if reference is not None:
                with timed(sampling.timer, "logprobs"):
                    logprobs, _ = response_logprobs(model, ids, attn, begin, temperature, entry=trunk.entry(model))
                    ref_logprobs = logprobs  # the SFT model against itself: KL 0, computed once
                    if reference is not model:
                        entry = trunk.entry(reference)
                        ref_logprobs, _ = response_logprobs(reference, ids, attn, begin, temperature, entry=entry)
        if reference is None:  # no KL wanted (the base model): no forward pass for it
            out["kl"].append(torch.full((len(ids),), math.nan))
            out["kl_k3"].append(torch.full((len(ids),), math.nan))
        else:
            logratio = logprobs - ref_logprobs
            out["kl"].append(torch.where(mask, losses.kl_k1(logratio), 0.0).sum(-1).float().cpu())
            out["kl_k3"].append(torch.where(mask, losses.kl_k3(logratio), 0.0).sum(-1).float().cpu())
        out["proxy"].append(scored.scores.float().cpu())
        out["unfinished"].append(scored.unfinished.cpu())
        out["ended"].append(rollout.ended.cpu())
        out["length"].append(mask.sum(-1).float().cpu())
        out["texts"] += [tokenizer.decode(ids[i, begin:][mask[i]], skip_special_tokens=True) for i in range(len(ids))]
    back = sorted(range(len(order)), key=order.__getitem__)  # from length order back to the input order
    index = torch.tensor(back, device="cpu")  # the results are on the CPU
    result = {key: torch.cat(value)[index] for key, value in out.items() if key != "texts"}
    texts = [out["texts"][i] for i in back]
    unfinished = result.pop("unfinished")
    with timed(sampling.timer, "judge"):
        result["judge"] = judge_scores(sampling, repeated, texts, unfinished, repeated_kinds)
    shape = (len(prompts), samples - first)
    return {**{key: value.reshape(shape) for key, value in result.items()}, "texts": texts}


@torch.no_grad()
def ptx_perplexity(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    config: EvalConfig,
    runtime: Runtime,
) -> float:
    """Perplexity of ``model`` on held-out ptx text: ``exp`` of the mean NLL over every token (not per row).

    The alignment tax (InstructGPT section 3.5): how much of its language modelling the policy lost. Rows are
    tokenised as PPO-ptx tokenises them (:func:`rlhf.data.ptx.ptx_token_ids`, ``ptx_max_length``).

    Returns:
        Perplexity (>= 1); NaN when ``rows`` is empty.
    """
    sequences = [ptx_token_ids(tokenizer, row, config.ptx_max_length) for row in rows]
    total, count = 0.0, 0
    for start in range(0, len(sequences), config.batch_size):
        ids, mask = pad(tokenizer, sequences[start : start + config.batch_size], "right", runtime.device)
        with runtime.autocast():
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
        logprobs, targets = likelihood.next_token_logprobs(logits, ids, mask.bool())
        total -= float(logprobs[targets].sum())
        count += int(targets.sum())
    return math.exp(total / count) if count else float("nan")


def evaluate_policy(
    sft: PreTrainedModel,
    policy: PreTrainedModel,
    prompts: list[list[dict]],
    ptx_heldout: list[dict[str, Any]],
    sampling: Sampling,
    *,
    base: PreTrainedModel | None = None,
    kinds: list[str] | None = None,
) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """Generate with the SFT model and the policy on the same prompts and compare them, by the proxy and the judge.

    Responses are sampled and scored with PPO's :class:`rlhf.models.generation.GenerationSettings` (same length limit,
    same treatment of a response without EOS). The SFT model is PPO's reference, so the policy's KL to it is
    the sequence-level k1 on the policy's own samples (tutorial Eq. 9's estimate, nats per response). The base
    model, when given, is the third contestant: sampled and scored exactly as SFT (the same prompts, settings
    and per-prompt generators), its KL not computed; SFT's run serves both comparisons
    (:func:`rlhf.evaluation.by_kind.kind_figures` reads them per kind).

    Args:
        sft, policy: causal LMs, with dropout off, already on ``sampling.runtime``'s device.
        prompts: message lists (each ends with a user turn); the first ``config.max_prompts``.
        ptx_heldout: held-out ptx rows (``{"messages"}`` or ``{"text"}``) for the perplexity.
        sampling: :class:`Sampling`: the proxy and the judge (dropout off), the policy's tokenizer,
            :class:`EvalConfig` (``config`` below), the shared generation settings, the device and precision.
        base: the model SFT was trained from (``models/base``), or None; ``sft`` itself where there was no SFT
            (``sft.steps`` 0): not sampled again, its run is SFT's (every comparison of the two a tie).
        kinds: each prompt's kind of data, its responses read with that kind's score (:func:`generate_and_score`).

    Returns:
        ``(metrics, runs)``: for S in (proxy, judge) ``eval/S/win_rate`` with ``_low``/``_high`` (95%, bootstrap
        over prompts), ``eval/S/decisive``, ``eval/S/ties``, ``eval/S/{sft,policy}_score`` (means);
        ``eval/S/score_diff`` with ``_low``/``_high`` (policy minus SFT score, the mean over prompts of each
        prompt's mean difference, in S's units; :func:`rlhf.evaluation.comparison.paired_difference`);
        ``eval/S/lc_win_rate`` with ``_low``/``_high`` (the win rate at equal response length, ties apart;
        :func:`rlhf.evaluation.comparison.length_controlled_rate` on the ``length`` in tokens) and
        ``eval/S/lc_length_coef``
        (its log-odds coefficient of the tanh-standardised length difference; > 0: S prefers the longer
        response); every interval 95%, a bootstrap over prompts (``config.bootstrap_resamples``,
        ``config.seed``). For M in (sft, policy) ``eval/M/{length,eos_rate,truncated_share,distinct_1,distinct_2,
        refusal_rate,ptx_perplexity}`` (``truncated_share``: cut at ``max_new_tokens``, ``1 - eos_rate``);
        ``eval/policy/kl``, ``eval/prompts``, ``eval/samples_per_prompt``, ``eval/identical_responses`` (the
        policy's responses that are SFT's text, ties by construction: :func:`tie_identical_responses`). With a
        base model also ``eval/base/...`` as for M, ``eval/S/base_score`` and ``eval/base/identical_responses``
        (its responses that are SFT's text). ``runs``: each model's :func:`generate_and_score` result (``sft``,
        ``policy``, ``base``).

    Raises:
        ValueError: no prompts.
    """
    if not prompts:
        raise ValueError("no evaluation prompts")
    scorers, config = sampling.scorers, sampling.config
    prompts = prompts[: config.max_prompts]
    kinds = kinds[: config.max_prompts] if kinds is not None else None
    models = {"sft": sft, "policy": policy} | ({BASE: base} if base is not None else {})
    for model in (*models.values(), scorers.proxy, scorers.judge):
        model.eval()
    k = config.samples_per_prompt
    references = {"sft": sft, "policy": sft, BASE: None}  # the base model's KL is not wanted: not computed
    runs = {
        name: generate_and_score(model, references[name], prompts, sampling, samples=k, kinds=kinds)
        for name, model in models.items()
        if not (name == BASE and base is sft)  # no SFT (sft.steps 0): the base model is SFT, its run is SFT's
    }
    if base is sft:
        runs[BASE] = {**runs["sft"], "kl": torch.full_like(runs["sft"]["kl"], math.nan)}
        runs[BASE]["kl_k3"] = runs[BASE]["kl"]
    metrics = {
        "eval/prompts": float(len(prompts)),
        "eval/samples_per_prompt": float(k),
        "eval/identical_responses": float(tie_identical_responses(runs)),
    }
    if BASE in runs:
        metrics["eval/base/identical_responses"] = float(tie_identical_responses(runs, BASE))
    figures = compare_runs(runs["policy"], runs["sft"], config.bootstrap_resamples, config.seed, warn_ties=True)
    for scorer in SCORERS:
        metrics |= {f"eval/{scorer}/{name}": figures[f"{scorer}_{name}"] for name in FIGURES}
        metrics |= {f"eval/{scorer}/{name}_score": float(runs[name][scorer].mean()) for name in runs}
    for name, model in models.items():
        texts = runs[name]["texts"]
        metrics |= {
            f"eval/{name}/length": float(runs[name]["length"].mean()),
            f"eval/{name}/eos_rate": float(runs[name]["ended"].float().mean()),
            f"eval/{name}/truncated_share": float((~runs[name]["ended"]).float().mean()),  # cut at max_new_tokens
            f"eval/{name}/distinct_1": distinct_n(texts, 1),
            f"eval/{name}/distinct_2": distinct_n(texts, 2),
            f"eval/{name}/refusal_rate": refusal_rate(texts),
            f"eval/{name}/ptx_perplexity": ptx_perplexity(
                model, sampling.tokenizer, ptx_heldout, config, sampling.runtime
            ),
        }
    metrics["eval/policy/kl"] = float(runs["policy"]["kl"].mean())
    return metrics, runs


def tie_identical_responses(runs: dict[str, dict[str, Any]], other: str = "policy") -> int:
    """Give ``other``'s response (the policy's, or the base model's) SFT's proxy and judge scores wherever it is
    the same text, in place; SFT's own scores are untouched.

    The same response is scored twice, once in each model's batches: under bf16 the other rows' padding moves a
    score by a few thousandths, and that noise must not decide a comparison (the demo's 15 responses the policy
    left as SFT wrote them gave the proxy 11 "decisive" comparisons). Scores are ``(P, samples)``; ``texts``
    prompt-major, as :func:`generate_and_score` returns them.

    Returns:
        How many responses are identical (each is a tie by both scorers).
    """
    same = [a == b for a, b in zip(runs[other]["texts"], runs["sft"]["texts"], strict=True)]
    mask = torch.tensor(same, device=runs["sft"]["proxy"].device).reshape(runs["sft"]["proxy"].shape)
    for scorer in SCORERS:
        runs[other][scorer] = torch.where(mask, runs["sft"][scorer], runs[other][scorer])
    return sum(same)


def sample_rows(prompts: list[dict[str, Any]], runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per prompt and sample: the prompt and its kind, each model's response, its proxy and judge scores,
    whether it ended (EOS before max_new_tokens) and whether it refuses
    (:func:`rlhf.evaluation.text_measures.is_refusal`); ``complied_where_declined`` where the policy answered what
    SFT or the base model declined. Those rows come first (a policy that learned to give
    a red-team request what its start refused is what a reader must see), the rest in the prompts' order.

    Args:
        prompts: the evaluated prompt rows (``{"id", "prompt", "kind"}``), in the order :func:`evaluate_policy`
            used.
        runs: its ``runs`` (``sft``, ``policy`` and, when evaluated, ``base``: ``base_response`` and its scores).
    """
    rows = []
    k = runs["sft"]["proxy"].shape[1]
    for i, row in enumerate(prompts):
        for j in range(k):
            cell = {"id": row["id"], "kind": kind_of(row), "sample": j, "messages": row["prompt"]}
            cell["prompt"] = row["prompt"][-1]["content"]
            for name in [m for m in (*MODELS, BASE) if m in runs]:
                cell[f"{name}_response"] = runs[name]["texts"][i * k + j]
                cell[f"{name}_proxy"] = float(runs[name]["proxy"][i, j])
                cell[f"{name}_judge"] = float(runs[name]["judge"][i, j])
                cell[f"{name}_refused"] = is_refusal(cell[f"{name}_response"])
                cell[f"{name}_ended"] = bool(runs[name]["ended"][i, j])  # False: cut at max_new_tokens, no EOS
            declined = cell["sft_refused"] or cell.get(f"{BASE}_refused", False)
            cell["complied_where_declined"] = declined and not cell["policy_refused"]
            rows.append(cell)
    return sorted(rows, key=lambda cell: not cell["complied_where_declined"])  # stable: the rest keep their order
