"""``rlhf-model score-pairs``: score any reward model on any file of preference pairs and print its figures.

The pairs are read as the prepare stage reads ``data.source`` (:func:`rlhf.data.reading.read_jsonl`, any fsspec path,
compressed or not; each row parsed by :func:`rlhf.data.formats.to_examples`, so HH text rows, prompt/chosen/rejected,
conversational and ranking rows all work), then scored by :func:`rlhf.reward.metrics.evaluate_reward_model`, the
function the reward and gate stages measure with, so the figures are the ones those stages report. Unlike
prepare, a row that does not parse is not quarantined: it stops the command with one line naming the file, the
line and the rule (:class:`PairsError`), unless ``--skip-bad-rows`` leaves it out (counted and named). The
command itself (its options) is in :mod:`tasks.cli.model`.
"""

from __future__ import annotations

import json
import math
from itertools import islice
from typing import Any

from rlhf.data.formats import FORMATS, RowError, check_prompt_visible, to_examples
from rlhf.data.kinds import DEFAULT_KIND
from rlhf.data.reading import read_jsonl
from rlhf.data.sources import source_name

DEFAULT_MAX_LENGTH = 1024
"""Tokens per prompt + response when the model's config holds no ``reward_max_length``."""

HEADLINE = {
    "rm/accuracy",
    "rm/accuracy_low",
    "rm/accuracy_high",
    "rm/pairs",
    "rm/ties",
    "rm/balanced_accuracy",
    "rm/balanced_accuracy_low",
    "rm/balanced_accuracy_high",
    "rm/length_baseline_accuracy",
    "rm/length_baseline_pairs",
    "rm/accuracy_chosen_shorter",
    "rm/pairs_chosen_shorter",
    "rm/accuracy_chosen_longer",
    "rm/pairs_chosen_longer",
}
"""Figures :func:`metric_lines` prints on their own lines; every other figure follows, one per line."""


class PairsError(ValueError):
    """A bad pairs file, row, mapping, length or model for ``score-pairs``; the message is the one line printed."""


