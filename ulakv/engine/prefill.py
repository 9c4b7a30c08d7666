"""Chunked prefill: a long prompt's top-k selections, prepared a chunk of query rows at a time.

A ``prepare`` may select at most ``layout.max_selection`` distinct addresses of a group. A decode
step stays far below that, but a prefill of ``T`` query tokens, each selecting its own top-k past
positions, can together select far more. :func:`chunked_prepare` cuts the rows ``[T, K]`` into
consecutive chunks whose distinct addresses fit, and prepares them one at a time: the caller attends
with a chunk's slots before asking for the next, and the pool evicts between chunks as it would
between decode steps.

Prefill is not captured in a CUDA graph, so this path may synchronise: it copies the selection to
the host once, plans every chunk boundary there up front, and checks the whole selection before
anything moves (addresses in range and live, no single row over the bound), so a refused prefill
changes nothing. Chunks go to the pool's own ``plan`` and ``run`` (after ``SparseKV.join``), not to
``SparseKV.prepare``: a chunk may hold more rows than the adapter's ``max_batch`` (its buffers are
sized for a decode step, and captured graphs point at them); the pool gives a call larger than the
reserved scratch scratch of its own, and this module's slots buffer (sized for the largest chunk,
allocated once per call) receives the slots. Each chunk's moves run whole on the current stream (no
prefetch split), so every layer's rows are ready as soon as the chunk is yielded.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import CapacityError, InvalidAddressError, InvalidInputError
from ..frame import same_device
from ..layouts.tiered import TieredPool
from .adapter import GroupStep, SparseKV


@dataclass(frozen=True)
class PrefillChunk:
    """One chunk of a prefill: its query rows (a range of the selection's rows) and its step, whose
    slots ``[len(rows), K]`` (int32, -1 for padding) index ``pool.gpu_buffer(layer)`` for every
    layer of the group. Valid until the next chunk is asked for (the slots buffer is reused) or
    until anything else prepares or writes the group."""

    rows: range
    step: GroupStep

    @property
    def slots(self) -> torch.Tensor:
        return self.step.slots


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(f"chunked_prepare: {name} must be a positive int, got {value!r}")
    return value


def _plan(selection: np.ndarray, max_distinct: int, max_rows: int | None) -> tuple[list[range], np.ndarray]:
    """:func:`plan_chunks` on a validated host array; also returns the distinct addresses seen."""
    T, K = selection.shape
    if T == 0:
        return [], np.empty(0, dtype=np.int64)
    # The greedy, in one pass over the rows. A chunk starting at row ``s`` selects, at row ``r``,
    # the addresses of row ``r`` that no row of ``[s, r)`` selected, i.e. those whose latest earlier
    # occurrence (``last``, -1 for none) is before ``s``. ``last`` is kept per address as the rows go
    # by, so each row costs O(K) gathers and scatters and the whole plan O(T * K) time and O(address
    # space + K) memory: no sort, no row examined twice. When a row would take the chunk over the
    # bound (or ``max_rows`` is reached) the next chunk starts at that row, which then counts every
    # distinct address it has. Duplicates within a row count once: ``stamp`` records, per address,
    # one of its positions in the row (whichever write lands), and only that position counts.
    # Padding (-1) indexes the tables' spare last entry and is masked out. The tables span the
    # addresses up to the largest one selected; where that is far more than the selection's size,
    # the addresses are first renumbered densely (one sort), so memory stays O(T * K) too.
    names = None
    if selection.size and int(selection.max()) + 2 > 4 * selection.size:
        names, dense = np.unique(selection, return_inverse=True)
        selection = dense.reshape(T, K) - int(names[0] == -1)  # -1 stays -1 (the smallest value)
        names = names[names != -1]
    size = int(selection.max(initial=-1)) + 2
    last = np.full(size, -1, dtype=np.int32)
    stamp = np.zeros(size, dtype=np.int32)
    here = np.arange(K, dtype=np.int32)
    chunks: list[range] = []
    start, taken = 0, 0
    for r in range(T):
        row = selection[r]
        earlier = last[row]
        stamp[row] = here
        counts = (stamp[row] == here) & (row != -1)
        distinct = int(np.count_nonzero(counts))
        if distinct > max_distinct:
            raise CapacityError(
                f"chunked_prepare: row {r} selects {distinct} distinct addresses, more than the "
                f"{max_distinct} one prepare may select; nothing changed"
            )
        new = int(np.count_nonzero(counts & (earlier < start)))
        if r > start and (taken + new > max_distinct or r - start == max_rows):
            chunks.append(range(start, r))
            start, taken = r, distinct
        else:
            taken += new
        last[row] = r
    chunks.append(range(start, T))
    seen = np.flatnonzero(last[:-1] >= 0)
    return chunks, seen if names is None else names[seen]


def plan_chunks(
    topk: torch.Tensor | np.ndarray, max_distinct: int, *, max_rows: int | None = None
) -> list[range]:
    """The rows of ``topk`` (``[T, K]``, -1 padding) cut greedily, in order, into consecutive
    chunks of at most ``max_distinct`` distinct addresses (and at most ``max_rows`` rows): each chunk
    takes rows until the next would take it over. Rows of padding only never end a chunk. Raises
    ``CapacityError`` naming the first row that alone selects more than ``max_distinct``. Host-side
    (a device tensor is copied once); O(T * K)."""
    _positive("max_distinct", max_distinct)
    if max_rows is not None:
        _positive("max_rows", max_rows)
    selection = np.asarray(topk.cpu() if isinstance(topk, torch.Tensor) else topk)
    if selection.ndim != 2 or selection.dtype.kind not in "iu":
        raise InvalidInputError(
            f"plan_chunks: topk must be an integer [T, K] array, got {selection.dtype} {selection.shape}"
        )
    selection = selection.astype(np.int64, copy=False)
    if (selection < -1).any():
        offenders = selection[selection < -1][:5].tolist()
        raise InvalidAddressError(f"plan_chunks: negative addresses other than -1 (padding): {offenders}")
    return _plan(selection, max_distinct, max_rows)[0]


def chunked_prepare(
    kv: SparseKV | TieredPool,
    group: int,
    topk: torch.Tensor,
    *,
    max_distinct: int | None = None,
    max_rows: int | None = None,
) -> Iterator[PrefillChunk]:
    """Prepare ``group``'s prefill selection ``topk`` (``[T, K]``, int32 or int64, -1 padding, on
    the pool's device) a chunk of query rows at a time; an iterator of :class:`PrefillChunk`, in
    row order, covering every row once.

    Chunks are cut by :func:`plan_chunks` with ``max_distinct`` (default and upper limit: the
    layout's ``max_selection``) and ``max_rows`` (default: no limit; a chunk of ``n`` rows needs call
    scratch for ``n * K`` elements). Each chunk is prepared when it is asked for, so attend with one
    chunk's slots before taking the next. Everything is checked here, at the call, before anything
    moves: ``InvalidInputError`` (types, shape, device, group, bounds), ``InvalidAddressError``
    (addresses out of range or not live) and ``CapacityError`` (a row that alone selects more than
    ``max_distinct``) leave the pool as it was. Synchronises at the call (the copy of ``topk`` to the
    host, the liveness check); the chunks themselves launch only."""
    adapter = kv if isinstance(kv, SparseKV) else None
    pool = kv.pool if adapter is not None else kv
    if not isinstance(pool, TieredPool):
        raise InvalidInputError(
            f"chunked_prepare: needs a SparseKV or a tiered pool, got {type(kv).__name__}"
        )
    layers = pool.group_layers(group)  # checks the group
    if not isinstance(topk, torch.Tensor) or topk.dtype not in (torch.int32, torch.int64) or topk.dim() != 2:
        got = f"{topk.dtype} {tuple(topk.shape)}" if isinstance(topk, torch.Tensor) else type(topk).__name__
        raise InvalidInputError(f"chunked_prepare: topk must be an int32 or int64 [T, K] tensor, got {got}")
    if not same_device(topk, pool.device):
        raise InvalidInputError(f"chunked_prepare: topk is on {topk.device}, the pool on {pool.device}")
    bound = pool.config.layout.max_selection
    if max_distinct is None:
        max_distinct = bound
    elif _positive("max_distinct", max_distinct) > bound:
        raise InvalidInputError(
            f"chunked_prepare: max_distinct {max_distinct} exceeds the {bound} one prepare may select"
        )
    if max_rows is not None:
        _positive("max_rows", max_rows)

    selection = topk.cpu().numpy().astype(np.int64, copy=False)
    # Addresses are [0, capacity), or [0, PoolConfig.engine_addresses) where the engine owns them.
    space = getattr(pool, "address_space", pool.capacity)
    bad = (selection != -1) & ((selection < 0) | (selection >= space))
    if bad.any():
        raise InvalidAddressError(
            f"chunked_prepare: addresses out of range [0, {space}): {selection[bad][:5].tolist()}; "
            "nothing changed"
        )
    chunks, seen = _plan(selection, max_distinct, max_rows)
    if seen.size:
        try:
            pool.residency(group, torch.from_numpy(seen))  # raises for an address not live
        except InvalidAddressError as exc:
            raise InvalidAddressError(
                f"chunked_prepare: addresses not live (released or never admitted); nothing changed ({exc})"
            ) from exc
    return _prepare_chunks(adapter, pool, group, layers, topk, chunks)


def _prepare_chunks(
    adapter: SparseKV | None,
    pool: TieredPool,
    group: int,
    layers: range,
    topk: torch.Tensor,
    chunks: list[range],
) -> Iterator[PrefillChunk]:
    K = topk.shape[1]
    most = max((len(rows) for rows in chunks), default=0)
    out = torch.full((most * K,), -1, dtype=torch.int32, device=pool.device)
    for rows in chunks:
        if adapter is not None:  # the side stream's moves may still read the call scratch
            adapter.join()
        plan = pool.plan(group, topk[rows.start : rows.stop], out=out)
        if plan is not None:  # None: K == 0, nothing to move
            pool.run(plan)
        slots = out[: len(rows) * K].view(len(rows), K)
        yield PrefillChunk(rows, GroupStep(group, layers, slots, plan))
