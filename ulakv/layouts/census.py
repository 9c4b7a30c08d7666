"""What a selection asks of each home, decided on the device: the refusal of a striped call.

Every rank of a striped pool must refuse the same calls (a rank that raised while the others went
on would leave them waiting in the next collective), and a non-validating pool may not read
anything back to decide. So each rank takes a census of the whole selection in one launch
(``ulakv.kernels.census``): which addresses are bad, how many distinct ones each rank homes, and
how many of those miss the buffer. All ranks hold the same liveness map and buffer decisions, so
all reach the same status word. It goes to the plans of the rank's slice and buffer before they
run (their kernels refuse a call whose status is nonzero, changing nothing) and to the pool's
pending word. The census also hands the slice its local addresses (``address // world`` where
homed on this rank, else -1).

Cost: one launch of a program a ``CHUNK`` of elements, no sort, no temporary of the selection's
size. What it keeps: an int32 stamp a global address (with the pool, like its liveness map; 4 B
beside ``_live``'s 1), a few words, and the local addresses, ``[T]`` int32 grown to a power of two
and never shrunk (a captured step points at them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import census as census_mod
from ..kernels import common as K


@dataclass(frozen=True)
class Census:
    """One call's census, on the device. ``status`` is an int64 ``[1]`` tensor of ``ST_*`` bits;
    ``distinct[r]`` counts the distinct addresses homed on rank ``r``, ``missing[r]`` those of them
    a buffer does not hold (zeros without a buffer): int64 ``[world]``. ``local`` (int32 ``[T]``):
    each element's local address on this rank, -1 for one homed elsewhere, padding or out of
    range. Views of the pool's census state: valid until its next census."""

    status: torch.Tensor
    distinct: torch.Tensor
    missing: torch.Tensor
    local: torch.Tensor


class CensusState:
    """What a striped rank's census keeps: the stamp table (int32 ``[addresses]``) and words
    (``ulakv.kernels.census``), carried from call to call; the result (int64 ``[1 + 2 x world]``)
    and the local addresses it writes. ``kernel`` is ``census`` or its twin (tests swap it)."""

    def __init__(self, world: int, rank: int, addresses: int, device: torch.device) -> None:
        self.world, self.rank = world, rank
        self.stamp = torch.zeros(addresses, dtype=torch.int32, device=device)
        self.words = torch.zeros(census_mod.words_size(world), dtype=torch.int64, device=device)
        self.words[int(census_mod.W_EPOCH)] = 1
        self.result = torch.zeros(1 + 2 * world, dtype=torch.int64, device=device)
        self.local = torch.empty(K.CHUNK, dtype=torch.int32, device=device)
        self.kernel = census_mod.census

    def local_for(self, elements: int) -> torch.Tensor:
        """The local-address scratch for ``elements``, grown to a power of two (never shrunk)."""
        if self.local.numel() < elements:
            self.local = torch.empty(K.next_pow2(elements), dtype=torch.int32, device=self.local.device)
        return self.local[:elements]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"stamp": self.stamp, "words": self.words, "result": self.result, "local": self.local}

    def take(
        self,
        flat: torch.Tensor,
        *,
        live: torch.Tensor,
        per_home: int | None = None,
        most: int | None = None,
        unique: bool = False,
        buffer_map: torch.Tensor | None = None,
        buffer_slots: int = 0,
        fetch_width: int = 0,
    ) -> Census:
        """The census of ``flat`` (int32 or int64 ``[T]``, packed, -1 padding) over global
        addresses ``[0, live.numel())`` (``live``: bool, which are admitted). Refused (``ST_*``):

        - ``ST_BAD_ADDRESS``: an element other than -1 out of range or not live;
        - ``ST_DUPLICATE`` (``unique``, a write): an address twice;
        - ``ST_TOO_LARGE`` (``most``): more distinct addresses than ``most``;
        - ``ST_HOME_LIMIT`` (``per_home``, a prepare): more than ``per_home`` distinct addresses
          homed on one rank, or (with ``buffer_map``, a group's row of the buffer's mapping over
          ``buffer_slots`` GPU slots) more than ``fetch_width`` of them missing the buffer.

        One launch, no host sync."""
        local = self.local_for(flat.numel())
        self.kernel(
            flat,
            world=self.world,
            rank=self.rank,
            live=live,
            stamp=self.stamp,
            words=self.words,
            result=self.result,
            local=local,
            per_home=-1 if per_home is None else per_home,
            most=-1 if most is None else most,
            unique=unique,
            buffer_map=buffer_map,
            buffer_slots=buffer_slots,
            fetch_width=fetch_width,
        )
        w = self.world
        return Census(self.result[:1], self.result[1 : 1 + w], self.result[1 + w :], local)


def hand_to(ctl: torch.Tensor, census: Census) -> None:
    """Make the next plan over ``ctl`` (a state's control words) refuse when ``census`` does: its
    kernels OR their own findings into ``E_STATUS`` and refuse a call whose status is nonzero."""
    at = int(K.E_STATUS)
    ctl[at : at + 1].bitwise_or_(census.status)
