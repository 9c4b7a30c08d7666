"""Compact slots: each row's valid slots first, in order, then -1; and how many are valid.

``prepare`` returns slots shaped like the selection, ``[B, K]`` or ``[B, Q, K]``, with -1 wherever a
row has padding (FlashMLA's convention). FlashInfer-style sparse MLA wants each row's valid entries
(>= 0) first, in their original order (a stable partition), then -1 up to the row's end, and an int32
count of valid entries per row. ``compact_slots`` turns the first into the second in one launch,
with no host sync and no data-dependent shape, so it can sit inside a CUDA-graph-captured step.

One program takes ``ROWS`` rows and walks them in blocks of ``BLOCK`` slots (at most 1024): a running
count carried from block to block places each valid slot at ``count + its rank in the block``
(``tl.cumsum``), so a program's work is ``ROWS x K`` whatever the batch; a second walk writes -1 past
each row's count. Every slot moves to its own column or further left, after its block was read,
so ``out`` may be ``slots`` itself (in place).

Any strides: a row is ``K`` slots ``sk`` apart, rows are indexed by up to three leading dimensions
with a stride each, for ``slots``, ``out`` and ``counts`` alike (leading dimensions that step as one
are merged first: a packed ``[B, Q, K]`` is ``B x Q`` rows of stride ``K``). A column slice of a
wider tensor or a transposed view is read where it lies, never copied. Only a view whose leading
dimensions still need more than three strides after merging goes through packed copies.
"""

from __future__ import annotations

import torch

from ..errors import InvalidInputError
from ._triton import INTERPRETED, tl, triton
from .common import cdiv, next_pow2
from .operands import detached, may_overlap

# Slots a program holds at once. On a GPU 1,024 int32 (4 KiB): 80 registers a thread and 24
# resident warps an SM on sm_90, no spill (4,096 took 255 registers and spilled 344 B). A block is the
# row's width rounded up to a power of two, 16 to 1024 (K = 2048: 2 blocks a row, 1 row a program;
# K = 7: one block of 16, 64 rows a program). The interpreter pays per operation and takes 4x more.
TILE = 4096 if INTERPRETED else 1024
MIN_BLOCK, MAX_BLOCK = 16, 1024
LEAD_DIMS = 3  # leading dimensions the kernel indexes (after merging): [B, Q, K] needs at most two