def parse_mapping(text: str | None) -> dict[str, str] | None:
    """The ``--mapping`` option: a JSON object renaming a row's keys (``{"question": "prompt"}``), or None.

    Raises:
        PairsError: not a JSON object of strings to strings.
    """
    if text is None:
        return None
    try:
        mapping = json.loads(text)
    except json.JSONDecodeError as err:
        raise PairsError(f"--mapping: invalid JSON: {err.msg}") from None
    if not isinstance(mapping, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
        raise PairsError('--mapping: must be a JSON object of key names, e.g. {"question": "prompt"}')
    return mapping


def read_pairs(
    path: str,
    fmt: str = "auto",
    mapping: dict[str, str] | None = None,
    max_rows: int | None = None,
    skip_bad_rows: bool = False,
    kind: str | None = None,
    kind_field: str = "kind",
) -> tuple[list[dict[str, Any]], int, list[str]]:
    """Preference examples ``{"prompt", "chosen", "rejected"}`` (message lists) of a pairs file, each with the
    ``source`` it came from (:func:`rlhf.data.sources.source_name` of the path) and, where known, its ``kind``: the
    row's
    ``kind_field`` (after ``mapping``), else ``kind``; the figures are then also given per kind
    (:mod:`rlhf.data.kinds`).

    Args:
        path: any path :func:`rlhf.data.reading.read_jsonl` reads (local, ``s3://``, ``hf://``; gzip, bz2, xz, zstd).
        fmt: one of :data:`rlhf.data.formats.FORMATS` (``auto`` detects each row's format).
        mapping: renames each row's keys before parsing.
        max_rows: read at most this many rows (a ranking row gives several pairs); None reads all.
        skip_bad_rows: leave out a row that does not parse (as prepare quarantines it) instead of stopping.
        kind: the kind of the file's rows that name none (None: no kind).
        kind_field: the row key that holds a row's kind.

    Returns:
        ``(examples, rows_read, left_out)``: ``left_out`` holds one ``FILE:LINE: rule`` line per row left out.

    Raises:
        PairsError: an unknown format, the first row that does not parse (unless ``skip_bad_rows``), as
            ``FILE:LINE: rule`` (the parser's :class:`rlhf.data.formats.RowError` message), or a file with no rows
            (left).
        FileNotFoundError: no such file.
    """
    if fmt not in FORMATS:
        raise PairsError(f"--format {fmt}: not one of {', '.join(FORMATS)}")
    rows = read_jsonl(path)
    examples, read, left_out = [], 0, []
    source = source_name(path)
    for line, row in islice(rows, max_rows) if max_rows else rows:
        read += 1
        try:
            parsed = to_examples(row, fmt, mapping)
            for example in parsed:
                check_prompt_visible(example["prompt"])
            renamed = {new: row[old] for old, new in (mapping or {}).items() if old in row}
            row_kind = {**row, **renamed}.get(kind_field) if isinstance(row, dict) else None
            if row_kind is not None and (not isinstance(row_kind, str) or not row_kind or "/" in row_kind):
                raise RowError(f"field {kind_field!r} is {row_kind!r}, not a kind name (a string without '/')")
            labels = {"source": source, **({"kind": row_kind or kind} if (row_kind or kind) else {})}
            examples.extend({**example, **labels} for example in parsed)
        except RowError as err:
            if not skip_bad_rows:
                raise PairsError(f"{path}:{line}: {err} (--skip-bad-rows leaves such rows out)") from None
            left_out.append(f"{path}:{line}: {err}")
    if not examples:
        raise PairsError(f"{path}: no rows" + (f" left after {len(left_out)} that do not parse" if left_out else ""))
    return examples, read, left_out


def file_kinds(paths: list[str], kinds: list[str] | None) -> list[str | None]:
    """The kind of each pairs file's rows that name none: ``kinds`` in order, else each file's name
    (:func:`rlhf.data.sources.source_name`) when there are several files, else None.

    Raises:
        PairsError: ``kinds`` given, but not one per file, or one is not a kind name.
    """
    if kinds:
        if len(kinds) != len(paths):
            raise PairsError(f"--kind: {len(kinds)} given for {len(paths)} files; give one per file, in order")
        bad = [k for k in kinds if not k or "/" in k]
        if bad:
            raise PairsError(f"--kind {bad[0]!r}: not a kind name (a non-empty string without '/')")
        return list(kinds)
    return [source_name(path) for path in paths] if len(paths) > 1 else [None] * len(paths)


def load_reward_model(folder: str, max_length: int | None = None):
    """``(model, tokenizer, max_length)`` of a reward-model folder: :func:`rlhf.models.loading.load_scalar_model`
    (safetensors only; eval mode, CPU), :func:`rlhf.models.loading.load_tokenizer` and the tokens per prompt + response
    (:func:`max_length_for`). Everything is checked before the weights load.

    Raises:
        PairsError: the folder holds no sequence-classification model with one output, or kind heads
            (:mod:`rlhf.models.kind_heads`) (a policy's folder would
            get a new, random head and meaningless figures), its tokenizer has no chat template, or ``max_length``
            is more than the model's positions.
        ValueError: a weight is NaN or infinite, or the pad token equals EOS (the loaders' messages name the folder).
    """
    from transformers import AutoConfig

    from rlhf.models.kind_heads import head_kinds, output_count
    from rlhf.models.loading import load_scalar_model, load_tokenizer

    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    architectures = config.architectures or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        raise PairsError(
            f"{folder}: not a reward model ({', '.join(architectures) or 'no architecture'}); give a scalar "
            "sequence-classification model (e.g. models/reward or models/judge)"
        )
    kinds = head_kinds(config)
    if config.num_labels != output_count(kinds):
        expected = (
            f"{output_count(kinds)} (a score and a gate logit for each of {', '.join(kinds)})" if kinds else "one"
        )
        raise PairsError(f"{folder}: the model has {config.num_labels} outputs; a reward model has {expected}")
    tokenizer = load_tokenizer(folder)
    if not tokenizer.chat_template:
        raise PairsError(f"{folder}: the tokenizer has no chat template (pairs are encoded with it)")
    length = max_length_for(config, tokenizer, max_length)
    return load_scalar_model(folder).eval(), tokenizer, length


def max_length_for(config, tokenizer, given: int | None) -> int:
    """Tokens per prompt + response: ``given``, else the model config's ``reward_max_length``, else
    :data:`DEFAULT_MAX_LENGTH`; a default is lowered to the tokenizer's ``model_max_length`` and the model's
    ``max_position_embeddings`` when they are smaller (longer sequences lose their oldest tokens).

    Args:
        config: the model's ``PretrainedConfig``.

    Raises:
        PairsError: ``given`` is more than the model's positions.
    """
    positions = getattr(config, "max_position_embeddings", None)
    if given is not None:
        if positions and given > positions:
            raise PairsError(f"--max-length {given}: the model has only {positions} positions")
        return given
    limits = [getattr(config, "reward_max_length", None) or DEFAULT_MAX_LENGTH, positions]
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tokenizer_limit, int) and tokenizer_limit < 1 << 30:  # transformers' "no limit" is ~1e30
        limits.append(tokenizer_limit)
    return int(min(limit for limit in limits if limit))


