"""Callers' tensors as engines hand them: views of other memory.

An engine passes KV rows cut from wider tensors, bf16 or fp8 memory viewed as bytes at any element,
transposed or strided index tensors, and output buffers that are slices of its own. Every pool kind
must read them for what they are (``ulakv.kernels.operands``): each row read back equals what was
written, every slot indexes the selected entry's rows, and the caller's memory is never written
(but for ``out``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from helpers import assert_same_state
from hypothesis import event, given, settings
from hypothesis import strategies as st
from nosync import no_host_sync, skip_under_debug

from ulakv import (
    CPUOffloadBaseline,
    EntrySpec,
    InvalidAddressError,
    InvalidInputError,
    Pool,
    PoolConfig,
    Replicated,
    Striped,
    Tiered,
    UlakvError,
)
from ulakv.kernels import operands
from ulakv.kernels.operands import as_words, may_overlap, readable_indices, readable_rows, writable_in_place
from ulakv.kernels.rows import aligned_to, vector_unit
from ulakv.spawn import run_ranks
from ulakv.testing import kernel_settings
from ulakv.transfer import PlanInterrupted, interrupt_after

LAYERS = 2  # one group of two layers: a prepare moves both
# Not the ``device`` fixture: hypothesis draws many examples per call of a test function.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _config(width: int, layout, device: torch.device = DEVICE) -> PoolConfig:
    return PoolConfig(
        entry=EntrySpec(bytes_per_layer=width),
        num_layers=LAYERS,
        layers_per_group=LAYERS,
        layout=layout,
        device=device,
    )


# Each kind small enough that six written entries overflow its GPU rows (evictions, CPU homes) and a
# selection of up to four distinct addresses fits one prepare.
LAYOUTS: dict[str, Callable[[], object]] = {
    "tiered": lambda: Tiered(gpu_slots=4, cpu_slots=12),
    "tiered-gpu-only": lambda: Tiered(gpu_slots=16),
    "replicated": lambda: Replicated(world=2, gpu_slots=16),
    "offload": lambda: CPUOffloadBaseline(cpu_slots=16, slots_per_request=4, max_requests=2),
    "striped": lambda: Striped(world=1, rank=0, buffer_slots=4, inner=Tiered(gpu_slots=4, cpu_slots=12)),
}


@contextlib.contextmanager
def pool_of(kind: str, width: int) -> Iterator[Pool]:
    """A pool of ``kind``; a striped one on a one-rank group of this process, torn down after."""
    layout = LAYOUTS[kind]()
    if not isinstance(layout, Striped):
        yield Pool(_config(width, layout))
        return
    backend = "nccl" if DEVICE.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield Pool(_config(width, layout))
    finally:
        dist.destroy_process_group()


INDEX_DTYPES = st.sampled_from([torch.int32, torch.int64])

# -- views of random memory ------------------------------------------------------------------------
# Memory an engine may hold its KV in, viewed as bytes.
MEMORY = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "int32": torch.int32,
}


def _random_memory(gen: torch.Generator, elements: int, dtype: torch.dtype) -> torch.Tensor:
    raw = torch.randint(0, 256, (elements * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.to(DEVICE).view(dtype)  # any bit pattern (NaN payloads included): the pool moves bytes


@st.composite
def caller_rows(draw, n: int, width: int) -> torch.Tensor:
    """uint8 ``[n, width]``: a view into random memory of another dtype, at a byte offset of 0-7,
    with rows packed, cut from wider rows, or transposed."""
    shape = draw(st.sampled_from(["packed-at-offset", "cut-from-wider", "transposed"]))
    if shape == "transposed":  # a dtype view of a last dimension with stride > 1 keeps the element size
        name = draw(st.sampled_from(["uint8", "int8"]))
    else:
        name = draw(st.sampled_from([k for k, d in MEMORY.items() if width % d.itemsize == 0]))
    dtype = MEMORY[name]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    per_row = width // dtype.itemsize
    skip = draw(st.integers(0, 7)) // dtype.itemsize  # elements before the first row: byte offsets 0-7
    if shape == "packed-at-offset":  # e.g. b[1:9].view(torch.uint8).view(2, 8)
        flat = _random_memory(gen, skip + n * per_row + 3, dtype)
        view = flat[skip : skip + n * per_row].view(torch.uint8).view(n, width)
    elif shape == "cut-from-wider":  # e.g. w[:, :8] of a [n, 11] tensor: row stride past the row
        wider = skip + per_row + draw(st.integers(1, 5))
        first = draw(st.integers(0, 2))
        table = _random_memory(gen, (first + n) * wider, dtype).view(first + n, wider)
        view = table[first:, skip : skip + per_row].view(torch.uint8)
    else:  # columns of a [width, m] byte table: the last dimension has stride m
        m = n + draw(st.integers(0, 3))
        table = _random_memory(gen, width * m, dtype).view(width, m)
        view = table[:, m - n :].t().view(torch.uint8)
    assert view.dtype == torch.uint8 and view.shape == (n, width)
    aligned = view.data_ptr() % 4 == 0 and view.stride(0) % 4 == 0 and view.stride(1) == 1
    event(f"{shape}, {'aligned' if aligned else 'unaligned'} {'words' if width % 4 == 0 else 'bytes'}")
    return view


@st.composite
def caller_indices(draw, values: list[int], dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``values`` (row-major) as a ``shape`` tensor: packed, every other element of a wider one,
    transposed (2-D) or a column of a table (1-D), or packed at an address that is not a multiple
    of the element size (wrapped host memory)."""
    data = torch.tensor(values, dtype=dtype, device=DEVICE).view(shape)
    ways = ["packed", "every-other", "transposed"] + ["unaligned"] * (DEVICE.type == "cpu")
    how = draw(st.sampled_from(ways))
    event(f"indices {how}")
    if how == "packed":
        return data
    if how == "every-other":
        wide = torch.full((2 * data.numel(),), -7, dtype=dtype, device=DEVICE)
        wide[::2] = data.view(-1)
        return wide[::2].view(shape)
    if how == "transposed":
        if len(shape) == 1:  # a column of a [n, 3] table: stride 3
            table = torch.full((shape[0], 3), -7, dtype=dtype, device=DEVICE)
            table[:, 1] = data
            return table[:, 1]
        table = torch.full(shape[::-1], -7, dtype=dtype, device=DEVICE)
        view = table.t()
        view.copy_(data)
        return view
    offset = draw(st.integers(1, dtype.itemsize - 1))
    memory = bytearray(offset + data.numel() * dtype.itemsize)
    wrapped = torch.frombuffer(memory, dtype=dtype, offset=offset, count=data.numel())
    wrapped.copy_(data.view(-1))
    return wrapped.view(shape)


