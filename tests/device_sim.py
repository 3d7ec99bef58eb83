"""A CPU stand-in for ``cuda:r``: run per-rank code as if its device were a GPU, and log what
CUDA and NCCL would reject.

:class:`TaggedDevice` is a ``TorchFunctionMode`` entered in each simulated rank's thread.  The
rank's ``ctx.device`` is ``cuda:0``, a device this CPU build of torch cannot allocate on; the
mode turns every creation on it, or move to it, into a CPU tensor *tagged* as living there, tags
everything computed from a tagged tensor, reports ``cuda:0`` as the device of tagged tensors
(``cpu`` for the others) and hands back an untagged copy for ``.cpu()`` / ``.to("cpu")``.  It
logs (:class:`DeviceLog`):

* ``mix`` — one op given tagged and untagged tensors (CPU tensors of 0 dimensions excepted, and
  CPU index tensors of a tagged tensor's ``[]``, which CUDA accepts);
* ``collective`` — a collective or send/recv of the simulated backend given an untagged tensor,
  and ``collective-shape`` — one whose per-rank tensors differ in shape or dtype (NCCL needs
  equal ones);
* ``sync`` — a host read of a tagged tensor (``.item()``, ``.tolist()``, ``int()``, ``bool()``,
  ``torch.equal`` ...) and ``shape-sync`` — an op whose output size depends on a tagged tensor's
  values (boolean-mask indexing, ``nonzero``): both stall the host until the GPU is done;
* ``host-kernel`` — the fused CPU attention kernel ran (only host tensors can reach it, since
  tagged ones report ``cuda:0``): attention that should have run on the device;
* ``d2h`` — an explicit copy of a tagged tensor to the host (allowed; counted).

Every event carries the innermost ``cpbook`` function that caused it (``module:qualname``; for
a collective, the caller of the communication layer) and its line.  :func:`simulated_devices`
patches :class:`~cpbook.core.backends.SimGroup` for the collective checks while it is active.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from cpbook.core.backends import SimGroup

DEVICE = torch.device("cuda", 0)
_CPU = torch.device("cpu")
_TAG = "_cpbook_on_device"

_SYNC = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "__complex__"}
_SYNC |= {"__repr__", "__format__", "numpy", "equal", "allclose"}
_SHAPE_SYNC = {"nonzero", "masked_select", "unique", "argwhere"}
_MOVES = {"to", "cpu", "cuda", "type_as"}  # may change a tensor's device


def tagged(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and getattr(x, _TAG, False)


def _tag(x: torch.Tensor, on: bool) -> torch.Tensor:
    setattr(x, _TAG, on)
    return x


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


_COMM = ("cpbook.core.comm", "cpbook.core.backends")


def _site(skip: tuple[str, ...] = ()) -> tuple[str, int]:
    """The innermost frame of cpbook's (or a test's) code outside the modules ``skip``:
    ``("module:qualname", line)``."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if name.startswith(("cpbook", "tests.")) and name != __name__ and name not in skip:
            return f"{name}:{f.f_code.co_qualname.split('.<locals>')[0]}", f.f_lineno
        f = f.f_back
    return "<outside>", 0


@dataclass(frozen=True)
class Event:
    kind: str
    op: str
    site: str
    line: int
    detail: str = ""


class DeviceLog:
    """Every event of a run, from every rank thread."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def add(self, kind: str, op: str, detail: str = "") -> None:
        site, line = _site(_COMM if kind.startswith("collective") else ())
        with self._lock:
            self.events.append(Event(kind, op, site, line, detail))

    def of(self, *kinds: str) -> list[Event]:
        return [e for e in self.events if e.kind in kinds]

    def counts(self, *kinds: str) -> Counter:
        """``(kind, site) -> events``."""
        return Counter((e.kind, e.site) for e in self.of(*kinds))

    def table(self, *kinds: str) -> str:
        """One line per (kind, site): its count, an example op and line."""
        first: dict[tuple[str, str], Event] = {}
        for e in self.of(*kinds):
            first.setdefault((e.kind, e.site), e)

        def line(key: tuple[str, str], n: int) -> str:
            e = first[key]
            return (
                f"{n:6d} {e.kind:16s} {e.site}:{e.line} ({e.op}{': ' * bool(e.detail)}{e.detail})"
            )

        return "\n".join(
            line(key, n) for key, n in sorted(self.counts(*kinds).items(), key=lambda kv: -kv[1])
        )


def _device_of(x: Any) -> torch.device | None:
    if isinstance(x, (str, torch.device)):
        d = torch.device(x)
        return DEVICE if d.type == "cuda" and d.index in (None, DEVICE.index) else d
    return None


def _to_cpu_arg(x: Any) -> Any:
    return "cpu" if _device_of(x) is not None else x


def _efficient_attention(q, k, v, bias, compute_lse, dropout, causal, *, scale=None):
    """What CUDA's memory-efficient kernel returns, from the CPU flash kernel: the LSE padded
    to a multiple of 32 queries."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout, causal, scale=scale
    )[:2]
    pad = -q.shape[2] % 32
    lse = torch.nn.functional.pad(lse, (0, pad))
    return out, lse, torch.zeros(()), torch.zeros(())


