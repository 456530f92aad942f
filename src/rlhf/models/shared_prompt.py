"""One prompt, several responses: token sequences that begin alike go through a model as one row.

A preference pair's chosen and rejected encodings, or several responses to one prompt, start with the same
tokens (the prompt, often a multi-turn HH conversation, and the response's first words). :func:`pack` lays
such a group out as one row: the common prefix once, then each sequence's own suffix. A block causal mask
lets each suffix attend to the prefix and to itself only, and each suffix's position ids restart where the
prefix ends, so every token attends to exactly the tokens, at exactly the positions, it has in its own
sequence: the hidden states are those of the plain pass, the prefix computed once (its gradient is the sum of
what each sequence gives it, as in the plain pass). A group whose members share no first token is laid out
one sequence per row, the plain causal layout. What is shared is read from the token ids, never assumed: a
sequence cut from the left differs from its partner at its first token and so goes alone.

The rows are right-padded; a pad attends to the pads before it (never read, and never attended to). The
block mask is a 4D boolean mask, which transformers hands to the attention as it is; only Llama backbones
with PyTorch's SDPA attention take it (:func:`can_pack`), others score each sequence alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaModel, PreTrainedModel, PreTrainedTokenizerBase

from rlhf.data.chat import pad
from rlhf.losses import last_token_index
from rlhf.models.forward import position_ids_from_mask, scores_from_states
from rlhf.models.trunk import last_hidden_state
from rlhf.runtime.device import Runtime


def common_prefix(sequences: list[list[int]]) -> int:
    """The number of leading tokens all ``sequences`` share (0 for one sequence: nothing to share)."""
    if len(sequences) < 2:
        return 0
    shortest = min(len(s) for s in sequences)
    for position in range(shortest):
        token = sequences[0][position]
        if any(s[position] != token for s in sequences[1:]):
            return position
    return shortest


def packed_length(group: list[list[int]]) -> int:
    """The length of the row :func:`pack` lays ``group`` out in (of all its rows, when its members go alone)."""
    return sum(map(len, group)) - common_prefix(group) * (len(group) - 1)


@dataclass
class Packed:
    """Groups of token sequences laid out in rows (:func:`pack`).

    ``input_ids``, ``position_ids``: ``(B, L)`` int64; ``attention_mask``: ``(B, 1, L, L)`` bool, True where a
    query (row 2) may attend to a key (row 3); ``row``, ``last``: ``(N,)`` int64, the row and the position of
    each sequence's last token, in the order of the groups and their members; ``positions``: per sequence, the
    row positions of its tokens in order (host-side), for masks over its tokens (:meth:`spread`).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    row: torch.Tensor
    last: torch.Tensor
    positions: list[list[int]]

    def spread(self, masks: list[list[bool]]) -> torch.Tensor:
        """Per-sequence token masks ``masks[n]`` (``len`` = sequence ``n``'s length) placed in the rows:
        ``(B, L)`` bool, False elsewhere. A prefix position is True when it is True in any sequence sharing it."""
        out = torch.zeros(self.input_ids.shape, dtype=torch.bool)
        rows = self.row.tolist()
        for n, mask in enumerate(masks):
            where = [p for p, keep in zip(self.positions[n], mask, strict=True) if keep]
            out[rows[n], where] = True
        return out.to(self.input_ids.device)


def pack(groups: list[list[list[int]]], pad_token_id: int, device: torch.device) -> Packed:
    """Lay out each group of sequences as one row: their common prefix once, then each one's suffix.

    Args:
        groups: each a list of token sequences (non-empty); members without a common first token each get
            a row of their own.
        pad_token_id: fills the rows' right padding.
        device: where the tensors are made.

    Returns:
        :class:`Packed`; sequence ``n`` (counted over the groups in order) is read at ``(row[n], last[n])``.
    """
    rows: list[list[int]] = []
    position_rows: list[list[int]] = []
    segments: list[list[int]] = []  # 0: the shared prefix (or a sequence alone), k: the k-th member's suffix
    owners: list[tuple[int, int]] = []
    where: list[list[int]] = []
    for group in groups:
        shared = common_prefix(group)
        for members in [group] if shared else [[sequence] for sequence in group]:
            prefix = shared if shared else len(members[0])
            ids, pos, seg = list(members[0][:prefix]), list(range(prefix)), [0] * prefix
            for k, sequence in enumerate(members, 1):
                suffix = sequence[prefix:]
                begin = len(ids)
                ids += suffix
                pos += range(prefix, len(sequence))
                seg += [k] * len(suffix)
                owners.append((len(rows), len(ids) - 1 if suffix else prefix - 1))
                where.append(list(range(prefix)) + list(range(begin, len(ids))))
            rows.append(ids)
            position_rows.append(pos)
            segments.append(seg)
    length = max(len(r) for r in rows)
    padding = [length - len(r) for r in rows]
    input_ids = torch.tensor([r + [pad_token_id] * n for r, n in zip(rows, padding, strict=True)], device=device)
    position_ids = torch.tensor([p + [0] * n for p, n in zip(position_rows, padding, strict=True)], device=device)
    segment = torch.tensor([s + [-1] * n for s, n in zip(segments, padding, strict=True)], device=device)
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    same = segment[:, :, None] == segment[:, None, :]
    to_prefix = (segment[:, None, :] == 0) & (segment[:, :, None] >= 0)
    mask = (causal & (same | to_prefix))[:, None]
    row, last = (torch.tensor(column, device=device) for column in zip(*owners, strict=True))
    return Packed(input_ids, position_ids, mask, row, last, where)


