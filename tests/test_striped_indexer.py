"""Striped indexer: each rank scores only its keys; both ways of combining equal the global top-k
exactly, ties included (gloo, world 2 and 4)."""

from __future__ import annotations

import pytest
import torch

from ulakv.engine.indexer import global_topk, topk_all_scores, topk_merge
from ulakv.spawn import run_ranks


def scores_for(seed: int, queries: int, context: int) -> torch.Tensor:
    """Coarse scores (16 levels) so that ties are everywhere; a few -inf (masked) positions."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 16, (queries, context), generator=gen).float() / 4
    s[:, torch.randint(0, context, (context // 10,), generator=gen)] = float("-inf")
    return s


def striping(context: int, world: int, seed: int) -> list[torch.Tensor]:
    """Positions each rank holds: by their (shuffled) logical address mod world, as a pool would."""
    addresses = torch.randperm(context, generator=torch.Generator().manual_seed(seed))
    return [torch.nonzero(addresses % world == r).flatten() for r in range(world)]


def _combine(rank: int, world: int, cases: list[tuple[int, int, int, int]]) -> list:
    out = []
    for seed, queries, context, k in cases:
        dense = scores_for(seed, queries, context)
        positions_of = striping(context, world, seed)
        mine = positions_of[rank]
        local = dense[:, mine]
        merged, merge_bytes = topk_merge(local, mine, k)
        gathered, gather_bytes = topk_all_scores(local, positions_of, context, k)
        out.append((merged, gathered, merge_bytes, gather_bytes))
    return out


CASES = [
    # seed, queries, context, k: k above the context, k equal to it, a long context, one query
    (1, 3, 37, 50),
    (2, 2, 64, 64),
    (3, 3, 1000, 96),
    (4, 1, 333, 7),
]


@pytest.mark.parametrize("world", [2, 4])
def test_both_combinations_equal_the_global_topk(world) -> None:
    results = run_ranks(_combine, world, CASES)
    for i, (seed, queries, context, k) in enumerate(CASES):
        want = global_topk(scores_for(seed, queries, context), k)
        for rank in range(world):
            merged, gathered, merge_bytes, gather_bytes = results[rank][i]
            assert torch.equal(merged, want), f"merge, case {i}, rank {rank}"
            assert torch.equal(gathered, want), f"all scores, case {i}, rank {rank}"
            assert merge_bytes == (world - 1) * queries * k * 8
            width = max(p.numel() for p in striping(context, world, seed))
            assert gather_bytes == (world - 1) * queries * width * 4


def test_global_topk_pads_and_breaks_ties_low() -> None:
    s = torch.tensor([[1.0, 3.0, 3.0, float("-inf"), 2.0]])
    assert global_topk(s, 3).tolist() == [[1, 2, 4]]
    assert global_topk(s, 7).tolist() == [[1, 2, 4, 0, 3, -1, -1]]
