"""``compact_slots`` (``ulakv.kernels.compact``): FlashMLA-style slots in FlashInfer's sparse layout.

Every case compares the kernel with its plain-torch twin, exactly (``torch.equal``), over odd widths
(K = 1, 7, 64, 257, 2051: one block, a partial one, several with a short last one), 1, 3 and 17 rows,
2-D and 3-D inputs, rows with no padding and rows of padding only, and caller views read in place: a
column slice of a wider tensor, a transposed view, every other row, leading dimensions in any order.
``out`` and ``counts`` are poisoned first (12345), so every element the call owns is shown written,
and memory around a strided ``out`` is shown untouched. A hypothesis property states the layout
itself, without the twin: ``counts`` is the number of slots >= 0, a row's first ``counts`` entries are
exactly those slots in order, the rest are -1.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from nosync import no_host_sync

from ulakv import InvalidInputError, compact_slots
from ulakv.kernels._triton import count_launches
from ulakv.kernels.compact import compact_slots_reference

POISON = 12345
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _slots(shape: tuple[int, ...], seed: int, padding: float = 0.4) -> torch.Tensor:
    """int32 slots of ``shape``: about ``padding`` of them -1, the rest distinct-looking slots >= 0
    (a few other negatives too: anything negative is padding)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 1 << 20, shape, generator=g, dtype=torch.int32)
    pad = torch.rand(shape, generator=g) < padding
    values[pad] = -1
    values[torch.rand(shape, generator=g) < 0.02] = -5
    return values.to(DEVICE)


def _view(kind: str, rows: int, K: int, seed: int) -> torch.Tensor:
    """A ``[rows, K]``-row input of the given kind (a 3-D one for ``3d``)."""
    if kind == "2d":
        return _slots((rows, K), seed)
    if kind == "3d":  # [B, Q, K] with Q = 3 (rows = B x 3)
        return _slots((rows, 3, K), seed)
    if kind == "no_padding":
        return _slots((rows, K), seed, padding=0.0).abs()
    if kind == "all_padding":
        return torch.full((rows, K), -1, dtype=torch.int32, device=DEVICE)
    if kind == "column_slice":  # row stride K + 9, starting 5 slots in
        return _slots((rows, K + 9), seed)[:, 5 : 5 + K]
    if kind == "transposed":  # slots of a row 'rows' apart, rows 1 apart
        return _slots((K, rows), seed).t()
    if kind == "every_other_row":  # [B, Q, K] taking every other B of a wider buffer
        return _slots((2 * rows, 3, K), seed)[::2]
    raise AssertionError(kind)


KINDS = ["2d", "3d", "no_padding", "all_padding", "column_slice", "transposed", "every_other_row"]
CASES = [
    pytest.param(kind, rows, K, id=f"{kind}-rows{rows}-K{K}")
    for kind in KINDS
    for rows in (1, 3, 17)
    for K in (1, 7, 64, 257, 2051)
    # the widest rows once per kind, and only the 2-D kinds at every size: the interpreter is slow
    if K != 2051 or rows == 3 or kind == "2d"
]


def _poisoned(shape: torch.Size) -> torch.Tensor:
    return torch.full(shape, POISON, dtype=torch.int32, device=DEVICE)


def _check(slots: torch.Tensor) -> None:
    want_out, want_counts = compact_slots_reference(slots)
    out, counts = _poisoned(slots.shape), _poisoned(slots.shape[:-1])
    before = slots.clone()
    got_out, got_counts = compact_slots(slots, out=out, counts=counts)
    assert got_out is out and got_counts is counts
    assert torch.equal(out, want_out), (out, want_out)
    assert torch.equal(counts, want_counts), (counts, want_counts)
    assert torch.equal(slots, before), "slots changed"
    fresh_out, fresh_counts = compact_slots(slots)
    assert torch.equal(fresh_out, want_out) and torch.equal(fresh_counts, want_counts)


@pytest.mark.parametrize(("kind", "rows", "K"), CASES)
def test_matches_the_reference(kind: str, rows: int, K: int) -> None:
    slots = _view(kind, rows, K, seed=rows * 10_000 + K)
    if kind in ("column_slice", "transposed", "every_other_row") and slots.numel() > 1:
        packed = torch.empty(slots.shape).stride()  # torch calls some of these contiguous (size-1 dims)
        assert slots.stride() != packed, "the case must be a strided view"
    _check(slots)


@pytest.mark.parametrize(
    "shape",
    [(5,), (1,), (4, 0), (0, 7), (2, 0, 3), (1, 1, 1), (2, 1, 3, 9)],
    ids=["1d", "1d-K1", "K0", "no-rows", "no-rows-3d", "all-ones", "4d"],
)
def test_edge_shapes(shape: tuple[int, ...]) -> None:
    _check(_slots(shape, seed=len(shape)))


def test_leading_dimensions_in_any_order() -> None:
    """Five leading dimensions permuted so that no two merge: the kernel's three leading strides do
    not reach, and the call goes through packed copies (still one launch)."""
    slots = _slots((2, 3, 2, 2, 5, 11), seed=7).permute(3, 1, 4, 0, 2, 5)
    _check(slots)
    # Leading dimensions swapped: [Q, B, K] of a [B, Q, K] buffer, read in place.
    _check(_slots((3, 4, 70), seed=8).transpose(0, 1))


