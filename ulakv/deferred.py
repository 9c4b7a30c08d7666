"""Refusals raised without a host sync: a pool that does not validate each call (the CUDA default)
learns of a refused ``prepare`` or ``write`` from a host copy of the device's pending-error word.

A refused call changes nothing on the device and returns ``-1`` for every slot; its status bits are
OR-ed into the control word ``E_PENDING``. After each such call the pool copies that word into pinned
host memory with ``non_blocking=True`` and records a CUDA event behind the copy. Each later call
looks at the copy, without waiting, once the event has completed (``Event.query``, which never
blocks): a nonzero status is raised there, to that call's caller, and cleared on both sides. So an
error surfaces at the first call made after the refused call finished on the GPU, usually the next
step's, and at the latest at the next synchronising call (``check``, ``stats``, ``read``). On the
CPU the copy lands at once: the very next call raises. Inside a CUDA-graph capture nothing is
looked at (the copy is captured, and replays refresh it).
"""

from __future__ import annotations

import torch

from .kernels import common as K


class DeferredStatus:
    """The host side of one pool's pending-error word."""

    def __init__(self, ctl: torch.Tensor) -> None:
        self._pending = ctl[int(K.E_PENDING) : int(K.E_PENDING) + 1]
        self._cuda = ctl.device.type == "cuda"
        self._host = torch.zeros(1, dtype=torch.int64, pin_memory=self._cuda)
        self._value = self._host.numpy()  # read as plain memory: no tensor op, no sync
        self._landed: torch.cuda.Event | None = None

    def publish(self) -> None:
        """Start copying the device word to the host (after a call that did not validate)."""
        if self._pending.device.type == "meta":
            return
        self._host.copy_(self._pending, non_blocking=True)
        if self._cuda and not torch.cuda.is_current_stream_capturing():
            self._landed = torch.cuda.Event()
            self._landed.record()

    def take(self) -> int:
        """The status bits the host has seen (0 if none, or if the last copy is still in flight),
        cleared on the host and the device once seen."""
        if self._cuda and torch.cuda.is_current_stream_capturing():
            return 0
        if self._landed is not None and not self._landed.query():
            return 0
        status = int(self._value[0])
        if status:
            self._value[0] = 0
            self._pending.zero_()  # in stream order: after every copy made so far
        return status

    def forget(self) -> None:
        """The device word was read and cleared synchronously (``check``): drop the host copy."""
        self._value[0] = 0
