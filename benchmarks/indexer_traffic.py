"""Striped indexer traffic: bytes each rank receives per decode step, gathering all scores against
merging each rank's top-k candidates, at 8 K, 64 K and 128 K tokens of context.

    python benchmarks/indexer_traffic.py [--worlds 4 8] [--k 2048] [--queries 1 3]

Runs the real collectives on gloo processes (CPU) and checks both results against the single-device
top-k before reporting; the bytes are what the collectives moved, the same on any transport.
"""

from __future__ import annotations

import argparse

import torch

from ulakv.engine.indexer import global_topk, topk_all_scores, topk_merge
from ulakv.spawn import run_ranks

CONTEXTS = (8 * 1024, 64 * 1024, 128 * 1024)


def _measure(rank: int, world: int, k: int, queries: int) -> list[tuple[int, int, int]]:
    out = []
    for context in CONTEXTS:
        gen = torch.Generator().manual_seed(context)
        dense = torch.randn(queries, context, generator=gen)
        addresses = torch.randperm(context, generator=gen)
        positions_of = [torch.nonzero(addresses % world == r).flatten() for r in range(world)]
        local = dense[:, positions_of[rank]]
        merged, merge_bytes = topk_merge(local, positions_of[rank], k)
        gathered, gather_bytes = topk_all_scores(local, positions_of, context, k)
        want = global_topk(dense, k)
        assert torch.equal(merged, want) and torch.equal(gathered, want)
        out.append((context, gather_bytes, merge_bytes))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 3])
    args = parser.parse_args()
    print(
        "| ranks | query positions | context | gather all scores (KB/rank/step) "
        "| merge top-k (KB/rank/step) | merge / gather |"
    )
    print("|---|---|---|---|---|---|")
    for world in args.worlds:
        for queries in args.queries:
            rows = run_ranks(_measure, world, args.k, queries)[0]
            for context, gather_bytes, merge_bytes in rows:
                print(
                    f"| {world} | {queries} | {context // 1024} K | {gather_bytes / 1e3:.1f} | "
                    f"{merge_bytes / 1e3:.1f} | {merge_bytes / gather_bytes:.2f} |"
                )


if __name__ == "__main__":
    main()
