"""Where the tensors live and at which precision: one :class:`Runtime` per stage, taken from accelerate.

The stages build it from accelerate's ``Accelerator`` (:func:`runtime_from_params`): CUDA when present, the CPU
otherwise, and the ``device.mixed_precision`` of params.yaml (``auto``: bf16 where the device computes it
natively, :func:`native_bf16`). The trainers receive it, place their models and create every batch on
``runtime.device``, and run forward passes inside ``runtime.autocast()``.

``mixed_precision: bf16`` means: every model keeps float32 (master) weights and optimiser states, and forward
passes run under bfloat16 autocast (on CPUs with AMX or AVX512-BF16 and on GPUs; elsewhere a bf16 matmul is
emulated, tens of times slower than float32). ``frozen_bf16`` also stores the models PPO never trains
(reference, reward model) in bfloat16: half their memory, but their numbers then differ from the policy's even
where the weights are equal (see params.yaml ``device``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.runtime.distributed import UNSUPPORTED, Ranks
from rlhf.runtime.sharding import Sharding, sharding_from_environ

MIXED_PRECISION = ("no", "bf16")
SETTINGS = ("auto", *MIXED_PRECISION)  # what params.yaml may say: auto resolves to one of MIXED_PRECISION


@dataclass(frozen=True)
class Runtime:
    """A stage's device and precision.

    Attributes:
        device: where every model and batch lives.
        mixed_precision: ``"no"`` (float32 everywhere) or ``"bf16"`` (see the module docstring).
        frozen_bf16: models that are never trained are stored in bfloat16.
        ranks: this process among the training processes (``accelerate launch``; one by default).
        sharding: how the trainers shard the models they train (FSDP, :mod:`rlhf.runtime.sharding`); None: each
            process holds them whole.
    """

    device: torch.device = torch.device("cpu")
    mixed_precision: str = "no"
    frozen_bf16: bool = False
    ranks: Ranks = Ranks()
    sharding: Sharding | None = None

    def __post_init__(self) -> None:
        """Refuse a precision the trainers do not implement.

        Raises:
            ValueError: not one of ``no``, ``bf16`` (fp16 needs a loss scaler the trainers do not run).
        """
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(
                f"device.mixed_precision {self.mixed_precision!r}: use one of {', '.join(MIXED_PRECISION)} "
                "(fp16 needs a loss scaler the trainers do not run; bf16 needs none)"
            )

    @property
    def bf16(self) -> bool:
        """True under ``mixed_precision: bf16``."""
        return self.mixed_precision == "bf16"

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward-pass context: bfloat16 autocast on ``device`` under bf16, nothing otherwise."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move a model that will be trained (or must compute exactly as one) to ``device``, float32; returns it."""
        return model.to(device=self.device, dtype=torch.float32)

    def frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move a model that is never trained to ``device``, in bfloat16 under ``frozen_bf16``, its parameters
        ``requires_grad`` off (so :mod:`rlhf.models.trunk` can tell its frozen blocks from the weights); returns it."""
        model.requires_grad_(False)
        return model.to(device=self.device, dtype=torch.bfloat16 if self.frozen_bf16 else torch.float32)

    def synchronize(self) -> None:
        """Wait for queued device work (CUDA), so a wall-clock reading covers it; nothing on the CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bfloat16 matmuls natively: a CUDA device with bf16 support, or a CPU with AMX or
    AVX512-BF16. Elsewhere (e.g. an AVX2-only CPU) torch emulates them: a 512 x 576 x 1536 matmul took 736 ms in
    bf16 against 10.5 ms in float32 on a 2-core AMD EPYC (AVX2) here."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def mixed_precision(params: dict[str, Any]) -> str:
    """The params.yaml ``device.mixed_precision`` as the trainers run it: ``no`` or ``bf16``.

    ``auto`` is ``bf16`` where the stage's device (CUDA when present and ``cpu`` is false, else the CPU) computes
    bf16 natively (:func:`native_bf16`), else ``no``. YAML reads an unquoted ``no`` as false, which means
    ``"no"`` here.

    Raises:
        ValueError: not one of ``auto``, ``no``, ``bf16``.
    """
    value = "no" if params["mixed_precision"] is False else params["mixed_precision"]
    if value not in SETTINGS:
        raise ValueError(
            f"device.mixed_precision {value!r}: use one of {', '.join(SETTINGS)} "
            "(fp16 needs a loss scaler the trainers do not run; bf16 needs none)"
        )
    if value != "auto":
        return value
    return "bf16" if native_bf16(stage_device(params)) else "no"


