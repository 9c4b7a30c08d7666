"""Logical addresses: the host-side allocator, the request handle, and the mapping-table encoding.

A logical address names one token position of one request and never changes while the request lives.
The allocator is plain host bookkeeping (admission is a scheduling decision, never on the GPU's
critical path). Where an address lives is device state: one int32 mapping table per layer group.

Mapping values (int32; ``gpu_slots + cpu_slots`` < 2**31 is checked by the config):

=====================  ===============================================
value                  meaning
=====================  ===============================================
``FREE`` (-1)          not a live address (never admitted, or released)
``UNHOMED`` (-2)       live, no data yet: gets a home when first written or selected
``0 <= v < G``         home is GPU slot ``v``
``G <= v < G + C``     home is CPU slot ``v - G``
=====================  ===============================================
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import CapacityError, InvalidAddressError, InvalidInputError
from .kernels import common as K

FREE = -1
UNHOMED = -2
PADDING = -1  # in selections and writes


def runs_of(addresses) -> list[range]:
    """Addresses as ascending, merged runs: from ranges, ints, or a mix (order is not kept)."""
    pieces = sorted(
        ((a.start, a.stop) if isinstance(a, range) else (a, a + 1) for a in addresses if a != range(0)),
    )
    runs: list[range] = []
    for lo, hi in pieces:
        if runs and lo <= runs[-1].stop:
            if hi > runs[-1].stop:
                runs[-1] = range(runs[-1].start, hi)
        else:
            runs.append(range(lo, hi))
    return runs


def count(runs: list[range]) -> int:
    return sum(len(r) for r in runs)


def addresses_on(runs: list[range], device: torch.device) -> torch.Tensor:
    """An int64 tensor of host-chosen addresses (given as runs) on ``device`` without stalling the
    host: to a GPU through pinned memory and an asynchronous copy (the pinned block is not reused
    before the copy is done: PyTorch's host allocator records the stream), so ``extend`` stays
    sync-free. On the meta device (capacity planning) only the shape exists."""
    if device.type == "meta":
        return torch.empty(count(runs), dtype=torch.int64, device=device)
    if runs:
        host = torch.cat([torch.arange(r.start, r.stop, dtype=torch.int64) for r in runs])
    else:
        host = torch.empty(0, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(eq=False)
class Sequence:
    """A request's handle: the logical addresses of its tokens, in position order.

    The addresses are kept as runs (a 128K-token request admitted into a fresh pool is one
    ``range``), so the capacity model can admit hundreds of long requests in no time."""

    pool_id: int
    seq_id: int
    _runs: list[range] = field(default_factory=list, repr=False)
    _tensor: torch.Tensor | None = field(default=None, repr=False)
    _device: torch.device = field(default_factory=lambda: torch.device("cpu"), repr=False)
    released: bool = False

    @property
    def addresses(self) -> torch.Tensor:
        """int64 tensor ``[len(self)]`` of logical addresses on the pool's device."""
        if self._tensor is None:
            self._tensor = addresses_on(self._runs, self._device)
        return self._tensor

    @property
    def address_list(self) -> list[int]:
        """The addresses as a host list (tests and small tools)."""
        return [a for r in self._runs for a in r]

    @property
    def runs(self) -> tuple[range, ...]:
        """The addresses as ascending runs, in position order (what the pool frees)."""
        return tuple(self._runs)

    def __len__(self) -> int:
        return count(self._runs)


def grow(seq: Sequence, runs: list[range]) -> None:
    """Append ``runs`` (addresses the pool has just given ``seq``) to ``seq``, merging a run that
    continues the last; the pools' side of ``admit`` and ``extend``."""
    for r in runs:
        if seq._runs and seq._runs[-1].stop == r.start:
            seq._runs[-1] = range(seq._runs[-1].start, r.stop)
        else:
            seq._runs.append(r)
    seq._tensor = None


class LogicalAllocator:
    """Hands out logical addresses in ``[0, capacity)``; admission fails whole or not at all.

    Addresses are reused lowest-first after release, so a fresh pool and a pool whose requests all
    left hand out the same addresses. Free addresses are kept as sorted runs: taking or giving
    back costs the number of runs, not of tokens.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._runs: list[range] = [range(capacity)] if capacity else []
        self._free = capacity

    @property
    def free(self) -> int:
        return self._free

    def free_runs(self) -> list[range]:
        return list(self._runs)

    def take(self, n: int) -> list[range]:
        """The ``n`` lowest free addresses, as ascending runs."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            # a count, not an address: the caller's input is wrong, not an address it named
            raise InvalidInputError(f"number of tokens must be a non-negative int, got {n!r}")
        if n > self._free:
            raise CapacityError(
                f"cannot admit {n} tokens: {self._free} of {self.capacity} logical addresses free"
            )
        taken: list[range] = []
        need = n
        while need:
            run = self._runs[0]
            if len(run) <= need:
                taken.append(run)
                need -= len(run)
                del self._runs[0]
            else:
                taken.append(range(run.start, run.start + need))
                self._runs[0] = range(run.start + need, run.stop)
                need = 0
        self._free -= n
        return taken

    def give_back(self, runs) -> None:
        """Return addresses (runs or ints) taken earlier; refuses, changing nothing, addresses
        out of range, given twice, or already free."""
        runs = list(runs)
        back = runs_of(runs)
        given = sum(len(r) if isinstance(r, range) else 1 for r in runs)
        merged = runs_of(self._runs + back)
        if (
            (back and (back[0].start < 0 or back[-1].stop > self.capacity))
            or given != count(back)  # an address twice in what is given back
            or count(merged) != self._free + count(back)  # one that is free already
        ):
            raise InvalidAddressError("give_back: addresses out of range, repeated, or already free")
        self._runs = merged
        self._free += count(back)


class EngineAddresses:
    """The books of a pool whose addresses the engine owns (``PoolConfig.engine_addresses``).

    Which addresses are live is device state only (the mapping: ``FREE`` or not), changed by the
    engine's ``admit_addresses``/``release_addresses`` without the host reading anything back; a
    device counter holds how many are live, so admission is refused beyond ``capacity``. Reading the
    count (``free``, ``free_runs``) synchronises: stats and invariant checks only.

    The check's status and refusal count are control words of its own (``ctl``, the layout of a
    call context's) and it reports a refusal to a word of its own (``report``): a call context's
    words are read-modify-written by prepares planning on the adapter's streams, so an engine call
    shares none of them.
    """

    def __init__(self, capacity: int, mapping: torch.Tensor, report: torch.Tensor) -> None:
        self.capacity = capacity
        self._mapping = mapping
        self.live = torch.zeros(1, dtype=torch.int64, device=mapping.device)
        self.ctl = torch.zeros(int(K.CTL_WORDS), dtype=torch.int64, device=mapping.device)
        self.report = report

    @property
    def free(self) -> int:
        return self.capacity - int(self.live[0])

    def free_runs(self) -> list[range]:
        """Addresses not live in group 0, as runs (the invariant check compares every group and the
        live count against them)."""
        if self._mapping.device.type == "meta":
            return []
        free = (self._mapping[0] == FREE).cpu()
        edges = torch.diff(
            free.to(torch.int8),
            prepend=torch.zeros(1, dtype=torch.int8),
            append=torch.zeros(1, dtype=torch.int8),
        )
        starts = torch.nonzero(edges == 1).flatten().tolist()
        stops = torch.nonzero(edges == -1).flatten().tolist()
        return [range(a, b) for a, b in zip(starts, stops, strict=True)]
