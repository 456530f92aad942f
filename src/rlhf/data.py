"""Preference data: reading rows from any fsspec path, parsing them into chat messages, splitting.

A preference example is ``{"id", "source", "kind", "prompt", "chosen", "rejected"}`` where
``prompt``, ``chosen`` and ``rejected`` are lists of ``{"role", "content"}``
messages (the conversational format of transformers' chat templates). The
prompt ends with a user turn; each response is what follows it (usually one
assistant message). Splits are made by a hash of the conversation's root (its
first user turn), so one conversation, cut at any turn, never reaches two splits, with one exception made
on purpose: the pairs of the ``eval_prompts`` conversations are also ``rm_eval``'s and ``judge_eval``'s
(:data:`HELD_OUT_PAIRS`; none of these splits trains anything).

PPO-ptx rows (splits ``ptx_text`` and ``ptx_heldout``) are either
``{"id", "source", "kind", "messages": [{"role", "content"}, ...]}`` (a conversation,
tokenised with the chat template) or ``{"id", "source", "kind", "text": str}`` (plain
pretraining text, tokenised as text + EOS); see :func:`ptx_token_ids`.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import fsspec
import fsspec.compression

from rlhf.formats import Message, RowError, as_messages, to_examples, visible_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


SPLITS = (
    "sft",
    "rm_train",
    "rm_eval",
    "ppo_prompts",
    "ptx_text",
    "ptx_heldout",
    "eval_prompts",
    "judge_train",
    "judge_eval",
)
"""Files of data/processed and data/validated. ``data.fractions`` names every split but ``ptx_heldout``,
which is a share (``data.ptx_heldout_fraction``) of the ptx rows."""

HELD_OUT_PAIRS = {"eval_prompts": ("rm_eval", "judge_eval")}
"""Prompt splits whose whole pairs also go to splits that only measure. Evaluation reads only the prompts of
``eval_prompts`` (the policy and SFT answer them; the proxy and the judge score those answers), never their
chosen or rejected responses, and neither the reward model nor the judge trains on its eval split: measuring
both on these pairs too gives the gate and the judge more held-out pairs (the demo: rm_eval 382 prepared instead
of 214, judge_eval 297 instead of 129), and no split that trains sees them. ``ppo_prompts`` is not one: PPO
trains on its prompts."""


_MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bz2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"))
"""Compression recognised from a file's first bytes (a JSON line starts with ``{``, never with these)."""
_ARCHIVES = (
    (0, b"PK\x03\x04", "zip"),
    (0, b"PK\x05\x06", "zip"),  # an empty zip
    (0, b"7z\xbc\xaf\x27\x1c", "7z"),
    (0, b"Rar!\x1a\x07", "rar"),
    (257, b"ustar\x00", "tar"),  # POSIX tar: the magic at byte 257 of the first header
    (257, b"ustar ", "tar"),  # GNU tar
)
"""Archives recognised from a file's first bytes: several files in a container, never JSON lines to read."""
HEAD_BYTES = 263  # enough to see every magic above


class _Prefixed(io.RawIOBase):
    """A read-only stream: ``head`` (bytes already read to sniff the format), then the rest of ``raw``."""

    def __init__(self, head: bytes, raw: Any) -> None:
        self._head, self._raw = head, raw

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._head[: len(buffer)] if self._head else self._raw.read(len(buffer))
        self._head = self._head[len(data) :]
        buffer[: len(data)] = data
        return len(data)


class _Zstd(io.RawIOBase):
    """A zstd stream (frames one after another) that fails where a frame is cut short: python-zstandard's own
    reader, which fsspec uses, ends there quietly, and a truncated download would read as a shorter file."""

    def __init__(self, raw: Any) -> None:
        import zstandard  # noqa: PLC0415 (only for a zstd file)

        self._raw, self._new = raw, zstandard.ZstdDecompressor().decompressobj
        self._frame, self._out, self._started = self._new(), b"", False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._out:
            data = self._raw.read(1 << 16)
            if not data:
                if self._started and not self._frame.eof:
                    raise EOFError("the stream ends inside a zstd frame")
                return 0
            while data:
                if self._frame.eof:  # the next frame
                    self._frame = self._new()
                self._started = True
                self._out += self._frame.decompress(data)
                data = self._frame.unused_data if self._frame.eof else b""
        size = min(len(buffer), len(self._out))
        buffer[:size], self._out = self._out[:size], self._out[size:]
        return size