def _memory_of(t: torch.Tensor) -> torch.Tensor:
    """A copy of every byte of the storage ``t`` views (to show the pool never wrote it)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).clone()


def _assert_slots_hold(pool: Pool, selection: list[int], slots: list[int], expected) -> None:
    """Each selected address's slot holds its rows in every layer; padding's slot is -1."""
    for a, slot in zip(selection, slots, strict=True):
        if a < 0:
            assert slot == -1
        else:
            for layer in range(LAYERS):
                assert torch.equal(pool.gpu_buffer(layer)[slot], expected[layer, a]), f"{a}, layer {layer}"


# -- the property ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(LAYOUTS))
# 15 examples a pool kind, under the kernel profile: 75 in all, each a pool's writes, reads and prepare
# through drawn views (25 a kind took 60 s of a 2-core CI); the cases the bug was found with follow.
@settings(kernel_settings(max_examples=15))
@given(data=st.data(), width=st.sampled_from([6, 8, 12, 13]), n=st.integers(1, 6))
def test_rows_written_through_any_view_read_back_exactly(kind: str, data, width: int, n: int) -> None:
    with pool_of(kind, width) as pool:
        seq = pool.admit(n)
        addresses = seq.addresses.tolist()
        expected: dict[tuple[int, int], torch.Tensor] = {}
        for layer in range(LAYERS):
            order = data.draw(st.permutations(addresses), label="write order")
            rows = data.draw(caller_rows(n, width), label=f"rows of layer {layer}")
            addrs = data.draw(caller_indices(order, data.draw(INDEX_DTYPES), (n,)))
            memory = _memory_of(rows)
            pool.write(layer, addrs, rows)
            assert torch.equal(_memory_of(rows), memory), "write changed the caller's rows"
            expected.update({(layer, a): rows[i].clone() for i, a in enumerate(order)})

        def assert_reads_back() -> None:
            for layer in range(LAYERS):
                want = torch.stack([expected[layer, a] for a in addresses])
                addrs = data.draw(caller_indices(addresses, data.draw(INDEX_DTYPES), (n,)))
                assert torch.equal(pool.read(layer, addrs), want), f"layer {layer} read back differs"

        assert_reads_back()
        # A [2, k] selection of up to four distinct addresses (one repeated, padding), as a view.
        chosen = data.draw(st.lists(st.sampled_from(addresses), min_size=1, max_size=4, unique=True))
        selection = [*chosen, chosen[0], -1] + [-1] * (len(chosen) % 2)
        topk = data.draw(caller_indices(selection, data.draw(INDEX_DTYPES), (2, len(selection) // 2)))
        memory = _memory_of(topk)
        _assert_slots_hold(pool, selection, pool.prepare(0, topk).slots.reshape(-1).tolist(), expected)
        assert torch.equal(_memory_of(topk), memory), "prepare changed the caller's selection"
        assert_reads_back()


# -- the two cases the bug was found with ----------------------------------------------------------------
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_a_row_cut_from_a_wider_tensor(kind: str) -> None:
    """``w[:, :8]`` of ``[1, 11]``: torch calls it contiguous, its row stride is 11 bytes."""
    with pool_of(kind, 8) as pool:
        seq = pool.admit(1)
        w = torch.zeros(1, 11, dtype=torch.uint8, device=DEVICE)
        w[0, :8] = torch.arange(1, 9)
        pool.write(0, seq.addresses, w[:, :8])
        assert pool.read(0, seq.addresses).tolist() == [list(range(1, 9))]


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_bf16_memory_viewed_as_bytes_at_an_offset_of_two(kind: str) -> None:
    """``b[1:9].view(torch.uint8)``: packed, but 2 bytes past a word boundary."""
    with pool_of(kind, 8) as pool:
        pool.admit(1)
        b = torch.arange(10, dtype=torch.bfloat16, device=DEVICE)
        v = b[1:9].view(torch.uint8).view(2, 8)
        seq = pool.admit(2)
        pool.write(0, seq.addresses, v)
        assert torch.equal(pool.read(0, seq.addresses), v)


def _bug_cases_on_ranks(rank: int, world: int) -> None:
    """Both cases on a two-rank striped pool: rows homed on either rank, fetched into the buffer."""
    layout = Striped(world=world, rank=rank, buffer_slots=4, inner=Tiered(gpu_slots=2, cpu_slots=6))
    pool = Pool(_config(8, layout, torch.device("cpu")))  # gloo ranks, kernels interpreted
    w = torch.zeros(4, 11, dtype=torch.uint8)
    w[:, :8] = torch.arange(1, 33, dtype=torch.uint8).view(4, 8)
    b = torch.arange(1, 18, dtype=torch.bfloat16)
    v = b[1:17].view(torch.uint8).view(4, 8)
    seq = pool.admit(4)
    pool.write(0, seq.addresses, w[:, :8])
    pool.write(1, seq.addresses, v)
    slots = pool.prepare(0, seq.addresses.view(1, 4)).slots.view(-1).long()
    assert torch.equal(pool.gpu_buffer(0)[slots], w[:, :8]) and torch.equal(pool.gpu_buffer(1)[slots], v)
    assert torch.equal(pool.read(0, seq.addresses), w[:, :8]) and torch.equal(pool.read(1, seq.addresses), v)


def test_both_cases_on_two_striped_ranks() -> None:
    run_ranks(_bug_cases_on_ranks, 2)


# -- output buffers and aliasing -----------------------------------------------------------------------
def _written_pool(width: int = 8, n: int = 6) -> tuple[Pool, list[int], dict[tuple[int, int], torch.Tensor]]:
    pool = Pool(_config(width, Tiered(gpu_slots=4, cpu_slots=12)))
    seq = pool.admit(n)
    gen = torch.Generator().manual_seed(5)
    expected = {}
    for layer in range(LAYERS):
        rows = torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=gen).to(DEVICE)
        pool.write(layer, seq.addresses, rows)
        expected.update({(layer, a): rows[i] for i, a in enumerate(seq.addresses.tolist())})
    return pool, seq.addresses.tolist(), expected


OUT_VIEWS = {
    # the first k columns of an engine's [max_batch, max_k] buffer (row-major: row 0 first)
    "columns-of-wider": lambda k: torch.full((2, k + 3), 99, dtype=torch.int32, device=DEVICE)[:, :k],
    "transposed": lambda k: torch.full((k, 2), 99, dtype=torch.int32, device=DEVICE).t(),
    "every-other": lambda k: torch.full((2 * k,), 99, dtype=torch.int32, device=DEVICE)[::2],
    "packed-larger-than-needed": lambda k: torch.full((k + 5,), 99, dtype=torch.int32, device=DEVICE),
}


@pytest.mark.parametrize("how", list(OUT_VIEWS))
def test_out_of_any_view_receives_the_slots_in_row_major_order(how: str) -> None:
    pool, addresses, expected = _written_pool()
    twin, _, _ = _written_pool()
    selection = [addresses[0], addresses[5], -1, addresses[2], addresses[0]]
    want = twin.prepare(0, torch.tensor([selection], device=DEVICE)).slots.view(-1)
    _assert_slots_hold(twin, selection, want.tolist(), expected)
    out = OUT_VIEWS[how](len(selection))
    base = out if out._base is None else out._base
    after = base.clone()  # what base must hold: the slots in out's first elements, nothing else
    at = torch.arange(len(want), device=DEVICE)
    after.as_strided(out.shape, out.stride(), out.storage_offset()).put_(at, want)
    pool.run(pool.plan(0, torch.tensor([selection], device=DEVICE), out=out))
    assert torch.equal(base, after)


def test_out_that_is_the_selection_itself() -> None:
    """Slots written over the addresses they replace: the kernels read the selection after the
    slots are out, so the pool reads a copy of it."""
    pool, addresses, expected = _written_pool()
    selection = [addresses[4], addresses[1], -1, addresses[3]]
    topk = torch.tensor([selection], dtype=torch.int32, device=DEVICE)
    pool.run(pool.plan(0, topk, out=topk))
    _assert_slots_hold(pool, selection, topk.view(-1).tolist(), expected)
    again = pool.prepare(0, torch.tensor([selection], device=DEVICE)).slots.view(-1).tolist()
    assert again == topk.view(-1).tolist()  # the pool's state is what a plain prepare leaves


@pytest.mark.parametrize("kind", ["offload", "striped"])
def test_rows_that_are_a_view_of_the_pools_own_buffer(kind: str) -> None:
    """Copying entries through the pool's own GPU rows (a fork of a request's tail): the write may
    move those very rows, so it reads a copy of them."""
    with pool_of(kind, 8) as pool:
        seq = pool.admit(4)
        rows = torch.arange(1, 33, dtype=torch.uint8, device=DEVICE).view(4, 8)
        pool.write(0, seq.addresses, rows)
        slots = pool.prepare(0, seq.addresses.view(1, 4)).slots.view(-1)
        buffer = pool.gpu_buffer(0)
        lo = int(slots.min())
        window = buffer[lo : lo + 4]  # a view of the pool's rows, whatever they hold
        want = window.clone()
        fork = pool.admit(4)
        pool.write(0, fork.addresses, window)
        assert torch.equal(pool.read(0, fork.addresses), want)
        assert torch.equal(pool.read(0, seq.addresses), rows)


def test_a_write_whose_rows_view_the_slot_its_own_miss_evicts() -> None:
    """Rows ``gpu_buffer(0)[s : s + 2]`` written to a hit homed elsewhere and to a new entry whose
    miss evicts slot ``s``: the miss's row lands in ``s`` before the hit's row is read from it, so
    the write must read a copy (read in place, the hit got the new entry's bytes)."""
    pool = Pool(_config(8, Tiered(gpu_slots=4, cpu_slots=12)))
    seq = pool.admit(4)
    a = seq.addresses.tolist()
    rows = torch.arange(1, 33, dtype=torch.uint8, device=DEVICE).view(4, 8)
    pool.write(0, seq.addresses, rows)
    pool.prepare(0, torch.tensor([a[1:]], device=DEVICE))  # a new round: a[0] is the one to evict
    new = int(pool.admit(1).addresses)
    s = int(pool.residency(0, seq.addresses[:1]))
    window = pool.gpu_buffer(0)[s : s + 2]
    want = window.clone()
    pool.write(0, torch.tensor([a[2], new], device=DEVICE), window)
    assert pool.residency(0, torch.tensor([a[0], new], device=DEVICE)).tolist() == [-1, s]  # it did evict
    assert torch.equal(pool.read(0, torch.tensor([a[2], new], device=DEVICE)), want)
    assert torch.equal(pool.read(0, seq.addresses[:1]), rows[:1])


def test_out_whose_elements_share_memory_is_refused_before_anything_changes() -> None:
    pool, addresses, _ = _written_pool()
    before = pool.state_dict()
    out = torch.full((1,), 99, dtype=torch.int32, device=DEVICE).expand(3)
    with pytest.raises(InvalidInputError, match="share memory"):
        pool.plan(0, torch.tensor([addresses[:3]], device=DEVICE), out=out)
    assert_same_state(before, pool.state_dict())


@pytest.mark.parametrize("phase", ["out", "evict", "in"])
def test_a_strided_out_is_filled_once_the_slots_exist_even_across_an_interrupt(
    phase: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slots reach a strided ``out`` with the ``evict`` phase: not before (interrupted after
    ``out``: untouched until the pool finishes the plan), and exactly once."""
    fills, fill = [], operands.fill_out

    def counted(out: torch.Tensor, values: torch.Tensor) -> None:
        fills.append(out)
        fill(out, values)

    monkeypatch.setattr(operands, "fill_out", counted)
    pool, addresses, expected = _written_pool()
    selection = [addresses[5], addresses[0], -1]
    out = OUT_VIEWS["every-other"](len(selection))
    with interrupt_after(pool, phase), pytest.raises(PlanInterrupted):
        pool.run(pool.plan(0, torch.tensor([selection], device=DEVICE), out=out))
    if phase == "out":
        assert out.tolist() == [99] * len(selection) and not fills
    pool.stats()  # any call finishes the plan first
    _assert_slots_hold(pool, selection, out.tolist(), expected)
    assert len(fills) == 1


@skip_under_debug  # a deferred refusal needs validate=False, which ULAKV_DEBUG overrides
def test_a_refused_prepare_fills_a_strided_out_with_minus_one() -> None:
    """Without validation a refusal is recorded on the device: every slot is -1, in ``out`` too."""
    pool = Pool(_config(8, Tiered(gpu_slots=4, cpu_slots=12)).replace(validate=False))
    seq = pool.admit(3)
    out = OUT_VIEWS["columns-of-wider"](3)
    pool.run(pool.plan(0, torch.tensor([[int(seq.addresses[0]), 999, -1]], device=DEVICE), out=out))
    assert out[0].tolist() == [-1, -1, -1] and out[1].tolist() == [99, 99, 99]
    with pytest.raises(InvalidAddressError):
        pool.check()


# -- the operand rules themselves ----------------------------------------------------------------------
def test_aligned_packed_operands_are_used_in_place() -> None:
    rows = torch.zeros(5, 12, dtype=torch.uint8)
    assert readable_rows(rows).data_ptr() == rows.data_ptr() and readable_rows(rows).dtype == torch.int32
    odd = torch.zeros(5, 13, dtype=torch.uint8)
    assert readable_rows(odd).data_ptr() == odd.data_ptr() and readable_rows(odd).dtype == torch.uint8
    one_row = torch.zeros(1, 12, dtype=torch.uint8)[:, :8]  # row stride 12, a multiple of 4
    assert readable_rows(one_row).data_ptr() == one_row.data_ptr()
    idx = torch.arange(6).view(2, 3)
    assert readable_indices(idx).data_ptr() == idx.data_ptr()
    assert writable_in_place(torch.zeros(3, 4, dtype=torch.int32))


@pytest.mark.parametrize(
    "rows",
    [
        pytest.param(torch.arange(24, dtype=torch.uint8)[2:18].view(2, 8), id="byte-offset-2"),
        pytest.param(torch.arange(33, dtype=torch.uint8).view(3, 11)[:, :8], id="row-stride-11"),
        pytest.param(torch.arange(24, dtype=torch.uint8).view(8, 3).t(), id="transposed"),
        pytest.param(
            torch.frombuffer(bytearray(range(40)), dtype=torch.uint8, offset=1, count=32)[3:19].view(2, 8),
            id="aligned-address-odd-storage-offset",
        ),
    ],
)
def test_unreadable_rows_are_copied_to_packed_aligned_words(rows: torch.Tensor) -> None:
    words = readable_rows(rows)
    assert words.dtype == (torch.int32 if rows.shape[-1] % 4 == 0 else torch.uint8)
    assert words.is_contiguous() and words.data_ptr() % 4 == 0
    assert torch.equal(words.view(torch.uint8).view(rows.shape), rows)


def test_indices_at_an_unaligned_address_are_copied() -> None:
    wrapped = torch.frombuffer(bytearray(64), dtype=torch.int64, offset=3, count=5)
    assert wrapped.data_ptr() % 8 == 3
    flat = readable_indices(wrapped)
    assert flat.data_ptr() % 8 == 0 and torch.equal(flat, wrapped)
    assert not writable_in_place(torch.frombuffer(bytearray(64), dtype=torch.int32, offset=1, count=4))


def test_pool_rows_the_kernels_cannot_view_raise() -> None:
    """The pool's own rows are never copied: a layout they cannot be viewed in is a bug, raised."""
    with pytest.raises(UlakvError, match="not 4-byte aligned"):
        as_words(torch.zeros(40, dtype=torch.uint8)[2:34].view(4, 8))
    with pytest.raises(UlakvError, match="not packed"):
        as_words(torch.zeros(4, 11, dtype=torch.uint8)[:2, :8])
    with pytest.raises(UlakvError, match="not packed"):  # bytes too: rows are stepped by the width
        as_words(torch.zeros(2, 5, 13, dtype=torch.uint8)[:, :, :6])
    with pytest.raises(UlakvError, match="not words"):  # layers 17 bytes apart
        as_words(torch.zeros(64, dtype=torch.uint8).as_strided((3, 2, 8), (17, 8, 1)))
    assert as_words(torch.zeros(3, 10, 8, dtype=torch.uint8)[:, :4]).shape == (3, 4, 2)  # layers apart: fine


def test_overlap_is_judged_by_byte_ranges() -> None:
    buf = torch.zeros(10, 8, dtype=torch.uint8)
    assert may_overlap(buf[2:4], buf[3:6])
    assert not may_overlap(buf[2:4], buf[4:6])
    assert may_overlap(buf[:, :4], buf[5:6, 6:])  # interleaved: counted as overlapping
    assert not may_overlap(buf, buf.clone())
    assert not may_overlap(buf[:0], buf)


@skip_under_debug
def test_views_cost_no_host_sync() -> None:
    """Bringing views to the kernels looks at shapes, strides and pointers, never at device data:
    a non-validating pool takes misaligned rows, strided addresses and a strided ``out`` without
    one read-back."""
    pool = Pool(_config(8, Tiered(gpu_slots=4, cpu_slots=12)).replace(validate=False))
    seq = pool.admit(3)
    b = torch.arange(1, 26, dtype=torch.bfloat16, device=DEVICE)
    rows = b[1:13].view(torch.uint8).view(3, 8)  # 2 bytes past a word
    addrs = torch.stack([seq.addresses, seq.addresses]).t()[:, 0]  # stride 2
    topk = torch.stack([seq.addresses.flip(0), seq.addresses]).t()[:, :1].t()  # [1, 3], stride 2
    out = torch.full((2, 6), -7, dtype=torch.int32, device=DEVICE)[:, ::2]
    with no_host_sync():
        pool.write(0, addrs, rows)
        pool.write(1, addrs, rows)
        pool.run(pool.plan(0, topk, out=out))
    pool.check()
    selection = seq.addresses.flip(0).tolist()
    expected = {(layer, a): rows[i] for layer in range(LAYERS) for i, a in enumerate(seq.addresses.tolist())}
    _assert_slots_hold(pool, selection, out.reshape(-1)[:3].tolist(), expected)


@pytest.mark.parametrize(
    ("words", "unit"),
    [
        pytest.param(torch.zeros(3, 2, 164, dtype=torch.int32), 4, id="packed-656-byte-rows"),
        pytest.param(torch.zeros(3, 2, 166, dtype=torch.int32)[:, :, :164], 2, id="rows-8-bytes-apart"),
        pytest.param(
            torch.zeros(3 * 2 * 164 + 1, dtype=torch.int32)[1:].view(3, 2, 164), 1, id="start-off-4"
        ),
        pytest.param(
            torch.zeros(3 * 330, dtype=torch.int32).as_strided((3, 2, 164), (330, 164, 1)),
            2,
            id="layers-8-apart",
        ),
        pytest.param(
            torch.zeros(200, dtype=torch.int32).as_strided((1, 1, 164), (7, 3, 1)),
            4,
            id="one-row-odd-strides",
        ),
        pytest.param(torch.zeros(2, 162, dtype=torch.int32), 2, id="width-162"),
    ],
)
def test_rows_move_in_the_widest_vector_every_row_starts_on(words: torch.Tensor, unit: int) -> None:
    """The vector a launch may promise: it divides the width, and every row (of every layer) starts
    on one; a smaller vector is the answer, never a misaligned access."""
    width = words.shape[-1]
    assert vector_unit(width, words) == unit
    assert aligned_to(words, unit)
    wider = unit * 2
    assert unit == 4 or width % wider or not aligned_to(words, wider)  # 16 B is sm_90's widest