# Not specialised: n (rows: batch x queries, varies each call), the leading sizes D1, D2 and every
# leading stride (they follow the batch when leading dimensions do not merge; they feed no
# vectorisable access), and src_ptr's alignment (a caller's view: a column slice starts anywhere).
# Specialised: K (top-k, fixed per model), sk and ok (1 for packed rows: contiguous, vectorisable
# slots), dst_ptr and cnt_ptr (fresh tensors or a captured step's fixed buffers), constexprs.
@triton.jit(
    do_not_specialize=["n", "D1", "D2", "s0", "s1", "s2", "o0", "o1", "o2", "c0", "c1", "c2"],
    do_not_specialize_on_alignment=["src_ptr"],
)
def compact_kernel(
    src_ptr,
    dst_ptr,
    cnt_ptr,
    n,
    D1,
    D2,
    K,
    s0,
    s1,
    s2,
    sk,
    o0,
    o1,
    o2,
    ok,
    c0,
    c1,
    c2,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rm = r < n
    # Row r is (i0, i1, i2) of the [n / (D1 x D2), D1, D2] leading dimensions.
    i2 = r % D2
    i1 = (r // D2) % D1
    i0 = r // D2 // D1
    src_row = (i0 * s0 + i1 * s1 + i2 * s2)[:, None]
    dst_row = (i0 * o0 + i1 * o1 + i2 * o2)[:, None]
    col = tl.arange(0, BLOCK)
    count = tl.zeros([ROWS], dtype=tl.int32)
    # Walk 1: each valid slot to column (count so far + its rank among the block's valid slots).
    for k0 in range(0, K, BLOCK):
        k = (k0 + col).to(tl.int64)
        m = rm[:, None] & (k < K)[None, :]
        v = tl.load(src_ptr + src_row + k[None, :] * sk, mask=m, other=-1)
        valid = v >= 0
        rank = tl.cumsum(valid.to(tl.int32), axis=1)
        pos = (count[:, None] + rank - 1).to(tl.int64)
        tl.store(dst_ptr + dst_row + pos * ok, v, mask=valid)
        count += tl.sum(valid.to(tl.int32), axis=1)
    # Walk 2: -1 from each row's count to its end (columns walk 1 did not write).
    for k0 in range(0, K, BLOCK):
        k = (k0 + col).to(tl.int64)
        m = rm[:, None] & (k < K)[None, :] & (k[None, :] >= count[:, None])
        tl.store(dst_ptr + dst_row + k[None, :] * ok, tl.full([ROWS, BLOCK], -1, tl.int32), mask=m)
    tl.store(cnt_ptr + i0 * c0 + i1 * c1 + i2 * c2, count, mask=rm)


def _leading(lead: tuple[int, ...], *strides: tuple[int, ...]) -> tuple[list[int], list[list[int]]] | None:
    """The leading sizes ``lead`` (strides ``strides``, one tuple a tensor) as at most ``LEAD_DIMS``
    dimensions that index the same rows, padded in front with size 1: size-1 dimensions dropped, a
    dimension merged into the next when it steps as one with it in every tensor. ``None`` when more
    than ``LEAD_DIMS`` remain."""
    dims = [(size, [s[d] for s in strides]) for d, size in enumerate(lead) if size != 1]
    merged: list[tuple[int, list[int]]] = []
    for size, st in dims:
        if merged and all(a == b * size for a, b in zip(merged[-1][1], st, strict=True)):
            merged[-1] = (merged[-1][0] * size, st)
        else:
            merged.append((size, st))
    if len(merged) > LEAD_DIMS:
        return None
    merged = [(1, [0] * len(strides))] * (LEAD_DIMS - len(merged)) + merged
    return [size for size, _ in merged], [[st[t] for _, st in merged] for t in range(len(strides))]


def _check_output(name: str, t: object, shape: torch.Size, slots: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"compact_slots: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise InvalidInputError(f"compact_slots: {name} must be int32, got {t.dtype}")
    if t.shape != shape:
        raise InvalidInputError(
            f"compact_slots: {name} must have shape {tuple(shape)} for slots of shape "
            f"{tuple(slots.shape)}, got {tuple(t.shape)}"
        )
    if t.device != slots.device:
        raise InvalidInputError(f"compact_slots: {name} is on {t.device}, slots on {slots.device}")
    if torch._debug_has_internal_overlap(t) == 1:  # 1: certainly (an expanded tensor)
        raise InvalidInputError(f"compact_slots: {name}'s elements share memory (expanded?); each needs one")


def compact_slots(
    slots: torch.Tensor, out: torch.Tensor | None = None, counts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots in FlashInfer's sparse layout: ``out`` holds each row's valid slots (>= 0) first, in
    their order in ``slots``, then -1 (any negative slot counts as padding); ``counts`` holds the
    number of valid slots of each row. ``slots`` is int32 ``[..., K]`` (a row per index of the
    leading dimensions, e.g. ``[B, K]`` or ``[B, Q, K]``), any strides. ``out`` (int32, ``slots``'
    shape; may be ``slots`` itself) and ``counts`` (int32, ``slots.shape[:-1]``) default to fresh
    tensors; pass fixed buffers from a CUDA-graph-captured step. One launch, no host sync. Returns
    ``(out, counts)``."""
    if not isinstance(slots, torch.Tensor):
        raise InvalidInputError(f"compact_slots: slots must be a tensor, got {type(slots).__name__}")
    if slots.dtype != torch.int32:
        raise InvalidInputError(f"compact_slots: slots must be int32, got {slots.dtype}")
    if slots.dim() < 1:
        raise InvalidInputError(
            "compact_slots: slots must have at least one dimension ([..., K]), got a scalar"
        )
    lead, K = slots.shape[:-1], slots.shape[-1]
    if out is None:
        out = torch.empty(slots.shape, dtype=torch.int32, device=slots.device)
    else:
        _check_output("out", out, slots.shape, slots)
    if counts is None:
        counts = torch.empty(lead, dtype=torch.int32, device=slots.device)
    else:
        _check_output("counts", counts, lead, slots)
    if may_overlap(out, counts):
        raise InvalidInputError("compact_slots: out and counts share memory; each needs its own")
    n = counts.numel()
    if n == 0 or slots.device.type == "meta":
        return out, counts
    # In place (out is slots, element for element) is safe: see the module docstring. Any other
    # sharing would read slots the launch already overwrote: read a copy instead.
    same = out.data_ptr() == slots.data_ptr() and out.stride() == slots.stride()
    src = detached(slots, counts) if same else detached(slots, out, counts)
    dst, cnt = out, counts
    dims = _leading(tuple(lead), src.stride()[:-1], dst.stride()[:-1], cnt.stride())
    if dims is None:  # more than three leading strides: packed copies (never a [B, Q, K] view)
        src = src.contiguous()
        dst = torch.empty(slots.shape, dtype=torch.int32, device=slots.device)
        cnt = torch.empty(lead, dtype=torch.int32, device=slots.device)
        dims = _leading(tuple(lead), src.stride()[:-1], dst.stride()[:-1], cnt.stride())
    sizes, (s, o, c) = dims
    block = min(MAX_BLOCK, max(MIN_BLOCK, next_pow2(K)))
    rows = TILE // block
    compact_kernel[(cdiv(n, rows),)](
        src_ptr=src,
        dst_ptr=dst,
        cnt_ptr=cnt,
        n=n,
        D1=sizes[1],
        D2=sizes[2],
        K=K,
        s0=s[0],
        s1=s[1],
        s2=s[2],
        sk=src.stride(-1),
        o0=o[0],
        o1=o[1],
        o2=o[2],
        ok=dst.stride(-1),
        c0=c[0],
        c1=c[1],
        c2=c[2],
        ROWS=rows,
        BLOCK=block,
    )
    if dst is not out:
        out.copy_(dst)
        counts.copy_(cnt)
    return out, counts


def compact_slots_reference(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch twin of :func:`compact_slots`, a row at a time: the row's slots >= 0, in order,
    then -1 to the row's end; and how many there were."""
    rows = slots.reshape(slots.shape[:-1].numel(), slots.shape[-1])
    out = torch.full_like(rows, -1)
    counts = torch.zeros(rows.shape[0], dtype=torch.int32, device=slots.device)
    for i, row in enumerate(rows):
        valid = row[row >= 0]
        out[i, : valid.numel()] = valid
        counts[i] = valid.numel()
    return out.reshape(slots.shape), counts.reshape(slots.shape[:-1])
