"""What the kernels assume of the tensors they are handed, and how a caller's tensor is made to fit.

Every kernel addresses memory as ``base + index * width + column``: elements packed in row-major
order, and a row of ``bytes_per_layer`` bytes moved as 4-byte words whenever the width is a multiple
of 4 (656 B = 164 words: a quarter of the instructions of a byte copy). On a GPU a word access must
also be 4-byte aligned. A caller's tensor can break each assumption while torch still calls it
contiguous:

- a row cut from a wider tensor: ``w[:, :8]`` of a ``[1, 11]`` tensor has row stride 11 (torch ignores
  the stride of a dimension of size 1);
- bf16 or fp8 memory viewed as bytes from an odd element: ``b[1:9].view(torch.uint8)`` starts 2 bytes
  past the storage's start, so its words straddle the real ones;
- memory wrapped at any byte: ``torch.frombuffer(buf, dtype=torch.int32, offset=1)``.

So there are two kinds of operand:

- the pool's own rows (``as_words``), laid out by the pool: viewed, never copied; rows that cannot be
  viewed as words are a bug and raise (never a silent byte path beside word paths);
- a caller's tensors (``readable_rows``, ``readable_indices``): the caller's memory when the kernels
  can read it in place (an aligned packed tensor costs nothing extra), else one packed, aligned copy.
  An output buffer the kernels cannot store into in place (``writable_in_place``) is filled by a copy
  after the kernel wrote the pool's own (``fill_out``).

Both kinds decide words or bytes by the width alone (``moves_words``), so the rows of one launch are
all words or all bytes. ``may_overlap`` tells when a caller's tensor shares memory with what a call
writes: a write whose rows are a view of the pool's own rows, or a ``prepare`` whose output buffer is
its own selection, would read bytes the call has already overwritten, so the pool copies the input
first (``detached``). None of this reads device memory: it looks at shapes, strides and pointers.
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import UlakvError

WORD_BYTES = 4


def moves_words(width: int) -> bool:
    """Whether rows of ``width`` bytes move as int32 words (else as bytes)."""
    return width % WORD_BYTES == 0


def _fits(t: torch.Tensor, alignment: int) -> bool:
    """Packed row-major (torch's contiguity: a dimension of size 1 may have any stride) and the
    first element ``alignment``-aligned in memory (a meta tensor has no memory to misalign)."""
    return t.is_contiguous() and (t.device.type == "meta" or t.data_ptr() % alignment == 0)


def as_words(rows: torch.Tensor) -> torch.Tensor:
    """The pool's own byte rows ``[..., slots, width]`` as int32 words ``[..., slots, width // 4]``
    when ``moves_words(width)``, else the bytes themselves. A view, never a copy: the pool lays its
    rows out packed (the kernels step from row to row by the width; leading dimensions, such as
    layers, may have any stride) and aligned, so rows that are not raise ``UlakvError``."""
    width = rows.shape[-1]
    packed = rows.stride(-1) == 1 and (rows.dim() < 2 or rows.shape[-2] <= 1 or rows.stride(-2) == width)
    if not packed:
        raise UlakvError(f"pool rows {tuple(rows.shape)} with strides {rows.stride()} are not packed")
    if not moves_words(width):
        return rows
    if rows.device.type != "meta" and rows.data_ptr() % WORD_BYTES:
        raise UlakvError(f"pool rows at address {rows.data_ptr():#x} are not {WORD_BYTES}-byte aligned")
    try:
        return rows.view(torch.int32)
    except RuntimeError as exc:
        raise UlakvError(f"pool rows {tuple(rows.shape)} with strides {rows.stride()} are not words") from exc


def readable_rows(rows: torch.Tensor) -> torch.Tensor:
    """A caller's byte rows (uint8 ``[..., width]``; any strides, offset or alignment) as the kernels
    read them: packed, and int32 words ``[..., width // 4]`` when ``moves_words(width)``. The caller's
    own memory when the kernels can read it in place, else one packed, aligned copy."""
    if not moves_words(rows.shape[-1]):
        return rows if rows.is_contiguous() else rows.clone(memory_format=torch.contiguous_format)
    if _fits(rows, WORD_BYTES):
        with contextlib.suppress(RuntimeError):  # 1.3 us: the common case, an aligned packed tensor
            return rows.view(torch.int32)
        with contextlib.suppress(RuntimeError):  # a size-1 dimension of odd stride: view(shape) packs it
            return rows.view(rows.shape).view(torch.int32)
        # else: aligned, but an odd number of bytes into memory wrapped at an odd address
    return rows.clone(memory_format=torch.contiguous_format).view(torch.int32)


def readable_indices(t: torch.Tensor) -> torch.Tensor:
    """A caller's integer tensor (addresses, a selection; any shape and strides) flattened to ``[n]``
    as the kernels read it: packed and aligned to its element size. A view of ``t`` when it already
    is, else a copy."""
    flat = t.reshape(-1)  # a view when t is packed, else a fresh (aligned) copy
    return flat if _fits(flat, flat.element_size()) else flat.clone()


def writable_in_place(out: torch.Tensor) -> bool:
    """Whether a kernel can store into ``out`` directly, as ``[n]`` in row-major order: packed and
    aligned to its element size. When not, the pool has the kernel write a buffer of its own and
    copies that into ``out``."""
    return _fits(out, out.element_size())


def fill_out(out: torch.Tensor, values: torch.Tensor) -> None:
    """Put ``values`` (``[n]``) into the first ``n`` elements of ``out`` (any view, row-major order):
    two small device ops, no host sync. An inference tensor is written in inference mode, the only
    place torch lets it be written."""
    with torch.inference_mode(out.is_inference()):
        out.put_(torch.arange(values.numel(), device=out.device), values)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[start, stop)`` that ``t``'s elements lie in (torch strides are never
    negative, so the first element is the lowest)."""
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    start = t.data_ptr()
    return start, start + (span + 1) * t.element_size()


def may_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share a byte (their byte ranges intersect; interleaved views of
    one buffer count as overlapping, which costs at most one needless copy)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.device.type == "meta":
        return False
    sa, sb = a.untyped_storage(), b.untyped_storage()  # disjoint allocations: the usual, cheap answer
    if sa.data_ptr() + sa.nbytes() <= sb.data_ptr() or sb.data_ptr() + sb.nbytes() <= sa.data_ptr():
        return False
    (a0, a1), (b0, b1) = _extent(a), _extent(b)
    return a0 < b1 and b0 < a1


def detached(t: torch.Tensor, *written: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it when it may share memory with any of ``written`` (what the call is
    about to overwrite while it still reads ``t``)."""
    return t.clone() if any(may_overlap(t, w) for w in written) else t
