"""A prepare's critical path: the sum over its launches of the busiest program's memory operations
(``tools.critical_path``), at decode shapes, both policies.

    python benchmarks/critical_path.py                 # batch 16 and 64 x 3 queries x top-2048
    python benchmarks/critical_path.py --batch 4 16    # other batches

Each request has an 8K-token context (admitted, so every position is live). The selections are a
synthetic DSA-shaped trace (``ulakv.traces.synthetic``: sinks, a local window, drifting heavy
hitters, far picks partly reused, three speculative query positions). The GPU tier holds twice one
step's working set, the CPU tier the rest. A first prepare fills every GPU slot, two steps of the
trace follow, and the third is counted: its misses evict. Then a decode step's write is counted:
one new token a request, written while the GPU is full (each evicts an entry not used this round,
and takes a copy in a plain free CPU row where one lies below its pops). Last, on a copy of the
pool as it was before that step, the same step as one plan (``prepare(..., new=NewRows(...))``:
the new tokens' rows with the selection), beside the two plans' sum. The apply kernel is counted
with its GPU tiling (``apply.GPU_TILING``). Runs under the Triton interpreter.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tools/

import torch

from tools.critical_path import H200_SMS, count_memory_ops, critical_path
from ulakv import PBLRU, EntrySpec, ExactLRU, NewRows, Pool, PoolConfig, Tiered
from ulakv.kernels import apply as apply_mod
from ulakv.traces import SyntheticSpec, synthetic

CONTEXT = 8192
TOPK = 2048
QUERIES = 3
WARMUP_STEPS = 2


def selections(batch: int, seed: int = 0) -> tuple[torch.Tensor, int]:
    """Positions ``[steps, batch, queries, topk]`` and one step's working set (most distinct
    positions over the batch in any step)."""
    spec = SyntheticSpec(
        requests=batch,
        prompt=(CONTEXT - WARMUP_STEPS - 1, CONTEXT - WARMUP_STEPS - 1),
        steps=WARMUP_STEPS + 1,
        topk=TOPK,
        queries=QUERIES,
        groups=1,
        arrival_spread=0,
        seed=seed,
    )
    topk = torch.stack([r.topk[:, 0] for r in synthetic(spec).requests], dim=1)
    working = max(
        sum(int(torch.unique(topk[s, b][topk[s, b] >= 0]).numel()) for b in range(batch))
        for s in range(topk.shape[0])
    )
    return topk, working


def measure(batch: int, policy) -> dict:
    """Build the pool, warm it, count one prepare. Returns the row of the table."""
    topk, working = selections(batch)
    gpu = 2 * working
    cpu = batch * (CONTEXT + 1) - gpu + 1  # room for the step's new tokens
    pool = Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=16),
            num_layers=1,
            layers_per_group=1,
            layout=Tiered(gpu_slots=gpu, cpu_slots=cpu, policy=policy),
            validate=False,
        )
    )
    seqs = [pool.admit(CONTEXT) for _ in range(batch)]
    base = torch.stack([torch.as_tensor(s.addresses, dtype=torch.int64) for s in seqs])  # [batch, CONTEXT]

    def addresses(step: int) -> torch.Tensor:
        pos = topk[step].long()  # [batch, queries, k]
        addrs = torch.gather(base[:, None, :].expand(-1, QUERIES, -1), 2, pos.clamp(min=0))
        return torch.where(pos >= 0, addrs, -1).to(torch.int32)

    # Fill every GPU slot first (positions from the far end of the contexts, read once), so the
    # steps that follow evict: the planning work that grows with the misses is what is measured.
    pool.prepare(0, base.flip(1).flatten()[:gpu].view(1, -1).to(torch.int32))
    for step in range(WARMUP_STEPS):
        pool.prepare(0, addresses(step))
    before = pool.stats()
    new = torch.cat([pool.extend(s) for s in seqs])  # the step's new tokens: one a request
    rows = torch.zeros((new.numel(), 16), dtype=torch.uint8)
    twin = copy.deepcopy(pool)  # the same step as one plan, from the same state
    tiling, apply_mod.TILING = apply_mod.TILING, apply_mod.GPU_TILING
    try:
        with count_memory_ops() as launches:
            pool.prepare(0, addresses(WARMUP_STEPS))
        after = pool.stats()
        with count_memory_ops() as written:  # then their rows: the GPU is full, each evicts
            pool.write(0, new, rows)
        with count_memory_ops() as fused:
            twin.prepare(0, addresses(WARMUP_STEPS), new=NewRows(0, new, rows))
    finally:
        apply_mod.TILING = tiling
    misses = after["misses"] - before["misses"]
    hits = after["hits"] - before["hits"]
    return dict(
        batch=batch,
        policy=str(policy),
        gpu_slots=gpu,
        misses=misses,
        hits=hits,
        evicted=after["victims"] - before["victims"],
        launches=" + ".join(f"{launch.kernel} {launch.busiest}" for launch in launches),
        programs=max(launch.programs for launch in launches),
        # Every program's operations: what the SMs share once a launch has more programs than fit
        # at once (apply's grid is sized by the call, so its programs without misses count here).
        all_programs=sum(launch.total for launch in launches),
        critical_path=critical_path(launches),
        # A launch of more programs than the GPU holds at once runs in waves: its length is at
        # least its programs' operations shared by the slots (``Launch.length``).
        in_waves=" + ".join(f"{launch.kernel} {launch.length(launch.slots(H200_SMS))}" for launch in launches),
        critical_path_in_waves=critical_path(launches, sms=H200_SMS),
        write=" + ".join(f"{launch.kernel} {launch.busiest}" for launch in written),
        write_critical_path=critical_path(written),
        write_in_waves=critical_path(written, sms=H200_SMS),
        apart=critical_path(launches) + critical_path(written),
        apart_launches=len(launches) + len(written),
        one_plan=" + ".join(f"{launch.kernel} {launch.busiest}" for launch in fused),
        one_plan_critical_path=critical_path(fused),
        one_plan_launches=len(fused),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args()
    columns = [
        "batch",
        "policy",
        "gpu_slots",
        "misses",
        "evicted",
        "hits",
        "launches",
        "programs",
        "all_programs",
        "in_waves",
    ]
    extra = [
        "critical_path",
        "critical_path_in_waves",
        "write",
        "write_critical_path",
        "apart (launches)",
        "one_plan",
        "one_plan_critical_path (launches)",
    ]
    print("| " + " | ".join([*columns, *extra]) + " |")
    print("|---" * (len(columns) + len(extra)) + "|")
    for batch in args.batch:
        for policy in (ExactLRU(), PBLRU(8)):
            t0 = time.perf_counter()
            row = measure(batch, policy)
            cells = [str(row[c]) for c in columns] + [
                f"**{row['critical_path']}**",
                f"**{row['critical_path_in_waves']}**",
                row["write"],
                f"**{row['write_critical_path']}**",
                f"{row['apart']} ({row['apart_launches']})",
                row["one_plan"],
                f"**{row['one_plan_critical_path']}** ({row['one_plan_launches']})",
            ]
            print("| " + " | ".join(cells) + " |", flush=True)
            print(f"<!-- {time.perf_counter() - t0:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
