"""Refusals raised without a host sync, and without a copy or an event a call.

A pool that does not validate each call (the CUDA default) cannot read a call's status back without
waiting for the GPU. A refused ``prepare``, ``write``, ``admit_addresses`` or ``release_addresses``
changes nothing on the device and returns ``-1`` for every slot; its status bits are OR-ed into
the control word ``E_PENDING``, and the one program that decided the refusal also *reports* it:
one aligned 8-byte store, ``refusals << 32 | call << 8 | status``, into a word of host memory
mapped for the device (``TieredState.report``, ``kernels.common.report_refusal``). ``refusals``
counts the pool's refused calls, so the host tells a new report from one it has raised.

Each later call reads that word as plain memory: no copy, no CUDA event, no wait, nothing launched.
A report the host has not raised yet is raised there, to that call's caller, naming the kind of call
refused (and how many were refused since the last one raised), and the device's ``E_PENDING`` is
cleared in stream order. So an error surfaces at the first call made after the refusing kernel's
store reached host memory, usually the next step's, and at the latest at the next synchronising
call (``check``, ``stats``, ``read``), which reads ``E_PENDING`` and the word together. On the CPU
the store is immediate: the very next call raises. Inside a CUDA-graph capture nothing is looked at
(the store is captured with its kernel; replays report their own refusals).

Before this word, every non-validating call copied ``E_PENDING`` to pinned memory and recorded an
event behind the copy: about 123 copies and events a decode step of a 61-layer model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import common as K


@dataclass(frozen=True)
class Refusal:
    """A refused call the host has learnt of: its status bits (``ST_*``), the kind of call
    (``prepare``, ``write``, ``admit_addresses``, ``release_addresses``) and how many calls were
    refused since the last refusal raised (this one included; only the latest one's bits are kept)."""

    status: int
    call: str
    calls: int = 1

    def describe(self) -> str:
        """``an earlier write (refused: ...)`` and the count, for an error message."""
        more = f", the latest of {self.calls} refused calls" if self.calls > 1 else ""
        slots = ": its slots were -1" if self.call == "prepare" else ""
        return f"an earlier {self.call} (refused{more}{slots})"


class DeferredStatus:
    """The host side of one pool's refusal report."""

    def __init__(self, report: torch.Tensor, ctl: torch.Tensor) -> None:
        self._pending = ctl[int(K.E_PENDING)].view(1)
        self._cuda = ctl.device.type == "cuda"
        # Read as plain memory: no tensor op, no copy, no sync (a meta pool reports nothing).
        self._word = None if report.device.type == "meta" else report.numpy()
        self._seen = 0  # the refusal count of the last report raised or forgotten

    def take(self) -> Refusal | None:
        """The report of a refusal not raised yet, if its store has reached host memory; marked
        seen, and the device's pending word cleared (in stream order, a launch, no wait)."""
        if self._word is None or (self._cuda and torch.cuda.is_current_stream_capturing()):
            return None
        word = int(self._word[0])
        refusals = word >> 32
        if refusals == self._seen:
            return None
        calls = (refusals - self._seen) & 0xFFFFFFFF
        self._seen = refusals
        self._pending.zero_()
        call = K.CALL_NAMES.get((word >> 8) & 0xFF, "call")
        return Refusal(status=word & 0xFF, call=call, calls=calls)

    def forget(self) -> None:
        """After a synchronising read of ``E_PENDING`` (``check``): every report so far is seen."""
        if self._word is not None:
            self._seen = int(self._word[0]) >> 32