def sniff_compression(head: bytes) -> str | None:
    """The compression of a file from its first bytes (gzip ``1f 8b``, bz2, xz, zstd), or None for plain.

    The content decides, never the name: ``pairs.JSONL.GZ``, ``pairs.jsonl.gz?download=true``
    or a gzip file without a suffix are read as gzip, a plain file named ``.gz`` as plain text.
    """
    return next((name for magic, name in _MAGIC if head.startswith(magic)), None)


def sniff_archive(head: bytes) -> str | None:
    """The archive format of a (decompressed) stream from its first :data:`HEAD_BYTES` bytes (zip, tar, 7z, rar),
    or None."""
    return next((name for at, magic, name in _ARCHIVES if head[at : at + len(magic)] == magic), None)


def _head(stream: Any, size: int) -> bytes:
    """Up to ``size`` bytes from the start of ``stream`` (fewer only at its end)."""
    head = b""
    while len(head) < size and (chunk := stream.read(size - len(head))):
        head += chunk
    return head


def read_jsonl(path: str, storage_options: dict[str, Any] | None = None) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_number, parsed_json_or_RowError)`` for each non-blank line of a jsonl file, compressed or not.

    Args:
        path: any fsspec path or URL (local, ``s3://``, ``hf://datasets/...``, ``https://``, with or
            without a query string); its compression is read from its first bytes
            (:func:`sniff_compression`), whatever its name says.
        storage_options: passed to ``fsspec.open``.

    Yields:
        1-based line number and the parsed object, or a ``RowError`` naming the
        JSON or UTF-8 problem (the caller quarantines it), a number too long for Python to read (over 4,300
        digits) included. A UTF-8 byte-order mark before the first line is dropped.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: the file is compressed with a codec that is not installed, is an archive (zip, tar, 7z, rar,
            compressed or not: :func:`sniff_archive`), or its stream breaks partway (truncated or corrupt: names
            the path and the last whole line read).
    """
    with fsspec.open(path, "rb", **(storage_options or {})) as raw:
        head = _head(raw, HEAD_BYTES)
        stream: Any = io.BufferedReader(_Prefixed(head, raw))
        compression = sniff_compression(head)
        if compression is not None:
            if compression not in fsspec.compression.compr:
                raise ValueError(
                    f"{path}: the file is {compression}-compressed, but no {compression} codec is installed"
                )
            if compression == "zstd":
                stream = io.BufferedReader(_Zstd(stream))
            else:
                stream = fsspec.compression.compr[compression](stream, mode="rb")
            try:
                head = _head(stream, HEAD_BYTES)
            except Exception as err:  # broken within its first bytes: EOFError, zlib.error, ... (as in _lines)
                raise ValueError(
                    f"{path}: reading stopped after line 0: its {compression} stream is truncated or corrupt "
                    f"({type(err).__name__}: {err})"
                ) from err
            stream = io.BufferedReader(_Prefixed(head, stream))
        archive = sniff_archive(head)
        if archive is not None:
            packed = f"a {compression}-compressed {archive}" if compression else f"a {archive}"
            raise ValueError(
                f"{path}: the file is {packed} archive, not JSON lines: unpack it and give its .jsonl file"
            )
        for number, line in enumerate(_lines(stream, path, compression), start=1):
            if number == 1:
                line = line.removeprefix(b"\xef\xbb\xbf")
            if not line.strip():
                continue
            try:
                yield number, json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as err:
                yield number, RowError(f"invalid UTF-8: {err.reason} at byte {err.start}")
            except json.JSONDecodeError as err:
                yield number, RowError(f"invalid JSON: {err.msg}")
            except ValueError as err:  # int("1" * 5000): Python reads at most 4,300 digits of an integer
                yield number, RowError(f"invalid JSON: a number too long to read ({str(err).split(';')[0]})")


def _lines(stream: Any, path: str, compression: str | None) -> Iterator[bytes]:
    """The lines of ``stream``; a read or decoder error partway (a truncated or corrupt gzip, bz2, xz or zstd
    stream, a dropped connection) becomes one ``ValueError`` naming the file and the last line read whole."""
    lines, count = iter(stream), 0
    while True:
        try:
            line = next(lines)
        except StopIteration:
            return
        except Exception as err:  # EOFError, zlib.error, lzma.LZMAError, ZstdError, OSError: the kind varies
            kind = f"its {compression} stream" if compression else "it"
            raise ValueError(
                f"{path}: reading stopped after line {count}: {kind} is truncated or corrupt "
                f"({type(err).__name__}: {err})"
            ) from err
        count += 1
        yield line


def prompt_key(prompt: Any) -> str:
    """Stable hex sha256 of a prompt's messages (or of any JSON value, e.g. a ptx row); the id of the prompt."""
    return hashlib.sha256(
        json.dumps(prompt, sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogatepass")
    ).hexdigest()


def conversation_root(messages: list[Message]) -> str:
    """The root of a conversation: its first user turn's visible content (:func:`rlhf.formats.visible_text`).

    Every cut of one conversation (HH holds the same dialogue cut at different
    turns) has the same root, so splitting by it keeps the cuts together.

    Raises:
        RowError: the messages hold no user turn.
    """
    for message in messages:
        if message["role"] == "user":
            return visible_text(message["content"])
    raise RowError("conversation has no user turn")


def unit_point(key: str, salt: str = "") -> float:
    """A uniform point in [0, 1) from sha256 of ``salt + key`` (first 60 bits)."""
    return int(hashlib.sha256((salt + key).encode("utf-8", "surrogatepass")).hexdigest()[:15], 16) / 16**15


def _check_fractions(fractions: dict[str, float]) -> None:
    negative = [name for name, fraction in fractions.items() if fraction < 0]
    if negative:
        raise ValueError(f"data.fractions.{negative[0]} must be >= 0, got {fractions[negative[0]]}")
    total = sum(fractions.values())
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"data.fractions must sum to 1, got {total:.6g} (lower another split when you raise one)")


