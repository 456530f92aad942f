"""A check that fails on any tensor our code creates or moves off the chosen device, and counts host round trips.

Not a test module (no ``test_`` prefix): the tests import it as ``from device_check import DeviceCheck``,
as they import ``conftest`` (pytest puts ``tests/`` on ``sys.path``).

:class:`DeviceCheck` is a ``torch.overrides.TorchFunctionMode``: inside ``with DeviceCheck(device):`` every
call of a torch function or Tensor method from Python reaches its ``__torch_function__`` first
(calls that torch makes while handling one are not seen again: the mode is off during its own call).
It records three things:

- **Factory violations** (``kind="factory"``): a tensor factory (:data:`FACTORIES`: ``torch.tensor``,
  ``zeros``, ``arange``, ``linspace``, ...) called by *our code* without an explicit ``device=``, or with
  one other than the chosen device. Without ``device=`` the tensor lands on torch's default device (the
  CPU), so the rule fails on a CPU-only machine although the tensor would be on the right device there.
  ``torch.tensor``/``as_tensor``/``asarray`` of a tensor keep that tensor's device and need no ``device=``;
  ``*_like`` and ``Tensor.new_*`` inherit their source's device (only a ``device=`` they name is checked);
  ``torch.from_numpy`` always makes a CPU tensor and is a violation from our code unless the chosen
  device is the CPU.
- **Move violations** (``kind="move"``): ``Tensor.to``, ``.cpu()``, ``.cuda()`` (:data:`MOVES`) returning a
  tensor on another device, and any factory whose result is on another device, *from any caller*
  (transformers included: on the chosen device it makes no such move in these tests; ``torch``'s own
  code is exempt, e.g. optimiser state kept on the CPU on purpose).
- **Host round trips** (:attr:`DeviceCheck.syncs`): the Tensor methods that copy a value to the host
  (:data:`SYNCS`: ``item``, ``tolist``, ``__float__``, ``__int__``, ``__bool__`` (``if t:``, ``bool(t)``),
  ``__index__``, ``__format__``, ``__complex__``, ``numpy``, ``__array__``, ``cpu``) called by our code,
  each with the caller's ``file:line`` and the chain of our functions above it. Separately
  (:attr:`DeviceCheck.implicit_syncs`) the calls whose output shape depends on the data, which wait for
  the device on CUDA: ``nonzero``, ``masked_select``, ``unique``, ``argwhere``, single-argument ``where``,
  ``repeat_interleave`` with tensor repeats, and indexing (``t[mask]``, ``t[mask] = x``) with a bool tensor.

Verified on torch 2.13 (``test_device.py::test_probe_which_methods_reach_torch_function``): every one of
``item``, ``tolist``, ``__float__`` (also through ``math.isfinite(t)``), ``__int__``, ``__bool__`` (also
through ``if t:``), ``__index__`` (``list[t]``), ``__format__`` (f-strings), ``__complex__``, ``numpy``,
``__array__`` (``numpy.asarray(t)``), ``cpu``, ``to``, the factories and the ``*_like``/``new_*`` functions
reaches ``__torch_function__``; ``iter(t)`` shows up as ``unbind``, ``len(t)`` as ``__len__`` (no sync).

Who called: the stack is walked from the call outwards, skipping this module and torch's dispatch
frames (``torch/overrides.py``, ``torch/_tensor.py``, ``torch/functional.py``, ``torch/utils/_contextlib.py``:
``torch.no_grad`` as a decorator). The first frame left is the caller: *ours* when its file is under one of
the ``ours`` path prefixes (default: ``src/rlhf/``), *torch* when it is elsewhere in torch (an optimiser's
``step`` reading its CPU step counter with ``.item()``, ``clip_grad_norm_``: torch's business, not a round
trip of ours), *other* otherwise (transformers' ``generate`` makes many per token; they are not counted).
The ``ours`` prefixes are configurable so the self-test can point them at a test file.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
SRC_RLHF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "rlhf") + os.sep
"""The default "our code": every file under ``src/rlhf/``."""

_THIS_FILE = os.path.abspath(__file__)
_DISPATCH = tuple(
    os.path.join(TORCH_DIR, name) for name in ("overrides.py", "_tensor.py", "functional.py", "utils/_contextlib.py")
)

FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.asarray,
    torch.scalar_tensor,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    torch.empty_strided,
    torch.arange,
    torch.range,
    torch.linspace,
    torch.logspace,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.tril_indices,
    torch.triu_indices,
}
"""Functions that make a tensor from sizes or Python data: without ``device=`` it lands on the default device."""

FROM_TENSOR_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
"""Factories that keep the device of tensor data (``torch.tensor(t)`` copies ``t`` where it is)."""

INHERITING = {
    torch.zeros_like,
    torch.ones_like,
    torch.full_like,
    torch.empty_like,
    torch.rand_like,
    torch.randn_like,
    torch.randint_like,
    torch.Tensor.new_zeros,
    torch.Tensor.new_ones,
    torch.Tensor.new_full,
    torch.Tensor.new_empty,
    torch.Tensor.new_tensor,
}
"""Factories that inherit their source's device unless they name another."""

MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}

SYNCS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
    torch.Tensor.__format__,
    torch.Tensor.__complex__,
    torch.Tensor.numpy,
    torch.Tensor.__array__,
    torch.Tensor.cpu,
}
"""Tensor methods that bring a value to the host (one device sync each on CUDA)."""

DATA_DEPENDENT = {
    torch.nonzero,
    torch.Tensor.nonzero,
    torch.masked_select,
    torch.Tensor.masked_select,
    torch.unique,
    torch.Tensor.unique,
    torch.argwhere,
    torch.Tensor.argwhere,
}
"""Functions whose output shape depends on the data (the host waits for the device to size the output)."""


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _has_bool_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


