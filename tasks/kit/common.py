"""What every stage shares besides params, runs, outputs and resume: torch set-up and the command-line wrapper."""

from __future__ import annotations

import os
import re
import signal
import sys
import unicodedata
from typing import Any

import typer

from tasks.kit.console import quiet_libraries
from tasks.kit.params import stage_params


def setup_torch(seed: int) -> None:
    """Seed torch and use every core."""
    import torch  # noqa: PLC0415 here, not at the top: stages that train nothing (source, the flow's params check) stay light

    torch.manual_seed(seed)
    torch.set_num_threads(max(os.cpu_count() or 1, 1))


def stage_runtime(stage: str, device: dict[str, Any] | None = None):
    """The stage's :class:`rlhf.runtime.device.Runtime` from accelerate and the ``device`` section; prints it in one
    line,
    and a WARNING line when bf16 is asked of a device that only emulates it (:func:`rlhf.runtime.device.native_bf16`).

    Args:
        stage: named in the line, e.g. ``"sft"``.
        device: the params.yaml ``device`` section (profile applied); None reads it from params.yaml.

    Raises:
        ValueError: an unknown ``device.mixed_precision``.
    """
    from rlhf.runtime.device import native_bf16, runtime_from_params  # noqa: PLC0415 (imports torch and transformers)

    params = device if device is not None else stage_params("device")
    runtime = runtime_from_params(params)
    processes = runtime.ranks.world_size
    kind = "data parallel" if runtime.sharding is None else "FSDP: trained models sharded"
    if runtime.ranks.main:
        chosen = " (auto)" if params["mixed_precision"] == "auto" else ""
        print(
            f"[{stage}] device {runtime.device}, mixed precision {runtime.mixed_precision}{chosen}"
            f"{', frozen models in bf16' if runtime.frozen_bf16 else ''}"
            f"{f', {processes} processes ({kind})' if processes > 1 else ''}",
            flush=True,
        )
        if (runtime.bf16 or runtime.frozen_bf16) and not native_bf16(runtime.device):
            print(
                f"[{stage}] WARNING: {runtime.device} has no native bf16 (a CPU without AMX or AVX512-BF16, a GPU "
                "without bf16): its bf16 matmuls are emulated, tens of times slower than float32; "
                "device.mixed_precision: auto (or no) and frozen_bf16: false run float32 here",
                flush=True,
            )
    return runtime


SERVICE_ERRORS = (  # (module, class): the errors of a tracking server or an object store
    ("mlflow.exceptions", "MlflowException"),
    ("requests.exceptions", "RequestException"),
    ("botocore.exceptions", "BotoCoreError"),
    ("botocore.exceptions", "ClientError"),
    ("boto3.exceptions", "Boto3Error"),
)
USERINFO = re.compile(r"(://)[^\s@'\"]*@")
MAX_LINE = 500


def service_errors() -> tuple[type[BaseException], ...]:
    """The classes of :data:`SERVICE_ERRORS` whose module is loaded (one not loaded cannot have raised)."""
    return tuple(getattr(sys.modules[module], name) for module, name in SERVICE_ERRORS if module in sys.modules)


UNPRINTABLE = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
"""Unicode categories a terminal must not receive raw: controls (newlines, the escape that starts a colour or
cursor code), format characters (bidirectional overrides), surrogates, private-use, unassigned, line and
paragraph separators."""


def terminal_text(text: Any) -> str:
    """``text`` safe to print within one terminal line: each :data:`UNPRINTABLE` character written as its Python
    escape (``\\n``, ``\\x1b``, ``\\u202e``). What people typed is stored as it was; only its display is escaped."""
    return "".join(
        ch.encode("unicode_escape").decode("ascii") if unicodedata.category(ch) in UNPRINTABLE else ch
        for ch in str(text)
    )


def echo(text: Any, err: bool = False) -> None:
    """Print ``text`` as one terminal line through :func:`terminal_text` (to stderr with ``err``): the commands that
    print what people typed or the registry holds print only through it, so no field reaches the terminal raw."""
    typer.echo(terminal_text(text), err=err)


def one_line(message: str) -> str:
    """The first line of ``message`` (joined with the next while it ends with ``:``, which announces the cause:
    ``Failed to download artifacts:`` then why), at most :data:`MAX_LINE` characters, with the ``user:password@``
    of any URL in it cut out."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    line = lines[0] if lines else ""
    for following in lines[1:]:
        if not line.endswith(":"):
            break
        line = f"{line} {following}"
    line = USERINFO.sub(r"\1", line)
    return line if len(line) <= MAX_LINE else line[: MAX_LINE - 3] + "..."


def cli(main) -> None:
    """Run a stage's ``main`` with the libraries quiet (:func:`tasks.kit.console.quiet_libraries`); known failures
    end with one line on stderr and a non-zero exit, not a traceback.

    - ``ValueError``, ``FileNotFoundError``, ``KeyError``: bad input or configuration (their
      messages name the file, row, param and rule); exit 1.
    - ``FloatingPointError``: training diverged (the message names the stage and step); exit 1.
    - An error of a tracking server or object store (:data:`SERVICE_ERRORS`: MLflow's, requests', boto's; a
      server that is down, a refused credential): exit 1, with the message's first line, which names the
      server or bucket (any ``user:password@`` of a URL in it is cut out).
    - :class:`Stopped` (SIGTERM, SIGHUP) or Ctrl-C: exit 128 + the signal's number, as a shell reports it.

    The line starts with the stage's name, e.g. ``[sft] error: FloatingPointError: sft: non-finite
    sft/loss (nan) at step 3 of 4; training stopped``. Anything else is a bug and keeps its traceback.
    """
    spec = getattr(sys.modules.get(main.__module__), "__spec__", None)
    stage = (spec.name if spec else main.__module__).rsplit(".", 1)[-1]
    quiet_libraries(stage)
    try:
        main()
    except (ValueError, FileNotFoundError, KeyError, FloatingPointError) as err:
        print(f"[{stage}] error: {type(err).__name__}: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    except service_errors() as err:
        print(f"[{stage}] error: {type(err).__name__}: {one_line(str(err))}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt as err:
        signum = getattr(err, "signum", signal.SIGINT)
        print(f"[{stage}] stopped by {signal.Signals(signum).name}", file=sys.stderr)
        raise SystemExit(128 + signum) from None