def test_strided_out_and_counts_write_only_their_elements() -> None:
    """``out`` a column slice and ``counts`` every other element of wider buffers: the memory
    around them keeps its poison."""
    slots = _slots((6, 2, 300), seed=9)
    out_buf, counts_buf = _poisoned((6, 2, 310)), _poisoned((6, 4))
    out, counts = out_buf[:, :, 4:304], counts_buf[:, ::2]
    compact_slots(slots, out=out, counts=counts)
    want_out, want_counts = compact_slots_reference(slots)
    assert torch.equal(out, want_out) and torch.equal(counts, want_counts)
    assert (out_buf[:, :, :4] == POISON).all() and (out_buf[:, :, 304:] == POISON).all()
    assert (counts_buf[:, 1::2] == POISON).all()


def test_in_place() -> None:
    """``out`` may be ``slots`` itself: every slot moves left, after its block was read."""
    slots = _slots((9, 2100), seed=10)
    want_out, want_counts = compact_slots_reference(slots)
    out, counts = compact_slots(slots, out=slots)
    assert out is slots
    assert torch.equal(slots, want_out) and torch.equal(counts, want_counts)


def test_overlapping_input_is_read_before_it_is_overwritten() -> None:
    """``out`` one slot to the left of ``slots`` in the same buffer: the call reads a copy."""
    buf = _slots((4, 101), seed=11)
    slots, out = buf[:, 1:], buf[:, :-1]
    want_out, want_counts = compact_slots_reference(slots)
    _, counts = compact_slots(slots, out=out)
    assert torch.equal(out, want_out) and torch.equal(counts, want_counts)


def test_one_launch_and_no_host_sync() -> None:
    slots = _slots((3, 2, 513), seed=12)
    out, counts = _poisoned(slots.shape), _poisoned(slots.shape[:-1])
    with count_launches() as launches, no_host_sync():
        compact_slots(slots, out=out, counts=counts)
    assert launches == ["compact_kernel"]


def test_meta_tensors_give_shapes_only() -> None:
    out, counts = compact_slots(torch.empty((2, 3, 2048), dtype=torch.int32, device="meta"))
    assert out.shape == (2, 3, 2048) and counts.shape == (2, 3)
    assert out.dtype == counts.dtype == torch.int32 and out.is_meta and counts.is_meta


def _bad_calls():
    i32 = dict(dtype=torch.int32, device=DEVICE)
    s = torch.zeros((2, 8), **i32)
    buf = torch.zeros(32, **i32)
    return [
        pytest.param(([0, -1],), {}, "slots must be a tensor", id="not-a-tensor"),
        pytest.param((s.long(),), {}, "slots must be int32, got torch.int64", id="int64-slots"),
        pytest.param((torch.tensor(3, **i32),), {}, "at least one dimension", id="scalar"),
        pytest.param((s,), {"out": torch.zeros(2, 8, device=DEVICE)}, "out must be int32", id="float-out"),
        pytest.param((s,), {"out": torch.zeros(2, 9, **i32)}, "out must have shape (2, 8)", id="out-shape"),
        pytest.param(
            (s,), {"counts": torch.zeros(2, 1, **i32)}, "counts must have shape (2,)", id="counts-1"
        ),
        pytest.param(
            (s,),
            {"counts": torch.zeros(2, dtype=torch.int64, device=DEVICE)},
            "counts must be int32",
            id="c64",
        ),
        pytest.param((s,), {"out": [0] * 16}, "out must be a tensor", id="out-list"),
        pytest.param(
            (s,),
            {"out": torch.zeros(2, 8, dtype=torch.int32, device="meta")},
            "out is on meta, slots on",
            id="device",
        ),
        pytest.param(
            (s,), {"counts": torch.zeros(1, **i32).expand(2)}, "counts's elements share memory", id="expanded"
        ),
        pytest.param(
            (s,), {"out": buf[:16].view(2, 8), "counts": buf[15:17]}, "out and counts share", id="overlap"
        ),
    ]


@pytest.mark.parametrize(("args", "kwargs", "says"), _bad_calls())
def test_bad_arguments_are_refused_by_name(args: tuple, kwargs: dict, says: str) -> None:
    with pytest.raises(InvalidInputError, match=r"^compact_slots: .*" + re.escape(says)):
        compact_slots(*args, **kwargs)


@st.composite
def _inputs(draw) -> torch.Tensor:
    lead = draw(st.lists(st.integers(0, 4), min_size=0, max_size=2))
    K = draw(st.integers(0, 40))
    n = K * int(torch.Size(lead).numel())
    values = draw(
        st.lists(st.sampled_from([-1, -1, -1, -2, 0, 1, 2, 7, 99, 1 << 30]), min_size=n, max_size=n)
    )
    slots = torch.tensor(values, dtype=torch.int32, device=DEVICE).reshape(*lead, K)
    if draw(st.booleans()) and slots.dim() >= 2:  # read through a transposed view instead
        slots = slots.transpose(-1, -2).contiguous().transpose(-1, -2)
    return slots


@given(_inputs())
def test_layout_property(slots: torch.Tensor) -> None:
    out, counts = compact_slots(slots, out=_poisoned(slots.shape), counts=_poisoned(slots.shape[:-1]))
    n_rows, K = slots.shape[:-1].numel(), slots.shape[-1]
    rows, out_rows = slots.reshape(n_rows, K).tolist(), out.reshape(n_rows, K).tolist()
    for row, got, n in zip(rows, out_rows, counts.reshape(-1).tolist(), strict=True):
        valid = [v for v in row if v >= 0]
        assert n == len(valid)
        assert got[:n] == valid
        assert got[n:] == [-1] * (K - n)
