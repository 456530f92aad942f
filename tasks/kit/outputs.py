"""A stage's outputs, written aside and put in place together; metrics files and wall times."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from typing import Any

from rlhf.data.kinds import kinds_in
from rlhf.files import atomic_write_text, write_json
from tasks.kit import paths
from tasks.kit.runs import StageRun, held_stop_signals, process_state


def _leftovers(parent: str, base: str) -> Iterator[str]:
    """Staging folders of output ``base`` in ``parent`` left by a process of this host that is gone (SIGKILL)."""
    pattern = re.compile(rf"\.{re.escape(base)}\.(?:tmp|old)-(?P<host>.+)-(?P<pid>\d+)-[a-z0-9_]+")
    for name in os.listdir(parent):
        match = pattern.fullmatch(name)
        if match and match["host"] == socket.gethostname():
            process = process_state(int(match["pid"]))
            if process is None or process[0] in ("Z", "X"):
                yield os.path.join(parent, name)


class StagedOutputs:
    """A stage's outputs, written aside and put in place together at the end, when nothing else can fail.

    :meth:`folder` and :meth:`file` say where to write each output: a new
    folder beside it, or a file inside one. :meth:`commit` then moves them all
    into place in one step: each previous output is moved aside, the new one
    renamed in, and the previous ones deleted only when every new one is in
    place; an error on the way puts every previous output back, and stop
    signals wait until the renames are done. As a context manager it commits
    when its block ends without an exception and otherwise deletes what was
    staged: a failed stage leaves every previous output exactly as it was.

    Staging folders are named ``.<name>.tmp-<host>-<pid>-<random>`` beside the
    output; those of a process of this host that is gone (SIGKILL) are removed
    the next time that output is staged.
    """

    def __init__(self) -> None:
        self._staged: dict[str, tuple[str, str | None]] = {}  # target -> (staging folder, file name or None)
        self._on_commit: list = []
        self._tag = f"{socket.gethostname()}-{os.getpid()}-"

    def _stage(self, path: str) -> tuple[str, str]:
        target = os.path.abspath(path)
        if target in self._staged:
            raise ValueError(f"output {path} is staged twice")
        parent, base = os.path.split(target)
        os.makedirs(parent, exist_ok=True)
        for leftover in _leftovers(parent, base):
            shutil.rmtree(leftover, ignore_errors=True)
        return target, tempfile.mkdtemp(dir=parent, prefix=f".{base}.tmp-{self._tag}")

    def folder(self, path: str) -> str:
        """An empty folder (with the usual mode, ``0o777 & ~umask``) that becomes ``path`` at the commit."""
        target, tmp = self._stage(path)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700
        self._staged[target] = (tmp, None)
        return tmp

    def file(self, path: str) -> str:
        """Where to write the file that becomes ``path`` at the commit (its folder exists, the file does not)."""
        target, tmp = self._stage(path)
        self._staged[target] = (tmp, os.path.basename(target))
        return os.path.join(tmp, os.path.basename(target))

    def staged(self, path: str) -> str:
        """The staging folder of output ``path`` (staged before by :meth:`folder`), e.g. to register it.

        Raises:
            KeyError: ``path`` is not a staged folder.
        """
        tmp, name = self._staged[os.path.abspath(path)]
        if name is not None:
            raise KeyError(f"{path} is a staged file, not a folder")
        return tmp

    def on_commit(self, action) -> None:
        """Call ``action()`` after a successful commit (e.g. delete the checkpoints a rerun would resume from)."""
        self._on_commit.append(action)

    def discard(self) -> None:
        """Delete everything staged; the outputs stay as they are."""
        for tmp, _ in self._staged.values():
            shutil.rmtree(tmp, ignore_errors=True)
        self._staged.clear()

    def commit(self) -> None:
        """Put every staged output in place together (see the class); on an error none is, and it is raised.

        Raises:
            RuntimeError: a staged file was never written (nothing is put in place).
        """
        missing = [
            t for t, (tmp, name) in self._staged.items() if name and not os.path.lexists(os.path.join(tmp, name))
        ]
        if missing:
            self.discard()
            raise RuntimeError(f"staged outputs were never written: {', '.join(missing)}")
        moved: list[tuple[str, str, str | None, bool]] = []  # (target, staged path, previous moved aside, placed)
        holders: list[str] = []
        try:
            with held_stop_signals():
                for target, (tmp, name) in self._staged.items():
                    new, aside = os.path.join(tmp, name) if name else tmp, None
                    if os.path.lexists(target):
                        holders.append(
                            tempfile.mkdtemp(
                                dir=os.path.dirname(target), prefix=f".{os.path.basename(target)}.old-{self._tag}"
                            )
                        )
                        aside = os.path.join(holders[-1], "previous")
                        os.replace(target, aside)
                    moved.append((target, new, aside, False))
                    os.replace(new, target)
                    moved[-1] = (target, new, aside, True)
        except BaseException:
            if len(moved) < len(self._staged) or not moved[-1][3]:  # not every output was put in place: undo
                for target, new, aside, placed in reversed(moved):
                    with contextlib.suppress(OSError):
                        if placed:
                            os.replace(target, new)
                        if aside:
                            os.replace(aside, target)
                self.discard()
                for holder in holders:
                    shutil.rmtree(holder, ignore_errors=True)
                raise
            self._finish(holders)  # all in place; a stop signal arrived meanwhile and is raised now
            raise
        self._finish(holders)

    def _finish(self, holders: list[str]) -> None:
        for holder in holders:
            shutil.rmtree(holder, ignore_errors=True)
        for tmp, name in self._staged.values():
            if name:
                shutil.rmtree(tmp, ignore_errors=True)  # the file's staging folder, now empty
        self._staged.clear()
        actions, self._on_commit = self._on_commit, []
        for action in actions:
            action()

    def __enter__(self) -> StagedOutputs:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


@contextlib.contextmanager
def atomic_dir(path: str) -> Iterator[str]:
    """Yield a temporary folder beside ``path``; on success it replaces ``path`` (:class:`StagedOutputs`).

    On an exception the temporary folder is removed and ``path`` is left as it was.
    """
    with StagedOutputs() as outputs:
        yield outputs.folder(path)


TIMINGS_DIR = "timings"  # each stage's last wall time: git-ignored, never a DVC metric (runs compare results)


def timing_path(stage: str) -> str:
    """Where a stage's last wall time is kept: ``timings/<stage>.json``, ``{"stage", "seconds", "phases"}``."""
    return os.path.join(TIMINGS_DIR, f"{stage}.json")