def can_pack(model: PreTrainedModel) -> bool:
    """Whether ``model`` takes a packed batch: a Llama backbone with SDPA attention (which reads a 4D boolean
    mask as given)."""
    backbone = getattr(model, getattr(model, "base_model_prefix", ""), None)
    return isinstance(backbone, LlamaModel) and model.config._attn_implementation == "sdpa"


def packed_hidden(model: PreTrainedModel, packed: Packed) -> torch.Tensor:
    """The backbone's final hidden states over a packed batch: ``(B, L, H)``."""
    backbone = getattr(model, model.base_model_prefix)
    return backbone(
        input_ids=packed.input_ids, attention_mask=packed.attention_mask, position_ids=packed.position_ids
    ).last_hidden_state


@torch.no_grad()
def sequence_states(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sequences: list[list[int]],
    batch_size: int,
    runtime: Runtime,
) -> torch.Tensor:
    """The backbone's final (normed) hidden state at the last token of each sequence, each a plain right-padded row.

    Batches of ``batch_size`` are formed from length-sorted sequences so little compute goes to padding, under
    ``runtime.autocast()``.

    Returns:
        ``(N, H)`` float32 on ``runtime.device``, in the input order; ``H`` the backbone's hidden size.
    """
    states = torch.zeros(len(sequences), model.config.hidden_size, device=runtime.device)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        input_ids, attention_mask = pad(tokenizer, [sequences[i] for i in chunk], "right", runtime.device)
        with runtime.autocast():
            hidden = last_hidden_state(model, input_ids, attention_mask, position_ids_from_mask(attention_mask))
        states[chunk] = hidden[
            torch.arange(len(chunk), device=runtime.device), last_token_index(attention_mask)
        ].float()
    return states


@torch.no_grad()
def score_sequences(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sequences: list[list[int]],
    batch_size: int,
    runtime: Runtime,
    kinds: list[str] | None = None,
) -> torch.Tensor:
    """Reward-model scores of token sequences, ``(N,)`` float32 on ``runtime.device``, in the input order.

    The score head (:func:`rlhf.models.forward.scores_from_states`) reads :func:`sequence_states`. ``kinds``: each
    sequence's kind of data; None: the kind gate's mix.
    """
    model.eval()
    states = sequence_states(model, tokenizer, sequences, batch_size, runtime)
    with runtime.autocast():
        return scores_from_states(model, states, kinds)


@torch.no_grad()
def group_states(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    groups: list[list[list[int]]],
    batch_size: int,
    runtime: Runtime,
) -> torch.Tensor:
    """The backbone's final (normed) hidden state at the last token of each member of groups that begin alike.

    Each group is one row, its common prefix run once (:func:`pack`); groups are sorted by their row's length and
    batched ``batch_size`` sequences a pass (at least one group), under ``runtime.autocast()``. Where the model
    cannot take a packed row (:func:`can_pack`), :func:`sequence_states` reads each sequence as a plain row.

    Returns:
        ``(N, H)`` float32 on ``runtime.device``: every group's members in order, the groups in the input order;
        ``H`` the backbone's hidden size.
    """
    flat = [sequence for group in groups for sequence in group]
    if not can_pack(model):
        return sequence_states(model, tokenizer, flat, batch_size, runtime)
    states = torch.zeros(len(flat), model.config.hidden_size, device=runtime.device)
    first = [0]
    for group in groups:
        first.append(first[-1] + len(group))
    order = sorted(range(len(groups)), key=lambda g: packed_length(groups[g]))
    start = 0
    while start < len(order):
        stop = start + 1
        while stop < len(order) and sum(len(groups[g]) for g in order[start : stop + 1]) <= batch_size:
            stop += 1
        chunk = order[start:stop]
        packed = pack([groups[g] for g in chunk], tokenizer.pad_token_id, runtime.device)
        with runtime.autocast():
            hidden = packed_hidden(model, packed)
        states[[i for g in chunk for i in range(first[g], first[g + 1])]] = hidden[packed.row, packed.last].float()
        start = stop
    return states


@torch.no_grad()
def score_groups(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    groups: list[list[list[int]]],
    batch_size: int,
    runtime: Runtime,
    kinds: list[str] | None = None,
) -> torch.Tensor:
    """Reward-model scores of token sequences in groups that begin alike (a pair, one prompt's responses).

    The score head (:func:`rlhf.models.forward.scores_from_states`) reads :func:`group_states` (each group one
    row, its common prefix run once; plain rows where the model cannot take a packed one). ``kinds``: each group's
    kind of data, its members read with that kind's score; None: the kind gate's mix.

    Returns:
        ``(N,)`` float32 on ``runtime.device``: every group's members in order, the groups in the input order.
    """
    flat_kinds = None if kinds is None else [kind for group, kind in zip(groups, kinds, strict=True) for _ in group]
    model.eval()
    states = group_states(model, tokenizer, groups, batch_size, runtime)
    with runtime.autocast():
        return scores_from_states(model, states, flat_kinds)
