"""What a selection asks of each home, decided on the device: the refusal of a striped call.

Every rank of a striped pool must refuse the same calls (a rank that raised while the others went
on would leave them waiting in the next collective), and a non-validating pool may not read
anything back to decide. So each rank takes a census of the whole selection with a few fixed-shape
tensor operations: which addresses are bad, how many distinct ones each rank homes, and how many
of those miss the buffer. All ranks hold the same liveness map and buffer decisions, so all reach
the same status word. It goes to the plans of the rank's slice and buffer before they run (their
kernels refuse a call whose status is nonzero, changing nothing) and to the pool's pending word.

Cost: one sort of the selection's elements (a radix sort of ``B x q x k`` int64 keys) and a few
passes over it; nothing grows with the pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kernels import common as K


@dataclass(frozen=True)
class Census:
    """One call's census. ``status`` is an int64 ``[1]`` tensor of ``ST_*`` bits; ``distinct[r]``
    counts the distinct addresses homed on rank ``r``, ``missing[r]`` those of them a buffer does
    not hold (zeros without a buffer). All stay on the device."""

    status: torch.Tensor
    distinct: torch.Tensor
    missing: torch.Tensor


def take_census(
    flat: torch.Tensor,
    *,
    world: int,
    live: torch.Tensor,
    per_home: int | None = None,
    most: int | None = None,
    unique: bool = False,
    buffered: Callable[[torch.Tensor], torch.Tensor] | None = None,
    fetch_width: int = 0,
) -> Census:
    """The census of ``flat`` (int64, -1 padding) over global addresses ``[0, live.numel())``
    (``live``: bool, which are admitted). Refused (``ST_*``):

    - ``ST_BAD_ADDRESS``: an element other than -1 out of range or not live;
    - ``ST_DUPLICATE`` (``unique``, a write): an address twice;
    - ``ST_TOO_LARGE`` (``most``): more distinct addresses than ``most``;
    - ``ST_HOME_LIMIT`` (``per_home``, a prepare): more than ``per_home`` distinct addresses homed
      on one rank, or (with
      ``buffered``, which says of addresses whether the buffer holds them) more than
      ``fetch_width`` of them missing the buffer.
    """
    capacity = live.numel()
    in_range = (flat >= 0) & (flat < capacity)
    safe = torch.where(in_range, flat, 0)
    bad = (flat != -1) & ~(in_range & live[safe])
    # Padding and bad elements sort last, as one key past every address.
    keys = torch.where(in_range, flat, capacity).sort().values
    repeat = torch.zeros_like(keys, dtype=torch.bool)
    repeat[1:] = keys[1:] == keys[:-1]
    first = ~repeat & (keys < capacity)
    home = torch.where(first, keys % world, 0)
    distinct = torch.zeros(world, dtype=torch.int64, device=flat.device).scatter_add_(0, home, first.long())
    over = distinct > (per_home if per_home is not None else flat.numel())
    missing = torch.zeros_like(distinct)
    if buffered is not None:
        absent = first & ~buffered(torch.where(first, keys, 0))
        missing = missing.scatter_add_(0, home, absent.long())
        over = over | (missing > fetch_width)

    def bit(cond: torch.Tensor, value: int) -> torch.Tensor:
        return torch.where(cond, value, 0)

    status = bit(bad.any(), int(K.ST_BAD_ADDRESS)) | bit(over.any(), int(K.ST_HOME_LIMIT))
    if unique:
        status = status | bit((repeat & (keys < capacity)).any(), int(K.ST_DUPLICATE))
    if most is not None:
        status = status | bit(distinct.sum() > most, int(K.ST_TOO_LARGE))
    return Census(status.view(1).to(torch.int64), distinct, missing)


def hand_to(ctl: torch.Tensor, census: Census) -> None:
    """Make the next plan over ``ctl`` (a state's control words) refuse when ``census`` does: its
    kernels OR their own findings into ``E_STATUS`` and refuse a call whose status is nonzero."""
    at = int(K.E_STATUS)
    ctl[at : at + 1].bitwise_or_(census.status)
