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

from .errors import CapacityError, InvalidAddressError

FREE = -1
UNHOMED = -2
PADDING = -1  # in selections and writes


def addresses_on(addresses: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of host-chosen addresses on ``device`` without stalling the host: to a GPU
    through pinned memory and an asynchronous copy (the pinned block is not reused before the copy
    is done: PyTorch's host allocator records the stream), so ``extend`` stays sync-free."""
    host = torch.tensor(addresses, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(eq=False)
class Sequence:
    """A request's handle: the logical addresses of its tokens, in position order."""

    pool_id: int
    seq_id: int
    _addresses: list[int] = field(default_factory=list, repr=False)
    _tensor: torch.Tensor | None = field(default=None, repr=False)
    _device: torch.device = field(default_factory=lambda: torch.device("cpu"), repr=False)
    released: bool = False

    @property
    def addresses(self) -> torch.Tensor:
        """int64 tensor ``[len(self)]`` of logical addresses on the pool's device."""
        if self._tensor is None:
            self._tensor = addresses_on(self._addresses, self._device)
        return self._tensor

    def __len__(self) -> int:
        return len(self._addresses)


class LogicalAllocator:
    """Hands out logical addresses in ``[0, capacity)``; admission fails whole or not at all.

    Addresses are reused lowest-first after release, so a fresh pool and a pool whose requests all
    left hand out the same addresses.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # A stack whose top is the lowest free address.
        self._free: list[int] = list(range(capacity - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidAddressError(f"number of tokens must be a non-negative int, got {n!r}")
        if n > len(self._free):
            raise CapacityError(
                f"cannot admit {n} tokens: {len(self._free)} of {self.capacity} logical addresses free"
            )
        taken = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        return taken

    def give_back(self, addresses: list[int]) -> None:
        self._free.extend(addresses)
        self._free.sort(reverse=True)