class TaggedDevice(TorchFunctionMode):
    """Run the enclosed code as if :data:`DEVICE` were a GPU (see the module docstring)."""

    def __init__(self, log: DeviceLog) -> None:
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        owner = getattr(func, "__self__", None)  # a property getter: its descriptor
        if owner is torch.Tensor.device:
            return DEVICE if tagged(args[0]) else _CPU
        if owner is torch.Tensor.is_cuda:
            return tagged(args[0])
        ins = _tensors((args, kwargs))
        on = [t for t in ins if tagged(t)]
        off = [t for t in ins if not tagged(t) and t.dim() > 0]
        if name in _SYNC and on:
            self.log.add("sync", name)
        if name in _SHAPE_SYNC and on:
            self.log.add("shape-sync", name)
        if name == "_scaled_dot_product_flash_attention_for_cpu":
            self.log.add("host-kernel", name, f"q {tuple(args[0].shape)}")
        target = self._target(name, args, kwargs)
        if name in ("__getitem__", "__setitem__"):
            self._check_index(name, args)
        elif name not in _MOVES:
            self._check_mix(name, on, off)
        if name == "_scaled_dot_product_efficient_attention" and on:
            return tree_map(lambda t: _tag(t, True), _efficient_attention(*args, **kwargs))
        args = tuple(_to_cpu_arg(a) for a in args) if name in _MOVES else args
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _to_cpu_arg(kwargs["device"])}
        out = func(*args, **kwargs)
        if target is None:  # computed: on the device if any input was
            tag = bool(on)
        else:
            tag = target == DEVICE
            src = args[0] if name in _MOVES and args and isinstance(args[0], torch.Tensor) else None
            if src is not None and out is src and tagged(src) != tag:
                out = out.clone()  # a real move makes a new tensor; the CPU no-op does not
            if src is not None and tagged(src) and not tag:
                self.log.add("d2h", name)
        if not isinstance(out, torch.Tensor) and not isinstance(out, (tuple, list)):
            return out
        for t in _tensors(out):
            if not any(t is i for i in ins) or target is not None:
                _tag(t, tag)
        return out

    def _target(self, name: str, args: tuple, kwargs: dict) -> torch.device | None:
        """The device this call creates on or moves to, if it names one."""
        if name == "cpu":
            return _CPU
        if name == "cuda":
            return DEVICE
        if name == "type_as":
            return DEVICE if tagged(args[1]) else _CPU
        found = [_device_of(a) for a in (*args[1:], kwargs.get("device"))] if name == "to" else []
        found += [_device_of(kwargs.get("device"))]
        if name == "to" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            found.append(DEVICE if tagged(args[1]) else _CPU)
        found = [d for d in found if d is not None]
        for d in found:
            if d.type not in ("cpu", "cuda") or d not in (DEVICE, _CPU):
                self.log.add("wrong-device", name, str(d))
        return found[0] if found else None

    def _check_mix(self, name: str, on: list, off: list) -> None:
        if name == "copy_" or not (on and off):
            return
        self.log.add("mix", name, f"{len(on)} on device, {len(off)} on the host")

    def _check_index(self, name: str, args: tuple) -> None:
        """CUDA accepts host index tensors for a device tensor, not the other way round; a
        value written through advanced indexing must be on the indexed tensor's device."""
        self_t, index = args[0], args[1]
        idx = _tensors(index)
        if not tagged(self_t) and any(tagged(i) for i in idx):
            self.log.add("mix", name, "device index into a host tensor")
        if tagged(self_t) and any(tagged(i) and i.dtype == torch.bool for i in idx):
            self.log.add("shape-sync", name, "boolean mask on the device")
        if name == "__setitem__":
            value = args[2]
            if (
                isinstance(value, torch.Tensor)
                and value.dim() > 0
                and idx
                and tagged(value) != tagged(self_t)
            ):
                self.log.add("mix", name, "value and tensor on different devices")


# ------------------------------------------------------------------------------------------
# the simulated backend, checked
# ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def simulated_devices() -> Iterator[tuple[DeviceLog, Callable]]:
    """Patch :class:`SimGroup` to check every collective; yields ``(log, wrap)`` where
    ``wrap(fn)`` is ``fn`` run under :class:`TaggedDevice` in its rank thread."""
    log = DeviceLog()
    exchange, sendrecv = SimGroup._exchange, SimGroup._sendrecv

    def checked_exchange(self, what, value):
        if isinstance(value, torch.Tensor) and not tagged(value):
            log.add("collective", what, f"host tensor {tuple(value.shape)}")
        got = exchange(self, what, value)
        if self.rank == 0 and isinstance(value, torch.Tensor):
            kinds = {(tuple(x.shape), x.dtype) for x in got}
            if len(kinds) > 1:
                log.add("collective-shape", what, str(sorted(map(str, kinds))))
        return got

    def checked_sendrecv(self, t, dst, buf, src):
        for x, role in ((t, "send"), (buf, "recv")):
            if x is not None and not tagged(x):
                log.add("collective", role, f"host tensor {tuple(x.shape)}")
        return sendrecv(self, t, dst, buf, src)

    def wrap(fn: Callable) -> Callable:
        def on_device(ctx, **kwargs):
            with TaggedDevice(log):
                return fn(ctx, **kwargs)

        on_device.__name__ = fn.__name__
        return on_device

    SimGroup._exchange, SimGroup._sendrecv = checked_exchange, checked_sendrecv
    try:
        yield log, wrap
    finally:
        SimGroup._exchange, SimGroup._sendrecv = exchange, sendrecv
