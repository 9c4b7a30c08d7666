"""Striped pools: buffer hit rate and bytes fetched from other ranks per group-step.

    python benchmarks/striped_traffic.py [--worlds 2 4] [--buffers 1.0 1.5 2 4]

A synthetic DSA-shaped trace (``ulakv.traces.synthetic``) replayed on gloo processes (CPU) through a
real striped pool per rank: every decode step appends a token to each request, writes it, and
prepares each layer group's selection. The buffer is sized as a multiple of the largest per-step
working set; fetched bytes are what the all-gather moved into this rank (656-byte rows, one layer a
group), the same on any transport.
"""

from __future__ import annotations

import argparse

import torch

from ulakv import EntrySpec, ExactLRU, Pool, PoolConfig, Striped, Tiered
from ulakv.spawn import run_ranks
from ulakv.traces import SyntheticSpec, synthetic

SPEC = SyntheticSpec(
    requests=6, prompt=(300, 500), steps=16, topk=48, queries=3, groups=2, window=12, heavy=16, seed=4
)
ROW = 656


def _replay(rank: int, world: int, scale: float) -> dict:
    trace = synthetic(SPEC)
    working = trace.working_set()
    history = sum(r.prompt_len + r.steps for r in trace.requests)
    share = -(-history // world)
    pool = Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=ROW),
            num_layers=trace.groups,
            layers_per_group=1,
            layout=Striped(
                world=world,
                rank=rank,
                buffer_slots=int(scale * working),
                policy=ExactLRU(),
                inner=Tiered(gpu_slots=max(share, working), cpu_slots=0),
            ),
        )
    )
    seqs = {}
    group_steps = 0
    for step in range(trace.horizon):
        active = []
        for i, r in enumerate(trace.requests):
            s = step - r.arrival
            if s == 0:
                seqs[i] = pool.admit(r.prompt_len)
                for layer in range(trace.groups):
                    pool.write(layer, seqs[i].addresses, torch.zeros((r.prompt_len, ROW), dtype=torch.uint8))
            if 0 <= s < r.steps:
                active.append((i, s))
        if not active:
            continue
        new = torch.cat([pool.extend(seqs[i], 1) for i, _ in active])
        for layer in range(trace.groups):
            pool.write(layer, new, torch.zeros((new.numel(), ROW), dtype=torch.uint8))
        for g in range(trace.groups):
            rows = []
            for i, s in active:
                pos = trace.requests[i].topk[s, g].long()
                rows.append(torch.where(pos >= 0, seqs[i].addresses[pos.clamp(min=0)], -1))
            pool.prepare(g, torch.stack(rows))
            group_steps += 1
        for i, s in active:
            if s == trace.requests[i].steps - 1:
                pool.release(seqs.pop(i))
    stats = pool.stats()
    return {
        "working": working,
        "buffer": int(scale * working),
        "hit_rate": stats["hits"] / max(1, stats["hits"] + stats["misses"]),
        "kb_per_group_step": stats["bytes_communicated"] / group_steps / 1e3,
        "collectives_per_group_step": stats["collectives"] / group_steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--buffers", type=float, nargs="+", default=[1.0, 1.5, 2.0, 4.0])
    args = parser.parse_args()
    print(
        "| ranks | buffer slots (x working set) | buffer hit rate "
        "| KB fetched / rank / group-step | collectives / group-step |"
    )
    print("|---|---|---|---|---|")
    for world in args.worlds:
        for scale in args.buffers:
            r = run_ranks(_replay, world, scale)[0]
            print(
                f"| {world} | {r['buffer']} ({scale:g}x of {r['working']}) | {r['hit_rate']:.2%} | "
                f"{r['kb_per_group_step']:.1f} | {r['collectives_per_group_step']:.2f} |"
            )


if __name__ == "__main__":
    main()