def is_timing(key: str) -> bool:
    """A wall-clock figure (``ppo/time/generation``, ``ppo/last/time/update``): kept out of metrics and curves."""
    return "/time/" in key


def write_metrics(
    path: str,
    metrics: dict[str, Any],
    stage: StageRun,
    curves: dict[str, dict[int, dict[str, Any]]] | None = None,
) -> None:
    """Write a stage's DVC metrics file, its per-iteration curves (DVC plots data) and, apart, its wall time.

    The metrics and curves files are ``cache: false`` in ``dvc.yaml`` and tracked by git, so a commit and
    every ``dvc exp run`` carry them, and ``dvc exp show``, ``dvc metrics diff`` and ``dvc plots diff``
    compare them. They hold results only: the wall time (``stage.seconds``) and every per-phase time
    (:func:`is_timing`; MLflow has them per iteration) differ between two runs of the same inputs, so they
    go to :func:`timing_path` (git-ignored; the flow's summary reads it).
    Every file is JSON, written atomically; non-finite floats become null.

    Args:
        path: the metrics file, e.g. ``metrics/ppo.json``.
        metrics: name -> value (numbers; a string or None is kept as it is).
        stage: the stage run (its ``stage`` name and ``seconds``, the wall time up to this call).
        curves: plots file -> {iteration -> {signal -> value}}; each file is a list of
            ``{"iteration": i, signal: value, ...}`` rows in iteration order, numbers only, every row
            with every signal (null where an iteration has none: DVC's plots fail on a missing field).
    """

    def clean(value: Any) -> Any:
        return None if isinstance(value, float) and not math.isfinite(value) else value

    write_json(path, {k: clean(v) for k, v in metrics.items() if not is_timing(k)})
    for plots_path, history in (curves or {}).items():
        numbers = {
            int(step): {k: float(v) for k, v in stats.items() if isinstance(v, (int, float)) and not is_timing(k)}
            for step, stats in history.items()
        }
        signals = sorted({k for stats in numbers.values() for k in stats})  # every row has every signal
        rows = [{"iteration": step, **{k: clean(numbers[step].get(k)) for k in signals}} for step in sorted(numbers)]
        atomic_write_text(plots_path, json.dumps(rows, indent=1) + "\n")
    phases = {k: v for k, v in metrics.items() if is_timing(k)}
    write_json(timing_path(stage.stage), {"stage": stage.stage, "seconds": stage.seconds, "phases": phases})


