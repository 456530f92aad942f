"""The skeleton the four training stages (sft, reward, judge, ppo) share: check the params, launch the processes,
train inside the stage's MLflow run and staged outputs, then print what the stage says."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlhf.training.supervised import LogFn, no_log
from tasks.kit.launch import other_rank
from tasks.kit.outputs import StagedOutputs
from tasks.kit.runs import StageRun


def training_stage(
    stage: str,
    logged: dict[str, Any],
    device: dict[str, Any],
    check: Callable[[], None],
    train: Callable[[LogFn, StagedOutputs | None], Any],
    finish: Callable[[StageRun, StagedOutputs, Any], list[str]],
) -> None:
    """Run training stage ``stage`` (``python -m tasks.<stage>``) on ``device.num_processes`` processes.

    ``check()`` refuses bad params with one line before anything starts. Every rank but 0 only runs
    ``train(no_log, None)`` (:func:`tasks.kit.launch.other_rank`). Rank 0 opens the stage's MLflow run (its
    params: ``logged``) and staged outputs, runs ``train(stage.log, outputs)``, then ``finish(stage, outputs,
    result)``, which stages the rest and returns the lines to print once the outputs are in place.

    Raises:
        whatever ``check``, ``train`` or ``finish`` raise; nothing is written then
        (:class:`tasks.kit.outputs.StagedOutputs`).
    """
    check()
    if other_rank(device, f"tasks.{stage}", lambda: train(no_log, None), check):
        return
    with StageRun(stage, logged) as run, StagedOutputs() as outputs:
        lines = finish(run, outputs, train(run.log, outputs))
    for line in lines:
        print(line, flush=True)
