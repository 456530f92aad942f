"""A training stage on several processes: ``device.num_processes`` launches it under accelerate, in this process.

The stage checks its params first, then this process becomes the launcher (accelerate's ``launch_command``,
torch's elastic agent) of ``python -m <stage>`` on N processes and waits for them. A failure then reads as
with one process: the rank that failed prints its one line, and the launcher's own report (a traceback of
``ChildFailedError``, the elastic agent's log lines) is left out; the exit status is that of the rank that
failed (1 for an error, 128 + the signal's number for a stop; :func:`launch`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import yaml

from rlhf.runtime.device import mixed_precision


def other_rank(device: dict[str, Any], module: str, train: Callable[[], object], check: Callable[[], object]) -> bool:
    """Run a training stage on ``device.num_processes`` processes; True in every process but rank 0.

    With ``num_processes`` above 1 and no process group yet, ``check()`` (the stage's params, so a bad one
    is one line before anything starts) runs, then :func:`launch` runs ``python -m <module>`` on that many
    processes and this process exits with their status (``device.accelerate_config``: an accelerate config
    file, e.g. infra/accelerate/ddp.yaml; null: ``--multi_gpu`` on this machine, which starts gloo processes
    on a CPU-only one). Under the launcher each rank dies with it (:func:`die_with_launcher`), rank 0 goes on
    as the stage (MLflow run, outputs) and every other rank runs ``train()`` (the training, whose gradients
    and batch statistics it shares) and stops:
    this function then returns True.

    Raises:
        ValueError: ``num_processes`` is not an integer of at least 1, an unknown ``mixed_precision``, or the
            config asks for what the trainers do not implement (:func:`check_accelerate_config`); whatever
            ``check()`` raises.
        FileNotFoundError: ``accelerate_config`` names no file.
    """
    processes = device.get("num_processes", 1)
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        raise ValueError(f"params.yaml: device.num_processes must be an integer of at least 1, got {processes!r}")
    config = device.get("accelerate_config")
    if config:
        check_accelerate_config(config)
    if processes > 1 and "LOCAL_RANK" not in os.environ:
        precision = mixed_precision(device)
        check()
        raise SystemExit(launch(module, processes, config, precision))
    if LAUNCHER in os.environ:
        die_with_launcher(int(os.environ[LAUNCHER]))
    if int(os.environ.get("RANK", "0")) == 0:
        return False
    train()
    return True


LAUNCHER = "RLHF_LAUNCHER_PID"  # set by launch() for its ranks: the stage process that launched them


def die_with_launcher(launcher: int) -> None:
    """Have the kernel SIGKILL this rank when its launcher, process ``launcher``, dies (Linux
    ``PR_SET_PDEATHSIG``; elsewhere nothing).

    The launcher forwards SIGTERM and SIGINT to its ranks, but a SIGKILL cannot be forwarded, and the ranks run
    in sessions of their own, so without this they would train on (and rank 0 write the stage's outputs) after
    the stage was killed. A rank whose launcher is already gone exits.
    """

    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != launcher:  # it died before the line above
        raise SystemExit(128 + signal.SIGKILL)


def check_accelerate_config(path: str) -> None:
    """Refuse an accelerate config file that does not exist or asks for what the trainers do not implement.

    Raises:
        FileNotFoundError: no such file.
        ValueError: its ``distributed_type`` is DeepSpeed or Megatron-LM, or its ``fsdp_config`` lacks
            ``fsdp_version: 2`` or ``fsdp_cpu_ram_efficient_loading: false``, or sets anything else but
            ``fsdp_reshard_after_forward`` (the trainers shard each decoder block themselves,
            :mod:`rlhf.runtime.sharding`;
            docs/scaling.md: running at scale).
    """
    from rlhf.runtime.distributed import UNSUPPORTED  # noqa: PLC0415 (imports torch and transformers)

    if not os.path.isfile(path):
        raise FileNotFoundError(f"params.yaml: device.accelerate_config {path}: no such file (see infra/accelerate/)")
    config = _read(path)
    kind = str(config.get("distributed_type", "")).upper()
    where = f"params.yaml: device.accelerate_config {path}"
    if kind in UNSUPPORTED:
        raise ValueError(
            f"{where}: distributed_type {kind} is not supported: the trainers run data parallel or FSDP; use "
            "infra/accelerate/ddp.yaml or infra/accelerate/fsdp.yaml"
        )
    fsdp = config.get("fsdp_config") or {}
    for key in ("fsdp_version", "fsdp_cpu_ram_efficient_loading") if kind == "FSDP" else ():
        if key not in fsdp:  # accelerate's defaults (1, true) are what the trainers do not implement
            wanted = str(FSDP_KEYS[key][0]).lower()
            raise ValueError(f"{where}: fsdp_config.{key} must be set to {wanted} (see infra/accelerate/fsdp.yaml)")
    for key, value in sorted(fsdp.items()) if kind == "FSDP" else []:
        if key not in FSDP_KEYS or value not in FSDP_KEYS[key]:
            hint = FSDP_HINTS.get(key, "the trainers shard each decoder block with FSDP2 themselves")
            raise ValueError(
                f"{where}: fsdp_config.{key}: {value!r} is not implemented: {hint} (infra/accelerate/fsdp.yaml)"
            )


def distributed_type(device: dict[str, Any]) -> str:
    """The ``distributed_type`` the ``device`` section launches (``MULTI_GPU`` without an accelerate config)."""
    config = device.get("accelerate_config")
    return str(_read(config).get("distributed_type", "")).upper() if config else "MULTI_GPU"


def _read(path: str) -> dict[str, Any]:

    with open(path, encoding="utf-8") as handle:
        return yaml.safe_load(handle) or {}


FSDP_HINTS = {"fsdp_activation_checkpointing": "set <stage>.gradient_checkpointing in params.yaml instead"}
# what rlhf.runtime.sharding reads; every process must load the weights (transformers loads them on rank 0 alone
# otherwise)
FSDP_KEYS = {
    "fsdp_version": (2,),
    "fsdp_reshard_after_forward": (True, False),
    "fsdp_cpu_ram_efficient_loading": (False,),
}


def launch(module: str, processes: int, config: str | None, mixed_precision: str) -> int:
    """Run ``python -m <module>`` on ``processes`` processes with accelerate's launcher; their exit status.

    Returns:
        0 when every process succeeded; else the status of the lowest rank that exited with an error (1), or
        of the lowest rank a signal stopped (128 + its number); 128 + the signal's number when the launcher
        itself is stopped (SIGTERM, SIGINT).
    """
    from accelerate.commands.launch import launch_command, launch_command_parser  # noqa: PLC0415 (accelerate imports torch)
    from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: PLC0415 (torch: seconds to import)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: PLC0415 (torch: seconds to import)

    argv = ["--num_processes", str(processes)]
    argv += ["--config_file", config] if config else ["--multi_gpu", "--num_machines", "1"]
    argv += ["--mixed_precision", mixed_precision, "--dynamo_backend", "no", "-m", module]
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # the ranks say what failed
    os.environ[LAUNCHER] = str(os.getpid())  # the ranks die with this process (die_with_launcher)
    sys.stdout.flush()
    try:
        launch_command(launch_command_parser().parse_args(argv))
    except ChildFailedError as err:
        # the rank that raised, not one the launcher then stopped: rank 0 first, then the lowest (an exit code
        # above 0 is an error; a negative one a signal, e.g. the SIGTERM the launcher sends the others)
        failures = sorted(err.failures.items(), key=lambda item: (item[1].exitcode <= 0, item[0]))
        first = failures[0][1]
        return first.exitcode if first.exitcode > 0 else 128 - first.exitcode
    except SignalException as err:
        return 128 + int(err.sigval)
    return 0
