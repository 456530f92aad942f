"""What a person running the pipeline sees of a stage: a line as it starts, its loud lines (a WARNING, a GATE
FAILED, an error), a line as it ends with its time and headline figures, and on a terminal its training loop's
progress bar. Everything the stage's process and DVC write goes, whole, to ``logs/<stage>.log`` (git-ignored).
Every line a person sees is also in the flow run's Prefect log (:func:`say`), where the UI and automations read it.
"""

from __future__ import annotations

import codecs
import logging
import os
import re
import sys
import textwrap
from collections.abc import Callable
from typing import BinaryIO, TextIO

from tasks.kit.console import WIDTH, fit

LOGS = "logs"
LOUD = re.compile(r"^\[\w+\] (WARNING|GATE FAILED|error: |stopped by |FAILED|resuming from )")
SKIPPED = re.compile(r"^Stage '[\w@.-]+' didn't change, skipping")  # DVC's line for an up-to-date stage
CLEAR = "\r\x1b[K"  # back to the line's start and clear it (a terminal only)


WARNS = re.compile(r"^\[\w+\] (WARNING|GATE FAILED)")
ERRORS = re.compile(r"^\[\w+\] (error: |stopped by |FAILED)")


def to_prefect_log(line: str) -> None:
    """Send a console ``line`` to the running flow's (or task's) Prefect log, not to the console again (Prefect's
    ``prefect.extra`` logger has only the API handler): WARNING and GATE FAILED lines at WARNING, error lines at
    ERROR, the rest at INFO. Outside a flow run (a stage run by hand) it does nothing."""
    from prefect.context import get_run_context  # noqa: PLC0415 (Prefect: a second to import)
    from prefect.exceptions import MissingContextError  # noqa: PLC0415

    try:
        get_run_context()
    except MissingContextError:
        return
    level = logging.ERROR if ERRORS.match(line) else logging.WARNING if WARNS.match(line) else logging.INFO
    logging.getLogger("prefect.extra").log(level, line)


def say(line: str, prefix: str = "") -> None:
    """Print ``line`` for a person, wrapped to :data:`WIDTH` columns (:func:`fit`; after ``prefix``, e.g.
    :data:`CLEAR` over a progress bar), and put it whole in the flow run's Prefect log (:func:`to_prefect_log`),
    whose UI wraps it."""
    print(f"{prefix}{fit(line)}", flush=True)
    to_prefect_log(line)


class FitToConsoleWidth(logging.Filter):
    """A filter for Prefect's console handler: a record whose formatted line (time, level, ``Flow run 'name' - ``,
    message) runs past :data:`WIDTH` columns has its message cut to fit, ending ``[...]`` (e.g. a final state's
    ``Finished in state Gate failed(...)``, whose message is the verdict's whole sentence). The flow prints the whole
    verdict itself, last; the run's Prefect log, which another handler writes before this one sees the record,
    keeps it whole."""

    def __init__(self, handler: logging.Handler) -> None:
        super().__init__()
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        """Cut the message where the line is too long; keep every record."""
        over = len(self.handler.format(record).splitlines()[0]) - WIDTH
        if over > 0:
            message = record.getMessage()
            record.msg = textwrap.shorten(message, max(len(message) - over, 20), placeholder=" [...]")
            record.args = None
        return True


def stage_log(stage: str) -> str:
    """Where a stage's whole output is kept: ``logs/<stage>.log`` (the last run of the stage)."""
    return os.path.join(LOGS, f"{stage}.log")


def relay(stream: BinaryIO, log: TextIO, show: Callable[[str], None], bar: TextIO | None = None) -> list[str]:
    """Copy a stage's output to ``log`` line by line, ``show`` its :data:`LOUD` lines, and draw its progress bar
    (text after a carriage return, as tqdm writes it) on ``bar`` when given (a terminal); of a bar, the log gets
    only its last state.

    Args:
        stream: the process's stdout and stderr together, bytes (UTF-8; a character split between reads is kept).
        log: the stage's log file (text).
        show: prints a line for a person.
        bar: the terminal to draw the bar on; None: bars are dropped (the flow's stdout is not a terminal).

    Returns:
        every line written to the log, without its newline.
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    lines: list[str] = []
    pending, drawing = "", False  # text since the last line end; whether it follows a carriage return (a bar)

    def end_line(text: str) -> None:
        nonlocal drawing
        if drawing and bar is not None:  # a bar's last state (or a line tqdm wrote over it) stays on the terminal
            bar.write(f"{CLEAR}{text}\n")
            bar.flush()
        drawing = False
        log.write(text + "\n")
        lines.append(text)
        if LOUD.match(text):
            show(text)

    for chunk in iter(lambda: stream.read1(65536), b""):
        text = decoder.decode(chunk)
        for piece in re.split(r"([\r\n])", text):
            if piece == "\n":
                end_line(pending)
                pending = ""
            elif piece == "\r":
                pending, drawing = "", True
            else:
                pending += piece
        if drawing and bar is not None and pending:
            bar.write(f"{CLEAR}{pending}")
            bar.flush()
    if pending:
        end_line(pending)
    log.flush()
    return lines


def terminal() -> TextIO | None:
    """The flow's stdout when it is a terminal (bars are drawn there), else None."""
    return sys.stdout if sys.stdout.isatty() else None