def load_json(path: str) -> dict[str, Any]:
    """Read a JSON file."""
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def is_part_figure(key: str) -> bool:
    """Whether a metric is a kind's or a source's (``<prefix>/kind/...``, ``<prefix>/source/...``)."""
    return "/kind/" in key or "/source/" in key


def stage_metrics(stage: str) -> dict[str, Any]:
    """A stage's metrics: ``metrics/<stage>.json`` and, when written, its per-kind file
    (:func:`tasks.kit.paths.kind_metrics`), in one dict.

    Raises:
        FileNotFoundError: no ``metrics/<stage>.json``.
    """
    parts = paths.kind_metrics(stage)
    return {**load_json(paths.metrics(stage)), **(load_json(parts) if os.path.isfile(parts) else {})}


HEADLINE = {  # each stage's row of the one table `dvc metrics show` prints (metrics/headline/<stage>.json): a short
    # name means the same in every row, so the table stays within 120 columns; {kind}: a column per kind of data
    "sft": {"loss": "sft/loss_last"},
    "reward": {"bal_acc": "rm/balanced_accuracy", "{kind}": "rm/kind/{kind}/balanced_accuracy"},
    "gate": {"passed": "gate/passed"},
    "judge": {"bal_acc": "judge/balanced_accuracy", "{kind}": "judge/kind/{kind}/balanced_accuracy"},
    "ppo": {"kl": "ppo/last/kl"},
    "evaluate": {
        "win": "eval/judge/win_rate",
        "lc_win": "eval/judge/lc_win_rate",
        "kl": "eval/policy/kl",
        "refusals": "eval/policy/refusal_rate",
        "passed": "gate/passed",
    },
}
"""Stage -> {column: metric key}: balanced accuracies (overall and per kind) of the reward model and the judge,
``passed`` 1/0 for the reward and the policy gate, the KL to SFT (PPO's last rollout, evaluation's prompts),
the judge's win rate and length-controlled win rate over SFT, the policy's refusal rate. Every figure of a stage is
in its own files (``dvc metrics show metrics/reward.json``); validate's counts are in the console and the report."""


def write_headline(outputs, stage: str, values: dict[str, Any]) -> None:
    """Stage ``stage``'s row of :data:`HEADLINE` from ``values`` (its metrics, per-kind ones included) into
    ``metrics/headline/<stage>.json``: numbers only, rounded to 3 decimals (a figure ``values`` lacks, or NaN, is
    left out: DVC shows ``-``)."""
    row = {}
    for column, key in HEADLINE[stage].items():
        kinds = kinds_in(values, key.split("/", 1)[0]) if "{kind}" in key else [None]
        for kind in kinds:
            value = values.get(key.format(kind=kind))
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                row[column.format(kind=kind)] = round(value, 3) if isinstance(value, float) else value
    write_json(outputs.file(paths.headline(stage)), row)
