"""Striped pools: buffer hit rate and bytes fetched from other ranks per group-step.

    python benchmarks/striped_traffic.py [--worlds 2 4] [--buffers 1.0 1.5 2 4]

A synthetic DSA-shaped trace (``ulakv.traces.synthetic``) replayed by ``ulakv.replay.replay`` on
gloo processes (CPU) through a real striped pool per rank: every decode step appends a token to
each request, writes it, and prepares each layer group's selection. The buffer is sized as a
multiple of the largest per-step working set; fetched bytes are what the all-gather moved into this
rank (656-byte rows, one layer a group), the same on any transport. Belady is the replay's ceiling,
which caches written tokens for free.
"""

from __future__ import annotations

import argparse

from ulakv import ExactLRU, Striped, Tiered
from ulakv.replay import replay
from ulakv.spawn import run_ranks
from ulakv.traces import SyntheticSpec, synthetic

SPEC = SyntheticSpec(
    requests=6, prompt=(300, 500), steps=16, topk=48, queries=3, groups=2, window=12, heavy=16, seed=4
)
ROW = 656


def _replay(rank: int, world: int, scale: float) -> dict:
    trace = synthetic(SPEC)
    working = trace.working_set()
    share = -(-sum(r.prompt_len + r.steps for r in trace.requests) // world)
    buffer = int(scale * working)
    layout = Striped(
        world=world,
        rank=rank,
        buffer_slots=buffer,
        policy=ExactLRU(),
        inner=Tiered(gpu_slots=max(share, working), cpu_slots=0),
    )
    result = replay(trace, ExactLRU(), buffer, bytes_per_layer=ROW, layout=layout)
    stats = result.pool_stats
    return {
        "working": working,
        "buffer": buffer,
        "hit_rate": result.hit_rate,
        "belady": result.belady_hit_rate,
        "kb_per_group_step": stats["bytes_communicated"] / result.prepares / 1e3,
        "collectives_per_group_step": stats["collectives"] / result.prepares,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--buffers", type=float, nargs="+", default=[1.0, 1.5, 2.0, 4.0])
    args = parser.parse_args()
    print(
        "| ranks | buffer slots (x working set) | buffer hit rate | Belady "
        "| KB fetched / rank / group-step | collectives / group-step |"
    )
    print("|---|---|---|---|---|---|")
    for world in args.worlds:
        for scale in args.buffers:
            r = run_ranks(_replay, world, scale)[0]
            print(
                f"| {world} | {r['buffer']} ({scale:g}x of {r['working']}) | {r['hit_rate']:.2%} | "
                f"{r['belady']:.2%} | {r['kb_per_group_step']:.1f} | {r['collectives_per_group_step']:.2f} |"
            )


if __name__ == "__main__":
    main()