def stage_device(params: dict[str, Any]) -> torch.device:
    """Where a stage runs: CUDA when present and the ``device`` section's ``cpu`` is false, else the CPU (as
    accelerate chooses)."""
    return torch.device("cuda" if torch.cuda.is_available() and not params.get("cpu") else "cpu")


def runtime_from_accelerator(accelerator: Any) -> Runtime:
    """The :class:`Runtime` of an ``accelerate.Accelerator`` (its device, ``mixed_precision`` and processes).

    Raises:
        ValueError: a mixed precision other than ``no`` or ``bf16``.
    """
    return Runtime(
        device=torch.device(accelerator.device),
        mixed_precision=str(accelerator.mixed_precision),
        ranks=Ranks(accelerator.process_index, accelerator.num_processes),
    )


def runtime_from_params(params: dict[str, Any]) -> Runtime:
    """Build the stage's :class:`Runtime` from the params.yaml ``device`` section through accelerate.

    Under ``accelerate launch`` with several processes, the process group is set up here (NCCL on GPUs,
    gloo on CPUs: accelerate takes a machine without CUDA as ``cpu``, else it would start no group there).

    Args:
        params: ``{"mixed_precision": "auto" | "no" | "bf16", "cpu": bool, "frozen_bf16": bool}``; ``cpu: true``
            stays on the CPU where CUDA is present.

    Raises:
        ValueError: an unknown mixed precision (:func:`mixed_precision`; checked before accelerate is asked, whose own
            error would be a traceback); a launch with DeepSpeed or Megatron-LM
            (:data:`rlhf.runtime.distributed.UNSUPPORTED`), which the trainers do not implement, or with an FSDP setting
            they do not implement (:func:`rlhf.runtime.sharding.sharding_from_environ`).
            :func:`tasks.kit.launch.check_accelerate_config` refuses those configs before launching; this catches
            ``accelerate launch --config_file ...`` by hand.
    """
    from accelerate import Accelerator  # noqa: PLC0415 (accelerate imports torch)

    precision = mixed_precision(params)  # the clear refusal first
    unsupported = [name for name in UNSUPPORTED if os.environ.get(f"ACCELERATE_USE_{name}", "").lower() == "true"]
    if unsupported:
        raise ValueError(
            f"accelerate launched with {unsupported[0]}: the trainers run data parallel or FSDP only; use "
            "infra/accelerate/ddp.yaml or infra/accelerate/fsdp.yaml"
        )
    sharding = sharding_from_environ()
    accelerator = Accelerator(mixed_precision=precision, cpu=stage_device(params).type == "cpu")
    runtime = runtime_from_accelerator(accelerator)
    return dataclasses.replace(runtime, frozen_bf16=bool(params["frozen_bf16"]), sharding=sharding)


class PhaseTimer:
    """Wall-clock seconds per named phase (e.g. ``generation``, ``update``), summed over repeats.

    ``with timer("generation"): ...`` waits for the device before and after, so
    queued GPU work is counted in the phase that queued it.
    """

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        """Time the block as ``phase``."""
        self.runtime.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.runtime.synchronize()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def stats(self, prefix: str) -> dict[str, float]:
        """``{f"{prefix}/{phase}": seconds}``."""
        return {f"{prefix}/{phase}": seconds for phase, seconds in self.seconds.items()}


def timed(timer: PhaseTimer | None, phase: str) -> contextlib.AbstractContextManager[None]:
    """``timer(phase)`` when a timer is given, else a context that records nothing (optional timing)."""
    return timer(phase) if timer is not None else contextlib.nullcontext()