def score(model, tokenizer, examples: list[dict[str, Any]], max_length: int, batch_size: int) -> dict[str, float]:
    """The metrics of :func:`rlhf.reward.metrics.evaluate_reward_model` on ``examples`` (CPU, float32).

    Returns:
        ``rm/...`` name -> float (NaN where undefined, e.g. every pair tied), in the order returned.
    """
    import torch

    from rlhf.reward.metrics import evaluate_reward_model
    from rlhf.runtime.device import Runtime

    metrics, _ = evaluate_reward_model(model, tokenizer, examples, max_length, batch_size, Runtime(torch.device("cpu")))
    return {name: float(value) for name, value in metrics.items()}


def _interval(metrics: dict[str, float], name: str, kind: str) -> str:
    """``0.583 [0.516, 0.647] (<kind> 95%)``, or the rate alone when its bounds are not there."""
    low, high = metrics.get(f"{name}_low"), metrics.get(f"{name}_high")
    bounds = f" [{low:.3f}, {high:.3f}] ({kind} 95%)" if low is not None and high is not None else ""
    return f"{metrics[name]:.3f}{bounds}"


def metric_lines(metrics: dict[str, float]) -> list[str]:
    """The printed block: accuracy with its Wilson interval, decisive pairs and ties; balanced accuracy with its
    interval (:func:`rlhf.reward.length_bias.balanced_accuracy`) and the length baseline when present; the
    chosen-shorter and chosen-longer accuracies with their counts; then every other figure, one per line, in
    the order given; last, when the balanced accuracy's interval (the accuracy's, without one) includes chance or
    lies below it, a ``WARNING:`` line (:func:`rlhf.stats.chance_warning`), as the reward gate reads it.

    Args:
        metrics: what :func:`score` returns (a missing optional figure is left out, never an error).
    """
    from rlhf.stats import chance_warning

    lines = []
    if "rm/accuracy" in metrics:
        lines.append(
            f"accuracy           {_interval(metrics, 'rm/accuracy', 'Wilson')} over "
            f"{metrics.get('rm/pairs', math.nan):.0f} decisive pairs, {metrics.get('rm/ties', math.nan):.0f} ties "
            "left out"
        )
    if "rm/balanced_accuracy" in metrics:
        lines.append(
            f"balanced accuracy  {_interval(metrics, 'rm/balanced_accuracy', 'stratified bootstrap')}"
            ", the mean of chosen shorter and chosen longer"
        )
    if "rm/length_baseline_accuracy" in metrics:
        over = metrics.get("rm/length_baseline_pairs")
        lines.append(
            f"length baseline    {metrics['rm/length_baseline_accuracy']:.3f} (the accuracy of preferring the shorter "
            f"response{f' over {over:.0f} pairs of unequal length' if over is not None else ''})"
        )
    for name in ("shorter", "longer"):
        if f"rm/accuracy_chosen_{name}" in metrics:
            count = metrics.get(f"rm/pairs_chosen_{name}", math.nan)
            lines.append(f"chosen {name:<11} {metrics[f'rm/accuracy_chosen_{name}']:.3f} (n={count:.0f})")
    rest = {k: v for k, v in metrics.items() if k not in HEADLINE and not k.startswith(("rm/kind/", "rm/source/"))}
    width = max(map(len, rest), default=0)
    lines += [f"{k:<{width}}  {v:.4g}" for k, v in rest.items()]
    kind = "balanced_accuracy" if "rm/balanced_accuracy" in metrics else "accuracy"  # as the reward gate reads
    if f"rm/{kind}" in metrics:
        warning = chance_warning(
            kind.replace("_", " "), *(metrics.get(f"rm/{kind}{end}") for end in ("", "_low", "_high"))
        )
        if warning:
            lines.append(f"WARNING: {warning}: the model does not rank these pairs better than chance")
    return lines


def part_blocks(metrics: dict[str, float]) -> list[str]:
    """One block per kind and per source of the metrics (``rm/kind/<kind>/...``, ``rm/source/<name>/...``,
    :mod:`rlhf.data.kinds`): a ``kind <kind>:`` head line, then :func:`metric_lines` of its figures, indented; none
    when the only kind is :data:`rlhf.data.kinds.DEFAULT_KIND` (no row named one)."""
    lines = []
    for part in ("kind", "source"):
        head = f"rm/{part}/"
        names = sorted({k[len(head) :].split("/", 1)[0] for k in metrics if k.startswith(head)})
        if names == [DEFAULT_KIND]:
            continue  # rows that name no kind: the block would repeat the whole file's
        for name in names:
            prefix = f"{head}{name}/"
            figures = {"rm/" + k[len(prefix) :]: v for k, v in metrics.items() if k.startswith(prefix)}
            lines.append(f"{part} {name}:")
            lines += [f"  {line}" for line in metric_lines(figures)]
    return lines


def json_metrics(metrics: dict[str, float]) -> dict[str, float | None]:
    """The metrics as written by ``--json``: NaN and infinities become null, as in the stages' metrics files."""
    return {k: v if math.isfinite(v) else None for k, v in metrics.items()}
