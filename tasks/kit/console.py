"""What a stage process writes besides its own lines: progress bars only on a terminal, and the libraries' chatter
(MLflow's database set-up, their progress bars, Python warnings with their source line) quiet or on one line.

The pipeline flow reads a stage's whole output into ``logs/<stage>.log`` and shows a person only the stage's start,
end and loud lines (:mod:`flows.console`); this module keeps what goes into that log readable, and wraps a line a
person reads (the flow's console, the commands' notes) to 120 columns (:func:`fit`).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import textwrap
import warnings

WIDTH = 120  # the lines a person reads, in a terminal, a file or CI's log
HANGING = re.compile(r"(\[\w+\] )?( *- | *)")  # a product line's ``[stage] ``, then its indent or ``- `` item
PROGRESS_ENV = "RLHF_PROGRESS"  # "1": show the training loops' bars, "0": none; unset: when stderr is a terminal

QUIET_ENV = {  # read by the libraries when they start a bar or configure their loggers
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' weight loading, shard writing and GGUF conversion bars
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",  # "Downloading artifacts" (the gate, ppo, evaluate)
    "MLFLOW_LOGGING_LEVEL": "WARNING",  # "Creating initial MLflow database tables..." on a new store
}


def progress_bars() -> bool:
    """Whether this stage draws its training loop's progress bar (one a loop): ``RLHF_PROGRESS`` when set (the
    flow sets it from its own stdout), else whether stderr is a terminal."""
    wanted = os.environ.get(PROGRESS_ENV)
    if wanted is not None:
        return wanted == "1"
    return sys.stderr.isatty()


def quiet_libraries(stage: str) -> None:
    """Turn the libraries' progress bars off (the stage's own loop keeps its bar, :func:`progress_bars`), set
    MLflow's logger to warnings, and print each distinct Python warning once on one line,
    ``[<stage>] warning: TiesWarning: 12 of 32 comparisons ... tied``, to stderr.

    Great Expectations' "Calculating Metrics" bars are turned off where its context is made
    (:func:`rlhf.data.validation.validate_split`); the expected load report of a new reward head is checked and
    silenced where it is loaded (:func:`rlhf.models.loading.load_scalar_model`).
    """
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    if "transformers" in sys.modules:  # imported already: it read the variable above at its import
        from transformers.utils import logging as transformers_logging  # noqa: PLC0415 (only when the stage loaded it)

        transformers_logging.disable_progress_bar()
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    shown: set[str] = set()

    def one_line(message, category, filename, lineno, file=None, line=None) -> None:
        text = f"[{stage}] warning: {category.__name__}: {' '.join(str(message).split())}"
        if text not in shown:
            shown.add(text)
            print(text, file=file or sys.stderr, flush=True)

    warnings.showwarning = one_line


def fit(line: str, width: int = WIDTH) -> str:
    """``line`` wrapped at spaces to ``width`` columns, each further line indented under the text after its
    ``[stage] ``, its own indent and its ``- `` (two spaces where it has none of them); a word longer than the width
    (a path, a ``key=value``) stays whole. A line that fits comes back as it is."""
    if len(line) <= width:
        return line
    indent = " " * (len(HANGING.match(line).group(0)) or 2)
    return textwrap.fill(
        line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False, drop_whitespace=True
    )
