"""Decode context parallelism over an exclusive CPU tier: the page table SGLang's DCP attention reads,
made by a rank's local-mode pool.

SGLang's DCP keeps token slot ``s`` on rank ``s % dcp`` at row ``s // dcp`` of that rank's KV pool.
Before attention, it *localises* the page table (the global slots a step's top-k selects, ``[rows,
topk]`` int32, ``-1`` padding) with ``transform_index_page_table_dcp``: for every row, ``s // dcp`` of
the slots homed on this rank, packed to the front in the row's order, ``-1`` after, and the count
(``sparse_mla_top_k_lens``). Each rank attends over its part; SGLang merges the parts by their LSE.

Here the same rule places the entries (``Striped(attention="local")`` with the engine's slots as
addresses: ``PoolConfig.engine_addresses``), but a rank's rows live in its own pool, GPU and CPU, one
home each. A localisation is the pool's ``prepare`` of the page table (the entries homed here brought
to the GPU, victims to this rank's CPU tier; the others ``-1``; no collective) and ``compact_slots``:
the rank's GPU slots of its entries, packed in the row's order, and the counts, in the shapes and
dtypes SGLang passes to its attention (``block_tables``: rows of ``gpu_buffer(layer)``, or of
``paged_buffer(layer)`` viewed as FlashMLA's pages). What attention reads through them is, row for
row and in the same order, what it reads from SGLang's dense sharded pool
(``tests/test_sglang_dcp.py``, with SGLang's own kernel as the oracle).

Layers that share a top-k share a layer group (``PoolConfig.group_starts``): their selection is
prepared once, for the group's first layer, and the later layers read the same tables, as SGLang's
``DcpPageTableCache`` reuses one localisation across layers that reuse the previous layer's top-k.
With a ``SparseKV`` over the pool the group's moves run on its side stream, the first layer's rows
first: the first layer's attention waits for those only, each later layer for the rest (on CPU
the same calls run in order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...engine.adapter import GroupStep, SparseKV
from ...errors import InvalidInputError
from ...frame import PoolFrame
from ...kernels.compact import compact_slots
from .store import loc_addresses


@dataclass
class LocalPageTable:
    """One localisation: ``block_table`` int32 ``[rows, topk]`` (this rank's GPU slots, packed, then
    -1) and ``counts`` int32 ``[rows]``; for ``layer`` (of ``group``), from ``source`` (the top-k
    tensor, or the page table) of the step ``step`` (what the next layer compares to reuse it);
    ``moves``: the group's moves on a side stream, which each layer waits for (None: done)."""

    layer: int
    group: int
    block_table: torch.Tensor
    counts: torch.Tensor
    source: torch.Tensor
    step: object
    moves: GroupStep | None = None


