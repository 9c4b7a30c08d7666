"""A decode loop's critical path, step by step: what a serving loop waits for, housekeeping included.

    python benchmarks/decode_loop.py            # both policies, three shapes, 40 steps after 8 warm-up
    python benchmarks/decode_loop.py --steps 60

Each step writes one new token a request (``extend`` + ``write``) and prepares the step's
``[B, 3, K]`` selection (a synthetic DSA-shaped trace: sinks, a local window, drifting heavy hitters,
far picks partly kept from the step before). The GPU tier is filled with cold entries first, so
every step's misses evict. Each step's critical path is counted under the Triton interpreter
(``tools.critical_path``: per launch the busiest program's memory operations, summed over
the write's and the prepare's launches), with ``apply`` at its GPU tiling. Unlike the warmed single
prepare of ``benchmarks/critical_path.py``, every step counts, so work the planning program does
every few calls (exact LRU's ring compaction, PB-LRU's round end) shows in the mean and the worst
step.

Three shapes: a base batch and pool, the batch 4x with the pool scaled alike, and the pool 8x at
the base batch. The table gives each run's mean, median and worst step, the worst over the median,
and the growth of the mean between shapes: what a GPU's decode step would grow by when one program
does work that grows with the batch or the pool. Runs under the interpreter (minutes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tools/

import torch

from tools.critical_path import count_memory_ops, critical_path
from ulakv import PBLRU, EntrySpec, ExactLRU, Pool, PoolConfig, Tiered
from ulakv.kernels import apply as apply_mod
from ulakv.traces import SyntheticSpec, synthetic

TOPK = 64
QUERIES = 3
WARMUP = 8
ROW_BYTES = 16  # the row width does not change a program's memory operations


def run(batch: int, gpu_slots: int, context: int, policy, steps: int, seed: int = 0) -> list[int]:
    """The critical path of every step after the warm-up (write + prepare); ``context`` tokens of
    history a request when decoding starts."""
    spec = SyntheticSpec(
        requests=batch,
        prompt=(context, context),
        steps=WARMUP + steps,
        topk=TOPK,
        queries=QUERIES,
        groups=1,
        window=16,
        heavy=16,
        arrival_spread=0,
        seed=seed,
    )
    trace = synthetic(spec)
    total = batch * (context + WARMUP + steps)
    pool = Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=ROW_BYTES),
            num_layers=1,
            layers_per_group=1,
            layout=Tiered(gpu_slots=gpu_slots, cpu_slots=total + gpu_slots, policy=policy),
            validate=False,
        )
    )
    seqs = [pool.admit(context) for _ in range(batch)]
    history = [torch.as_tensor(s.addresses, dtype=torch.int64) for s in seqs]
    # Entries of the contexts' older halves fill the GPU tier first (the windows never pick them
    # again, far picks seldom): every step's misses evict.
    cold = torch.cat([h[: context // 2] for h in history])[:gpu_slots]
    pool.prepare(0, cold.view(1, -1).to(torch.int32))
    per_step = []
    saved, apply_mod.TILING = apply_mod.TILING, apply_mod.GPU_TILING
    try:
        for step in range(WARMUP + steps):
            new = torch.cat([torch.as_tensor(pool.extend(s, 1), dtype=torch.int64) for s in seqs])
            history = [torch.cat([h, new[b : b + 1]]) for b, h in enumerate(history)]
            rows = torch.full((batch, ROW_BYTES), step % 251, dtype=torch.uint8)
            picks = torch.stack(
                [
                    torch.where(pos >= 0, history[b][pos.clamp(min=0)], -1)
                    for b, pos in enumerate(r.topk[step, 0].long() for r in trace.requests)
                ]
            ).to(torch.int32)  # [batch, queries, k]
            with count_memory_ops() as launches:
                pool.write(0, new, rows)
                pool.prepare(0, picks)
            if step >= WARMUP:
                per_step.append(critical_path(launches))
    finally:
        apply_mod.TILING = saved
    return per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="counted steps after the warm-up")
    parser.add_argument("--batch", type=int, default=4, help="the base batch")
    parser.add_argument("--gpu-slots", type=int, default=1024, help="the base pool's GPU slots")
    args = parser.parse_args()
    B, G = args.batch, args.gpu_slots
    # Tokens of history a request: the older halves of the base batch's contexts fill the largest
    # pool (8 G slots), and the trace picks from the whole context.
    context = max(4096, 16 * G // B)
    shapes = [("base", B, G), ("batch x4", 4 * B, 4 * G), ("pool x8", B, 8 * G)]
    print("| policy | shape | batch | gpu_slots | mean | median | worst | worst / median |")
    print("|---|---|---|---|---|---|---|---|")
    means: dict[tuple[str, str], float] = {}
    for policy in (ExactLRU(), PBLRU(8)):
        for name, batch, gpu in shapes:
            t0 = time.perf_counter()
            path = run(batch, gpu, context, policy, args.steps)
            mean, median, worst = statistics.mean(path), statistics.median(path), max(path)
            means[str(policy), name] = mean
            print(
                f"| {policy} | {name} | {batch} | {gpu} | {mean:.1f} | {median:.0f} | {worst} | "
                f"{worst / median:.2f} |",
                flush=True,
            )
            print(f"<!-- {time.perf_counter() - t0:.0f} s -->", flush=True)
    for policy in (ExactLRU(), PBLRU(8)):
        base = means[str(policy), "base"]
        print(
            f"{policy}: mean step x{means[str(policy), 'batch x4'] / base:.2f} for the batch x4 "
            f"(pool alike), x{means[str(policy), 'pool x8'] / base:.2f} for the pool x8"
        )


if __name__ == "__main__":
    main()