def dev_split(rows: list[dict[str, Any]], fraction: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train, dev)``: the development split, ``fraction`` of a training split's ``rows`` by a salted hash of the
    conversation root (whole conversations; independent of :func:`assign_split`'s hash). Every choice of
    settings, step counts, data amounts and the judge's recipe is made on it (``bench.reward_quality``), never on
    the test splits (``rm_eval``, ``judge_eval``) that the gates read and the reported figures come from.

    Raises:
        ValueError: ``fraction`` outside (0, 1).
    """
    if not 0 < fraction < 1:
        raise ValueError(f"the development fraction must be in (0, 1), got {fraction}")
    dev = [unit_point(conversation_root(row["prompt"]), salt="reward-dev") < fraction for row in rows]
    return [r for r, d in zip(rows, dev, strict=True) if not d], [r for r, d in zip(rows, dev, strict=True) if d]


def assign_split(prompt: list[Message], fractions: dict[str, float]) -> str:
    """Pick the split of a prompt from a hash of its conversation root (see :func:`conversation_root`).

    Args:
        prompt: the prompt's messages (at least one user turn).
        fractions: split name -> fraction, in order; fractions must sum to 1.

    Returns:
        The split name: the first whose cumulative fraction exceeds the root's hash point.

    Raises:
        ValueError: the fractions are negative or do not sum to 1 (1e-6).
        RowError: the prompt has no user turn.
    """
    _check_fractions(fractions)
    point = unit_point(conversation_root(prompt))
    edge = 0.0
    for name, fraction in fractions.items():
        edge += fraction
        if point < edge:
            return name
    return name


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
    plain text (:func:`rlhf.models.encode_messages`, :func:`rlhf.models.encode_text`),
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
    from rlhf.chat import encode_messages, encode_text  # noqa: PLC0415 torch and transformers load only when tokenising

    if "messages" in parsed:
        ids = encode_messages(tokenizer, parsed["messages"])
    else:
        ids = encode_text(tokenizer, parsed["text"]) + [tokenizer.eos_token_id]
    ids = ids[:max_length]
    if not ids:
        raise ValueError(f"ptx row {name}: no tokens")
    return ids


@dataclass
class SourceCount:
    """What one source gave: rows read, rows used (kept in a split), the first quarantine reason."""

    path: str
    role: str  # "preference" (data.source, data.more_sources) or "ptx" (data.ptx_source)
    name: str  # the name its rows carry (:func:`source_names`)
    rows_in: int = 0
    used: int = 0
    first_reason: str | None = None


@dataclass
class PreparedData:
    """The result of :func:`prepare_rows`: rows by split, quarantined rows and what each source gave."""

    splits: dict[str, list[dict[str, Any]]]
    quarantine: list[dict[str, Any]]
    rows_in: int
    sources: list[SourceCount] = field(default_factory=list)

    def unusable_sources(self) -> list[str]:
        """One line per source that gave no usable row (empty, or every row quarantined): such a source is
        an error of the run, never a silent loss (a gzip file read as text, a wrong format or mapping)."""
        lines = []
        for count in self.sources:
            if count.rows_in == 0:
                lines.append(f"{count.role} source {count.path}: no rows")
            elif count.used == 0:
                lines.append(
                    f"{count.role} source {count.path}: none of {count.rows_in} rows is usable; "
                    f"first reason: {count.first_reason}"
                )
        return lines


PTX_KIND = "ptx"
"""The kind of the rows of ``data.ptx_source`` (pretraining text, no preference)."""


def source_name(path: str) -> str:
    """A source's default short name: its file name without the suffixes, or its folder's name when the file is
    called ``pairs`` (HH's layout: ``hh-rlhf/helpful-base/pairs.jsonl.gz`` is ``helpful-base``)."""
    parts = [p for p in path.split("?")[0].replace("\\", "/").split("/") if p]
    stem = parts[-1].split(".")[0] if parts else path
    return parts[-2] if stem == "pairs" and len(parts) > 1 else stem


@dataclass
class Source:
    """One input of the prepare stage: where it is, its rows, their format and key mapping, and what its rows
    are called: ``name`` (short, unique among the sources; default :func:`source_name`) and ``kind`` (the kind
    of data, e.g. ``helpful`` or ``harmless``: the figures and gates are per kind). Every row it gives
    carries both, never the path (:func:`source_names`)."""

    path: str
    rows: Iterator[tuple[int, Any]]
    format: str = "auto"
    mapping: dict[str, str] | None = None
    name: str | None = None
    kind: str = "general"


def prepare_rows(
    sources: list[Source],
    fractions: dict[str, float],
    ptx_sources: list[Source] | None = None,
    ptx_heldout_fraction: float = 0.2,
) -> PreparedData:
    """Parse raw rows, quarantine the unparseable ones and split the rest by conversation root.

    Output rows: ``sft``, ``rm_train``, ``rm_eval``, ``judge_train``, ``judge_eval`` hold whole pairs
    ``{"id", "source", "kind", "prompt", "chosen", "rejected"}`` (``source`` and ``kind``: the
    :class:`Source`'s name and kind); ``ppo_prompts`` and
    ``eval_prompts`` hold ``{"id", "source", "kind", "prompt"}`` (one row per distinct
    prompt). ``rm_eval`` and ``judge_eval`` hold their own shares' pairs and also every pair whose conversation
    is in ``eval_prompts`` (:data:`HELD_OUT_PAIRS`): the reward model and the judge are measured on them,
    evaluation reads only their prompts, and no split that trains (``sft``, ``rm_train``, ``judge_train``,
    ``ppo_prompts``, ``ptx_text``) shares a conversation root with any of them. The ptx share
    (``fractions["ptx_text"]``) of the preference data gives ``{"id", "source", "kind", "messages"}`` rows (prompt +
    chosen response); every row of ``ptx_sources`` (``{"messages"}`` or ``{"text"}``, see
    :func:`parse_ptx_row`) is added to them, unless its conversation root is in
    another split of the preference data (then it is quarantined: it would leak).
    Of all ptx rows, a hashed ``ptx_heldout_fraction`` (by :func:`ptx_key`) goes
    to ``ptx_heldout``, the rest to ``ptx_text``. Ids: pair and ptx rows
    ``<sha256[:16]>-<line>`` (``-<k>`` for the k-th pair of a ranking row,
    ``-s<i>`` for the i-th source after the first; an eval_prompts pair in rm_eval and judge_eval too), so they are
    unique; prompt rows ``<sha256[:16]>``.
    Quarantine rows are ``{"source", "file", "line", "reason", "row"}`` (the source's name and path).
    ``sources`` counts, per source, the rows read and used (see :meth:`PreparedData.unusable_sources`).

    Args:
        sources: the preference inputs, concatenated in order.
        fractions: split fractions (see :func:`assign_split`).
        ptx_sources: optional PPO-ptx corpora (``data.ptx_source``).
        ptx_heldout_fraction: share of the ptx rows held out, in (0, 1).

    Raises:
        ValueError: fractions that do not sum to 1, ``ptx_heldout_fraction`` outside (0, 1), two sources with
            one name, or an empty name or kind.
    """
    _check_fractions(fractions)
    if not 0 < ptx_heldout_fraction < 1:
        raise ValueError(f"data.ptx_heldout_fraction must be in (0, 1), got {ptx_heldout_fraction}")
    names = iter(source_names([*sources, *(ptx_sources or [])]))
    splits: dict[str, list[dict[str, Any]]] = {name: [] for name in SPLITS}
    quarantine: list[dict[str, Any]] = []
    seen_prompts: set[tuple[str, str]] = set()
    root_split: dict[str, str] = {}
    rows_in = 0

    def ptx(record: dict[str, Any]) -> None:
        splits["ptx_heldout" if is_ptx_heldout(record, ptx_heldout_fraction) else "ptx_text"].append(record)

    counts: list[SourceCount] = []

    def reject(source: Source, line: int, row: Any, reason: str) -> None:
        quarantine.append(
            {
                "source": counts[-1].name,
                "file": source.path,
                "line": line,
                "reason": reason,
                "row": None if isinstance(row, RowError) else row,
            }
        )
        counts[-1].first_reason = counts[-1].first_reason or reason

    for index, source in enumerate(sources):
        counts.append(SourceCount(source.path, "preference", next(names)))
        for line, row in source.rows:
            rows_in += 1
            counts[-1].rows_in += 1
            try:
                examples = to_examples(row, source.format, source.mapping)
            except RowError as err:
                reject(source, line, row, str(err))
                continue
            counts[-1].used += 1
            for number, example in enumerate(examples):
                key = prompt_key(example["prompt"])
                split = assign_split(example["prompt"], fractions)
                root_split[conversation_root(example["prompt"])] = split
                suffix = (f"-{number}" if len(examples) > 1 else "") + (f"-s{index}" if index else "")
                record = {"id": f"{key[:16]}-{line}{suffix}", "source": counts[-1].name, "kind": source.kind}
                if split in ("ppo_prompts", "eval_prompts"):
                    if (split, key) not in seen_prompts:
                        seen_prompts.add((split, key))
                        splits[split].append({**record, "id": key[:16], "prompt": example["prompt"]})
                    for held_out in HELD_OUT_PAIRS.get(split, ()):  # only its prompt is evaluated on: its pair
                        splits[held_out].append({**record, **example})  # measures the reward model and the judge
                elif split == "ptx_text":
                    ptx({**record, "messages": example["prompt"] + example["chosen"]})
                else:
                    splits[split].append({**record, **example})
    for index, source in enumerate(ptx_sources or []):
        counts.append(SourceCount(source.path, "ptx", next(names)))
        for line, row in source.rows:
            rows_in += 1
            counts[-1].rows_in += 1
            try:
                if isinstance(row, RowError):
                    raise row
                parsed = parse_ptx_row(row)
                other = root_split.get(ptx_key(parsed), "ptx_text") if "messages" in parsed else "ptx_text"
                if other != "ptx_text":
                    raise RowError(f"ptx conversation's first user turn is also in split '{other}' (it would leak)")
            except RowError as err:
                reject(source, line, row, str(err))
                continue
            key = prompt_key(parsed)
            row_id = f"{key[:16]}-{line}" + (f"-p{index}" if index else "")
            ptx({"id": row_id, "source": counts[-1].name, "kind": source.kind, **parsed})
            counts[-1].used += 1
    return PreparedData(splits=splits, quarantine=quarantine, rows_in=rows_in, sources=counts)


def source_names(sources: list[Source]) -> list[str]:
    """Each source's name: its own, or :func:`source_name` of its path; default names that two sources share
    get ``-<position>`` (the same file read twice), given ones must differ.

    Raises:
        ValueError: two sources given one name, or a name or kind that is empty or holds a ``/`` (both are parts
            of metric names).
    """
    defaults = [source_name(source.path) for source in sources]
    names = []
    for position, (source, default) in enumerate(zip(sources, defaults, strict=True)):
        name = source.name or (default if defaults.count(default) == 1 else f"{default}-{position}")
        for what, value in (("name", name), ("kind", source.kind)):
            if not isinstance(value, str) or not value or "/" in value:
                raise ValueError(
                    f"source {source.path}: its {what} must be a non-empty string without '/', got {value!r}"
                )
        if name in names:
            other = sources[names.index(name)].path
            raise ValueError(f"sources {other} and {source.path} are both named {name!r}; give each its own name")
        names.append(name)
    return names


def write_jsonl(rows: list[dict[str, Any]], handle: io.TextIOBase) -> None:
    """Write rows as one JSON object a line (UTF-8, not ASCII-escaped)."""
    for row in rows:
        handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def load_jsonl(path: str) -> list[dict[str, Any]]:
    """Read a local jsonl file written by :func:`write_jsonl`.

    Raises:
        ValueError: a line is not valid JSON (names the file and line).
    """
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number}: invalid JSON: {err.msg}") from err
    return rows