@dataclass(frozen=True)
class Event:
    """One recorded call.

    Attributes:
        kind: ``factory`` or ``move`` (violations), ``sync`` or ``implicit`` (host round trips).
        func: the function's name, e.g. ``zeros`` or ``item``.
        where: the caller's ``path:line`` (path relative to the repository when inside it).
        owner: ``ours``, ``torch`` or ``other``.
        chain: the names of our functions on the stack, outermost first (empty for other callers).
        detail: what was wrong, for violations.
    """

    kind: str
    func: str
    where: str
    owner: str
    chain: tuple[str, ...] = ()
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind} {self.func} at {self.where} ({self.owner}){': ' + self.detail if self.detail else ''}"


class DeviceCheck(TorchFunctionMode):
    """``with DeviceCheck(torch.device("cpu")) as check: ...``, then read ``check.violations`` and ``check.syncs``.

    Args:
        device: the chosen device every tensor must live on.
        ours: path prefixes of "our code" (default: ``src/rlhf/``).

    Attributes:
        violations: factory and move :class:`Event` s, in call order.
        syncs: host round trips made by our code.
        implicit_syncs: data-dependent-shape calls made by our code.
    """

    def __init__(self, device: torch.device | str, ours: tuple[str, ...] = (SRC_RLHF,)):
        super().__init__()
        self.device = torch.device(device)
        self.ours = tuple(ours)
        self.violations: list[Event] = []
        self.syncs: list[Event] = []
        self.implicit_syncs: list[Event] = []
        self._root = os.path.dirname(os.path.dirname(_THIS_FILE)) + os.sep

    # ------------------------------------------------------------------ who called
    def _caller(self) -> tuple[str, str, tuple[str, ...]]:
        """``(owner, "path:line", our functions outermost first)`` of the code that made the current call."""
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if name != _THIS_FILE and not name.startswith(_DISPATCH):
                break
            frame = frame.f_back
        if frame is None:
            return "other", "?", ()
        name = frame.f_code.co_filename
        where = f"{name.removeprefix(self._root)}:{frame.f_lineno}"
        if name.startswith(TORCH_DIR):
            return "torch", where, ()
        if not name.startswith(self.ours):
            return "other", where, ()
        chain = []
        outer = frame
        while outer is not None:
            if outer.f_code.co_filename.startswith(self.ours):
                chain.append(outer.f_code.co_name)
            outer = outer.f_back
        return "ours", where, tuple(reversed(chain))

    def _record(self, bucket: list[Event], kind: str, func: Any, caller, detail: str = "") -> None:
        owner, where, chain = caller
        bucket.append(Event(kind, getattr(func, "__name__", str(func)), where, owner, chain, detail))

    # ------------------------------------------------------------------ the mode
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        watched = func in FACTORIES or func in INHERITING or func in MOVES or func in SYNCS
        implicit = func in DATA_DEPENDENT or (
            func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _has_bool_index(args[1])
        )
        implicit = implicit or (func is torch.where and len(args) + len(kwargs) == 1)
        implicit = implicit or (
            func in (torch.repeat_interleave, torch.Tensor.repeat_interleave)
            and len(args) > 1
            and isinstance(args[1], torch.Tensor)
            and "output_size" not in kwargs
        )
        caller = self._caller() if watched or implicit else None
        if caller is not None and caller[0] == "ours":
            if func in SYNCS:
                self._record(self.syncs, "sync", func, caller)
            if implicit:
                self._record(self.implicit_syncs, "implicit", func, caller)
            if func in FACTORIES:
                self._check_factory(func, args, kwargs, caller)
            elif func in INHERITING and kwargs.get("device") is not None:
                self._check_named(func, kwargs["device"], caller)
        if caller is None and func is torch.from_numpy:
            caller = self._caller()
            if caller[0] == "ours" and self.device.type != "cpu":
                self._record(self.violations, "factory", func, caller, "from_numpy makes a CPU tensor")
        result = func(*args, **kwargs)
        if caller is not None and caller[0] != "torch" and (func in MOVES or func in FACTORIES or func in INHERITING):
            for out in result if isinstance(result, tuple) else (result,):
                if isinstance(out, torch.Tensor) and not _same_device(out.device, self.device):
                    self._record(self.violations, "move", func, caller, f"result on {out.device}, not {self.device}")
        return result

    def _check_factory(self, func, args, kwargs, caller) -> None:
        device = kwargs.get("device")
        if device is None and func is torch.as_tensor and len(args) > 2:
            device = args[2]  # as_tensor(data, dtype, device)
        if device is None:
            data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
            if func in FROM_TENSOR_DATA and isinstance(data, torch.Tensor):
                return  # keeps the data's device
            self._record(self.violations, "factory", func, caller, "no device= (lands on the default device)")
            return
        self._check_named(func, device, caller)

    def _check_named(self, func, device, caller) -> None:
        named = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if not _same_device(named, self.device):
            self._record(self.violations, "factory", func, caller, f"device={named}, not {self.device}")

    # ------------------------------------------------------------------ reading the records
    def syncs_in(self, function: str) -> list[Event]:
        """The host round trips made with our function ``function`` on the stack (e.g. ``"policy_step"``)."""
        return [s for s in self.syncs if function in s.chain]

    def report(self) -> str:
        """Every violation and host round trip, one a line (for assertion messages)."""
        return "\n".join(str(e) for e in [*self.violations, *self.syncs, *self.implicit_syncs])
