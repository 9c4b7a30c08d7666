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

from collections.abc import Sequence
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
    """The host side of one pool's refusal reports: one word per call context (``TieredRunner``),
    each with its own count, and the pending words to clear when one is raised."""

    def __init__(self, reports: Sequence[torch.Tensor], pending: Sequence[torch.Tensor]) -> None:
        self._pending = [ctl[int(K.E_PENDING)].view(1) for ctl in pending]
        self._cuda = reports[0].device.type == "cuda" or pending[0].device.type == "cuda"
        # Read as plain memory: no tensor op, no copy, no sync (a meta pool reports nothing).
        self._words = [r.numpy() for r in reports if r.device.type != "meta"]
        self._seen = [0] * len(self._words)  # each word's count when last raised or forgotten

    def take(self) -> Refusal | None:
        """The refusals reported and not raised yet, if their stores have reached host memory:
        marked seen, and the device's pending words cleared (in stream order: launches, no wait).
        Two contexts' reports at once come back as one: both counted, their bits OR-ed, the
        first context's kind of call named."""
        if not self._words or (self._cuda and torch.cuda.is_current_stream_capturing()):
            return None
        found: Refusal | None = None
        for i, word in enumerate(int(w[0]) for w in self._words):
            refusals = word >> 32
            if refusals == self._seen[i]:
                continue
            calls = (refusals - self._seen[i]) & 0xFFFFFFFF
            self._seen[i] = refusals
            call = K.CALL_NAMES.get((word >> 8) & 0xFF, "call")
            if found is None:
                found = Refusal(status=word & 0xFF, call=call, calls=calls)
            else:
                found = Refusal(found.status | (word & 0xFF), found.call, found.calls + calls)
        if found is not None:
            for pending in self._pending:
                pending.zero_()
        return found

    def forget(self) -> None:
        """After a synchronising read of ``E_PENDING`` (``check``): every report so far is seen."""
        self._seen = [int(w[0]) >> 32 for w in self._words]
