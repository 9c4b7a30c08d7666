"""Transfer plans: what one selection needs moved, as data on the device.

A ``prepare`` or ``write`` is split the way FlashInfer splits plan from run. *Planning* (the lookup
and plan kernels) decides, on the device and without a host sync, every move the call needs and
writes it into the layout's call scratch: which elements miss (``miss_pos``), where each miss lives
now (``home``: the source row), which GPU slot receives it (``victims``: the destination row), which
free CPU row receives the entry it evicts (``popped``), and per-chunk offsets. *Running* the plan
(the apply kernel) carries those moves out in four phases (``Phase``): data, then mapping, twice,
and then the signal (a CUDA event per layer; on CPU every call completes before it returns).

After every phase each entry is readable at the home its mapping names, so a plan stopped between
phases loses nothing; the pool finishes it (runs the phases left) before its next call.
``interrupt_after`` stops a pool's plans on purpose, for tests of exactly that.

A plan holds the scratch until it is finished: one plan per pool is in flight at a time.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .errors import UlakvError
from .kernels import common as K


class Phase(enum.IntEnum):
    """The phases of running a plan, in order (see ``ulakv.kernels.apply``)."""

    OUT = int(K.PH_OUT)  # data: victims' rows to free CPU rows
    EVICT = int(K.PH_EVICT)  # mapping: victims live on the CPU; slots are output
    IN = int(K.PH_IN)  # data: misses' rows into their GPU slots (per layer)
    COMMIT = int(K.PH_COMMIT)  # mapping: misses live on the GPU; their CPU rows are freed


class PlanInterrupted(UlakvError):
    """A plan stopped after ``phase`` (by ``interrupt_after``). Every entry is readable at the
    home its mapping names; the pool finishes the plan before its next call."""

    def __init__(self, message: str, phase: Phase) -> None:
        super().__init__(message)
        self.phase = phase


@dataclass(eq=False)
class TransferPlan:
    """The moves of one ``prepare`` or ``write`` of group ``group``, planned on the device.

    The tensors are views of the layout's call scratch: valid until the plan is finished and the
    next call plans. ``applied`` is the last phase carried out (0: none) and ``layers_in`` the layers
    whose rows the ``in`` phase has moved. A layer's readiness on a GPU is a CUDA event the engine
    adapter records (``ulakv.engine.GroupStep.ready``), not the plan's.
    """

    group: int
    layers: range
    # The flattened selection (a write's addresses); a prepare's new tokens come before it as the
    # call's first ``n_new`` elements, in ``new_addresses``: the kernels read each in place.
    addresses: torch.Tensor
    scratch: object  # the layout's CallScratch
    slots: torch.Tensor | None  # int32 [T - n_new]: the output of a prepare
    # the rows of a write, or of a prepare's new tokens, packed, as words when the width allows
    rows: torch.Tensor | None
    write_layer: int
    ctl: torch.Tensor  # the pool's control words (the plan's totals live there)
    # The caller's output buffer when the kernels cannot store into it in place (strided, or
    # unaligned): ``slots`` are copied into it as soon as the evict phase has written them.
    out: torch.Tensor | None = None
    # A prepare with new rows (``NewRows``): its first ``n_new`` addresses are the new tokens,
    # ``rows`` theirs, and ``write_layer`` the layer they fill.
    n_new: int = 0
    new_addresses: torch.Tensor | None = None
    applied: int = 0
    layers_in: set[int] = field(default_factory=set)

    @property
    def elements(self) -> int:
        """The call's elements: the new tokens, then the selection."""
        return self.n_new + self.addresses.numel()

    def element_addresses(self) -> torch.Tensor:
        """int64 ``[elements]``: every element's address, the new tokens first (a new tensor: for
        describing the plan and naming bad addresses, off the hot path)."""
        if self.new_addresses is None:
            return self.addresses.long()
        return torch.cat([self.new_addresses.long(), self.addresses.long()])

    @property
    def finished(self) -> bool:
        return self.applied >= Phase.COMMIT

    def layers_to_move(self) -> range:
        """The group's layers whose rows the ``in`` phase has not moved yet (a suffix)."""
        start = max(self.layers_in) + 1 if self.layers_in else self.layers.start
        return range(start, self.layers.stop)

    def describe(self) -> dict[str, torch.Tensor]:
        """The plan's moves as host tensors, read from the plan itself (``ulakv.kernels.decide``):
        exactly what ``run`` will do (synchronises; for tests and debugging; before the plan
        commits). Per miss, in the plan's order: its position in ``addresses`` (a one-plan call's
        new tokens first), address, source home
        (mapping value), destination GPU slot (-1: none), the CPU row it pops for its victim or
        itself (``cpu_row``, -1: none), whether its victim goes back to its copy, a free row that
        still holds its bytes, with no bytes moved (``clean``), and the CPU row its victim's entry
        lives in afterwards (``victim_row``: the copy when clean, else ``cpu_row``; -1 for a miss
        into a free slot, one without a slot, or a buffer's dropped victim), and the free row a new
        entry (a write's, or a prepare's new token) takes its copy in (``copy_row``, -1: none). A
        refused call plans no move."""
        ctl = self.ctl.cpu()
        planned = int(ctl[int(K.E_LAST_STATUS)]) == 0
        moves = self.scratch.moves[:, : int(ctl[int(K.E_MISSES)]) if planned else 0].cpu().to(torch.int64)
        pos, slot, cpu_row, dest, _, flags, copy = moves
        return {
            "position": pos,
            "address": self.element_addresses().cpu()[pos],
            "source": self.scratch.home.cpu()[pos].to(torch.int64),
            "gpu_slot": slot,
            "cpu_row": cpu_row,
            "clean": (flags & int(K.MF_CLEAN)) != 0,
            "victim_row": torch.where(slot >= 0, dest, -1),
            "copy_row": torch.where(slot >= 0, copy, -1),
        }


@contextlib.contextmanager
def interrupt_after(pool, phase: Phase | str) -> Iterator[None]:
    """Make every plan ``pool`` runs inside the block stop after ``phase`` ("out", "evict", "in" or a
    ``Phase``) and raise ``PlanInterrupted``: a fault injected between a plan's data and its mapping
    update."""
    if isinstance(phase, str):
        names = {name.lower(): p for name, p in Phase.__members__.items()}
        if phase not in names:
            raise ValueError(f"phase must be one of {sorted(names)}, got {phase!r}")
        phase = names[phase]
    phase = Phase(phase)
    if phase >= Phase.COMMIT:
        raise ValueError("a plan interrupted after its commit is a finished plan")
    _INTERRUPTS[id(pool)] = phase
    try:
        yield
    finally:
        del _INTERRUPTS[id(pool)]


#: Pools inside an ``interrupt_after`` block (by ``id``: a block holds its pool alive) -> the phase.
_INTERRUPTS: dict[int, Phase] = {}


def interrupt_of(pool: object) -> Phase | None:
    """The phase after which ``pool``'s plans stop (``interrupt_after``), if any."""
    return _INTERRUPTS.get(id(pool))
