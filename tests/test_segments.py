"""Candidate segments (``ulakv.kernels.segments``) on their own: listers arrive at their blocks in
any order, the last one seals each block, the planning program sums the blocks, and every
candidate is found in the segment that holds it, against the host twins and a brute-force count.
Lengths include empty segments (several in a row, a block's first and last) and short last blocks.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from ulakv.kernels import segments as S
from ulakv.kernels._triton import tl, triton

LANES = 16


@triton.jit
def _list_kernel(seg_ptr, seg_blocks_ptr, arrivals_ptr, order_ptr, length_ptr, clean_ptr, n):
    """Program p lists segment order[p] (so the arrivals at a block come in the order given)."""
    k = tl.load(order_ptr + tl.program_id(0)).to(tl.int64)
    length = tl.load(length_ptr + k).to(tl.int64)
    clean = tl.load(clean_ptr + k).to(tl.int64)
    S.store_segment(seg_ptr, k, 1000 * k, length, clean, True)
    a = k // S.SEG_BLOCK
    S.arrive(
        seg_ptr, seg_blocks_ptr, arrivals_ptr, a, a, 1, 1, tl.minimum(S.SEG_BLOCK, n - a * S.SEG_BLOCK), 1
    )


@triton.jit
def _sum_kernel(seg_blocks_ptr, blocks, want, out_ptr, LANES: tl.constexpr):
    summed, run, clean_run = S.sum_blocks(seg_blocks_ptr, blocks, want, LANES)
    w = tl.arange(0, 4)
    tl.store(out_ptr + w, tl.where(w == 0, summed, tl.where(w == 1, run, clean_run)), mask=w < 3)


@triton.jit
def _find_kernel(r_ptr, m, seg_ptr, seg_blocks_ptr, blocks, out_ptr, last_ptr, LANES: tl.constexpr):
    i = tl.arange(0, LANES)
    mask = i < m
    r = tl.load(r_ptr + i, mask=mask, other=0)
    k, before, clean_before, at = S.find_segment(r, mask, seg_ptr, seg_blocks_ptr, blocks)
    tl.store(out_ptr + 4 * i + 0, k, mask=mask)
    tl.store(out_ptr + 4 * i + 1, before, mask=mask)
    tl.store(out_ptr + 4 * i + 2, clean_before, mask=mask)
    tl.store(out_ptr + 4 * i + 3, at, mask=mask)
    r_last = tl.load(r_ptr + m - 1)
    k, before, clean_before, at = S.find_last_segment(r_last, seg_ptr, seg_blocks_ptr, blocks, LANES)
    w = tl.arange(0, 4)
    words = tl.where(w == 0, k, tl.where(w == 1, before, tl.where(w == 2, clean_before, at)))
    tl.store(last_ptr + w, words)


def _lengths(rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    lengths = [rng.choice([0, 0, 1, 3, 17, 1024]) for _ in range(n)]
    return lengths, [rng.randint(0, x) for x in lengths]


@pytest.mark.parametrize(
    ("block", "n", "seed"),
    [(4, 1, 1), (4, 13, 2), (4, 16, 3), (2, 9, 4), (8, 40, 5), (64, 70, 6)],
    ids=["one-segment", "13-in-blocks-of-4", "16-in-blocks-of-4", "9-in-blocks-of-2", "40-in-8", "70-in-64"],
)
def test_sealed_blocks_find_every_candidate(block, n, seed, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(S, "SEG_BLOCK", tl.constexpr(block))
    monkeypatch.setattr(S, "LOG2_SEG_BLOCK", tl.constexpr(block.bit_length() - 1))
    rng = random.Random(seed)
    lengths, cleans = _lengths(rng, n)
    lengths[-1] = max(lengths[-1], 1)  # at least one candidate
    blocks = S.segment_blocks(n)
    poison = -7
    seg = torch.full((blocks * block, int(S.SEG_WORDS)), poison, dtype=torch.int64)
    seg_blocks = torch.full((blocks, int(S.BLOCK_WORDS)), poison, dtype=torch.int64)
    arrivals = torch.zeros(blocks, dtype=torch.int32)
    order = list(range(n))
    rng.shuffle(order)  # who arrives last at each block varies
    _list_kernel[(n,)](
        seg, seg_blocks, arrivals, torch.tensor(order), torch.tensor(lengths), torch.tensor(cleans), n
    )
    assert not arrivals.any(), "every block's last lister clears its count"
    ref = SimpleNamespace(seg=torch.full_like(seg, poison), seg_blocks=torch.full_like(seg_blocks, poison))
    for k in range(n):
        S.store_segment_reference(ref, k, 1000 * k, lengths[k], cleans[k])
    for b in range(blocks):
        S.seal_reference(ref, b, 1, 1, min(block, n - b * block))
    total = sum(lengths)
    out = torch.full((3,), poison, dtype=torch.int64)
    _sum_kernel[(1,)](seg_blocks, blocks, total, out, LANES=LANES)
    summed = S.sum_blocks_reference(ref, blocks, total, LANES)
    assert out.tolist() == list(summed) == [blocks, total, sum(cleans)]
    assert torch.equal(seg, ref.seg) and torch.equal(seg_blocks, ref.seg_blocks)

    # Every candidate, by brute force: its segment, the candidates and clean ones before it.
    r = torch.tensor([*rng.sample(range(total), min(total, LANES - 1)), total - 1])
    owner = [k for k in range(n) for _ in range(lengths[k])]
    expected = [[owner[x], sum(lengths[: owner[x]]), sum(cleans[: owner[x]]), 1000 * owner[x]] for x in r]
    found = torch.full((LANES, 4), poison, dtype=torch.int64)
    last = torch.full((4,), poison, dtype=torch.int64)
    _find_kernel[(1,)](r, r.numel(), seg, seg_blocks, blocks, found, last, LANES=LANES)
    assert found[: r.numel()].tolist() == expected
    assert last.tolist() == expected[-1]
    twin = torch.stack(S.find_segment_reference(ref, blocks, r), dim=1)
    assert twin.tolist() == expected


def test_sums_stop_where_the_victims_are_reached(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planning program sums LANES blocks a step and stops once the running total covers the
    candidates it wants: blocks past that step keep their words."""
    monkeypatch.setattr(S, "SEG_BLOCK", tl.constexpr(2))
    monkeypatch.setattr(S, "LOG2_SEG_BLOCK", tl.constexpr(1))
    blocks = 3 * LANES
    seg_blocks = torch.zeros((blocks, int(S.BLOCK_WORDS)), dtype=torch.int64)
    seg_blocks[:, int(S.B_TOTAL)] = 5
    seg_blocks[:, int(S.B_BEFORE)] = -7
    out = torch.zeros(3, dtype=torch.int64)
    _sum_kernel[(1,)](seg_blocks, blocks, 5 * LANES + 1, out, LANES=LANES)
    assert out.tolist() == [2 * LANES, 10 * LANES, 0]
    assert seg_blocks[: 2 * LANES, int(S.B_BEFORE)].tolist() == [5 * b for b in range(2 * LANES)]
    assert (seg_blocks[2 * LANES :, int(S.B_BEFORE)] == -7).all()