class DcpLocalizer:
    """A rank's localisations of SGLang page tables through its local-mode pool.

    ``pool`` is this rank's ``Pool`` over ``Striped(attention="local")`` with engine-owned
    addresses (SGLang's token slots). ``localize(layer, page_table, step=...)`` returns the block
    table and counts for ``layer``. As SGLang's ``localize_dcp_page_table`` reuses a localisation,
    a call reuses the previous one only for the next layer (``layer == previous + 1``), of the same
    group, with the same ``topk_indices`` tensor (else the same page table tensor) and the same
    ``step`` object (SGLang's forward metadata, not None); any other call prepares, so a page table
    refilled in place for the next step is prepared again from the group's first layer.
    ``zero_is_padding``: 0 in a page table is padding (SGLang's padding slot, which a captured
    batch's padding requests select), read as -1. Pass ``out``/``counts`` buffers from a
    CUDA-graph-captured step (a reused localisation is copied into them). ``kv``: a ``SparseKV``
    over ``pool`` whose bounds take a page table (rows as its ``max_batch``, ``top_k``): its
    prepares run on the side stream; a larger table (a prefill chunk) is prepared on the current
    stream after it."""

    def __init__(self, pool: PoolFrame, *, zero_is_padding: bool = False, kv: SparseKV | None = None) -> None:
        layout = pool.config.layout
        if not getattr(layout, "local", False) or pool.config.engine_addresses is None:
            raise InvalidInputError(
                'DcpLocalizer needs a Striped(attention="local") pool over engine-owned addresses '
                "(PoolConfig.engine_addresses: the engine's token slots)"
            )
        if kv is not None and kv.pool is not pool:
            raise InvalidInputError("DcpLocalizer: kv must be a SparseKV over the same pool")
        self.pool = pool
        self.kv = kv
        self.zero_is_padding = zero_is_padding  # SGLang's loc 0: its padding slot, never a token's
        self.dcp_size, self.dcp_rank = layout.world, layout.rank
        self.last: LocalPageTable | None = None
        self.prepares = 0

    def localize(
        self,
        layer: int,
        page_table: torch.Tensor,
        *,
        step: object = None,
        topk_indices: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        counts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``page_table`` int32 ``[rows, topk]``: global token slots, -1 padding (the same on every
        rank). Returns ``(block_table, counts)`` as SGLang's ``localize_dcp_page_table`` does, with
        this rank's GPU slots in place of its dense rows. ``topk_indices``: the selection the page
        table was made from, SGLang's reuse key (it builds a fresh page table every layer, from
        the same top-k tensor in the layers that reuse one); without it the page table is the key."""
        group = self.pool.config.group_of(layer)
        last = self.last
        source = page_table if topk_indices is None else topk_indices
        if (
            last is not None
            and step is not None
            and last.step is step
            and last.layer == layer - 1
            and last.group == group
            and last.source is source
        ):
            last.layer = layer
            if last.moves is not None:
                last.moves.wait(layer)
            if out is not None and out is not last.block_table:
                out.copy_(last.block_table)
            if counts is not None and counts is not last.counts:
                counts.copy_(last.counts)
            return (last.block_table if out is None else out), (last.counts if counts is None else counts)
        if page_table.dim() != 2 or page_table.dtype != torch.int32:
            raise InvalidInputError(
                f"localize: page_table must be int32 [rows, topk], got {page_table.dtype} "
                f"{tuple(page_table.shape)}"
            )
        addresses = loc_addresses(page_table) if self.zero_is_padding else page_table
        kv, moves = self.kv, None
        rows, width = page_table.shape
        if kv is not None and rows <= kv.max_batch and width <= kv.top_k:
            moves = kv.prepare(group, addresses)
            slots = moves.wait(layer)
        else:
            if kv is not None:
                kv.join()  # the pool's calls in order: after the side stream's
            slots = self.pool.prepare(group, addresses).slots
        block_table, found = compact_slots(slots, out=out, counts=counts)
        self.prepares += 1
        self.last = LocalPageTable(layer, group, block_table, found, source, step, moves)
        return block_table, found


def sglang_dcp_reference(page_table: torch.Tensor, dcp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's ``transform_index_page_table_dcp`` in plain torch (what ``localize`` replaces): each
    row's slots homed on ``rank`` (``s % dcp``) as their rows ``s // dcp``, packed to the front in
    the row's order, -1 after; and the counts, int32. Held to SGLang's kernel by
    ``tests/test_sglang_dcp.py``; the GPU suite's oracle, where SGLang's wheel is absent."""
    owned = (page_table >= 0) & (page_table % dcp == rank)
    order = torch.argsort((~owned).to(torch.int8), dim=1, stable=True)
    packed = torch.gather(torch.div(page_table, dcp, rounding_mode="floor"), 1, order)
    counts = owned.sum(dim=1, dtype=torch.int32)
    keep = torch.arange(page_table.shape[1], device=page_table.device) < counts[:, None]
    return torch.where(keep, packed, -1).to(torch.int32), counts
