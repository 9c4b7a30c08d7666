"""Rows moved in 16-byte vectors: how the kernels address a row, and when they may.

A row of ``W`` elements (int32 words, or bytes when the width is not a multiple of 4: see
``operands.moves_words``) is moved as ``W // UNIT`` vectors of ``UNIT`` elements. The widest global
access sm_90 has is 16 bytes (``ld.global.v4.b32`` / ``st.global.v4.b32``): a 656-byte row is 41 of
them against 164 single words, a quarter of the memory instructions. Triton emits the wide access
only when it can prove every vector starts 16 bytes into aligned memory, so the kernels address a
row as a ``[rows, VECS, UNIT]`` tile (``unit_offsets``) and access it through ``load_units`` and
``store_units``, which state the alignment beside the access; the
launcher picks ``UNIT`` (``vector_unit``) so that the statement is true: the width a multiple of
``UNIT`` and every base pointer aligned to ``UNIT`` elements. Widths that allow less get narrower
vectors (8, 4, 2 bytes or single elements) from the same code.

The alignment is a launch-time fact that the launcher checks (``aligned_to``), not one Triton must
find: pointers whose alignment changes from call to call (a layer's rows, a caller's view) stay out
of Triton's alignment specialisation, and ``UNIT`` is the one constexpr that changes with it, so a
pool whose rows are all 16-byte aligned compiles one variant.
"""

from __future__ import annotations

import torch

from ._triton import tl, triton
from .common import next_pow2

# The widest global load and store of sm_90. Read at each launch, so that a benchmark can set it to
# 4 and time single words against vectors side by side (benchmarks/gpu_suite.py, vector_widths).
VECTOR_BYTES = 16


def aligned_to(t: torch.Tensor, unit: int) -> bool:
    """Whether every row of ``t`` starts on a vector of ``unit`` elements: its first element is
    aligned to the vector's bytes and every stride but the last (a dimension of size 1 is never
    stepped) is a multiple of ``unit``. A meta tensor has no memory to misalign."""
    if t.device.type != "meta" and t.data_ptr() % (unit * t.element_size()):
        return False
    outer = zip(t.shape[:-1], t.stride()[:-1], strict=True)
    return all(stride % unit == 0 for size, stride in outer if size > 1)


def vector_unit(width: int, *rows: torch.Tensor) -> int:
    """Elements a vector of the rows ``rows`` (tensors whose last dimension is ``width``
    elements, all of one element size, packed along it) may hold: the largest power of two whose
    bytes are at most ``VECTOR_BYTES``, that divides ``width``, and on which every row of every
    tensor starts (``aligned_to``)."""
    unit = max(1, VECTOR_BYTES // rows[0].element_size())
    while unit > 1 and not (width % unit == 0 and all(aligned_to(t, unit) for t in rows)):
        unit //= 2
    return unit


def vectors_per_row(width: int, unit: int) -> tuple[int, int]:
    """(vectors a row holds, the power of two a tile's vector axis spans)."""
    vectors = width // unit
    return vectors, next_pow2(vectors)


@triton.jit
def unit_offsets(rows, V, VECS: tl.constexpr, UNIT: tl.constexpr):
    """Element offsets ``[R, VECS, UNIT]`` of rows ``rows`` (``[R]`` int64) of ``V`` vectors of
    ``UNIT`` elements, and the mask ``[1, VECS, 1]`` of the vectors a row has (``VECS`` is ``V``
    rounded up to a power of two)."""
    v = tl.arange(0, VECS)
    u = tl.arange(0, UNIT)
    offsets = (rows[:, None, None] * V + v[None, :, None]) * UNIT + u[None, None, :]
    return offsets, (v < V)[None, :, None]


@triton.jit
def load_units(ptr, offsets, mask, UNIT: tl.constexpr, UNIT_BYTES: tl.constexpr):
    """``ptr[offsets]`` (``[R, VECS, UNIT]`` from ``unit_offsets``; 0 where ``mask`` is false),
    one access a vector: the launcher guaranteed that every vector starts ``UNIT_BYTES``-aligned,
    and the hint says so where the access is (a hint returned from a device function is lost):
    along the vector axis, each run of ``UNIT`` elements is contiguous and its first is aligned;
    nothing is claimed along the others."""
    B: tl.constexpr = UNIT_BYTES
    return tl.load(
        tl.max_contiguous(tl.multiple_of(ptr + offsets, [1, 1, B]), [1, 1, UNIT]), mask=mask, other=0
    )


@triton.jit
def store_units(ptr, offsets, values, mask, UNIT: tl.constexpr, UNIT_BYTES: tl.constexpr):
    """``ptr[offsets] = values`` where ``mask``, one access a vector (as :func:`load_units`)."""
    B: tl.constexpr = UNIT_BYTES
    tl.store(tl.max_contiguous(tl.multiple_of(ptr + offsets, [1, 1, B]), [1, 1, UNIT]), values, mask=mask)
