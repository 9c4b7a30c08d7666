"""A prepare's critical path: the sum over its launches of the busiest program's memory operations
(``tools.critical_path``), at decode shapes, both policies, wave-aware and priced.

    python benchmarks/critical_path.py                      # 1 M slots, batch 64, 256, misses 5/13/30 %
    python benchmarks/critical_path.py --batch 64 --miss 13 --gpu-slots 65536   # a quicker look
    python benchmarks/critical_path.py --trace dsa --batch 16 64                # the DSA-shaped trace

**Locality trace** (the default). A GPU tier of ``--gpu-slots`` (1 M) slots, filled first with
entries no step selects, so every miss evicts; ``batch`` requests of ``4 x gpu_slots / batch``
tokens each. Each request selects ``[3, 2048]`` a step: three windows of one set of 2,560
positions (query ``q`` the 2,048 from ``256 q``: top-k sets that overlap as speculative query
positions do), and each step replaces ``--miss`` percent of each set with positions never selected
before (from the far history: no home yet, so a miss plans a slot and moves no row in), the rest
hits kept from the step before. Two steps warm the pool, the third is counted, as a plain prepare
and, from a copy of the pool, as one plan with the step's new tokens (a token a query position:
``prepare(..., new=NewRows(...))``, the call a decode layer makes). Each launch is counted in
dependent steps (its busiest program, and wave-aware: at least its programs' operations shared by
the programs the SMs hold of that kernel, ``grid.FOOTPRINTS``), and priced with
``tools.critical_path.Prices``: 0.6 us a memory operation (as a DRAM round trip: an upper bound),
0.5 us an atomic, 1.5 us a launch boundary inside a CUDA graph, on an H200's 132 SMs. The rows
over PCIe are apart (the misses' and victims' rows: the ``bytes`` columns).

**DSA trace** (``--trace dsa``, the tables in ``benchmarks/RESULTS.md`` before 2026-12-08).
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

from tools.critical_path import H200_SMS, Launch, Prices, count_memory_ops, critical_path
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
        in_waves=" + ".join(
            f"{launch.kernel} {launch.length(launch.slots(H200_SMS))}" for launch in launches
        ),
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


# -- the locality trace ------------------------------------------------------------------------------
SHIFT = 256  # query q's window starts SHIFT x q into its request's set
UNION = TOPK + (QUERIES - 1) * SHIFT  # distinct positions a request selects a step: 2,560
MISS_TARGETS = (5, 13, 30)  # percent of a step's distinct selections (the operating points)
PRICES = Prices()


class LocalityTrace:
    """Each request's set of ``UNION`` positions, of which each step replaces ``miss_rate`` with
    positions never selected before; ``step()`` gives the selection ``[batch, QUERIES, TOPK]``."""

    def __init__(self, batch: int, context: int, miss_rate: float, seed: int = 0) -> None:
        self._gen = torch.Generator().manual_seed(seed)
        # Each request's positions in the order the trace first picks them; the tail (never picked
        # in a run of a few steps) fills the GPU first.
        self.order = torch.stack([torch.randperm(context, generator=self._gen) for _ in range(batch)])
        self.sets = self.order[:, :UNION].clone()
        self.picked = UNION
        self.fresh = round(miss_rate * UNION)

    def step(self) -> torch.Tensor:
        batch = self.sets.shape[0]
        if self.fresh:
            for r in range(batch):
                out = torch.randperm(UNION, generator=self._gen)[: self.fresh]
                self.sets[r, out] = self.order[r, self.picked : self.picked + self.fresh]
            self.picked += self.fresh
        windows = [self.sets[:, q * SHIFT : q * SHIFT + TOPK] for q in range(QUERIES)]
        return torch.stack(windows, dim=1)  # [batch, QUERIES, TOPK]


def _counted(launches: list[Launch]) -> dict:
    """One call's launches: the busiest programs' sum, the wave-aware sum and the price (us)."""
    return dict(
        ops=critical_path(launches),
        ops_in_waves=critical_path(launches, sms=H200_SMS),
        us=PRICES.call_us(launches, H200_SMS),
        launches=len(launches),
        detail=" + ".join(
            f"{launch.kernel.removesuffix('_kernel')} {launch.busiest}"
            + (f" ({launch.waves(H200_SMS)} waves)" if launch.waves(H200_SMS) > 1 else "")
            for launch in launches
        ),
    )


def measure_locality(batch: int, policy, miss_percent: float, gpu_slots: int = 1 << 20) -> dict:
    """Build the pool, fill its GPU tier, warm it on the trace, count one step's prepare and one
    plan (prepare with the step's new tokens) from the same state."""
    context = 4 * gpu_slots // batch
    steps = WARMUP_STEPS + 1
    new_tokens = QUERIES  # a new token a query position (speculative decoding)
    tokens = context + new_tokens * (steps + 1)
    pool = Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=16),
            num_layers=1,
            layers_per_group=1,
            layout=Tiered(gpu_slots=gpu_slots, cpu_slots=batch * tokens - gpu_slots, policy=policy),
            validate=False,
        )
    )
    seqs = [pool.admit(context) for _ in range(batch)]  # (room left for the new tokens)
    base = torch.stack([torch.as_tensor(s.address_list, dtype=torch.int64) for s in seqs])
    trace = LocalityTrace(batch, context, miss_percent / 100)
    fill = torch.gather(base, 1, trace.order[:, -(gpu_slots // batch) :]).flatten()
    pool.prepare(0, fill.view(1, -1).to(torch.int32))

    def addresses(pos: torch.Tensor) -> torch.Tensor:
        return torch.gather(base, 1, pos.reshape(batch, -1)).view(pos.shape).to(torch.int32)

    for _ in range(WARMUP_STEPS):
        pool.prepare(0, addresses(trace.step()))
    selection = addresses(trace.step())
    new = torch.cat([pool.extend(s, new_tokens) for s in seqs])
    rows = torch.zeros((new.numel(), 16), dtype=torch.uint8)
    twin = copy.deepcopy(pool)
    before = pool.stats()
    tiling, apply_mod.TILING = apply_mod.TILING, apply_mod.GPU_TILING
    try:
        with count_memory_ops() as plain:
            pool.prepare(0, selection)
        after = pool.stats()
        with count_memory_ops() as one_plan:
            twin.prepare(0, selection, new=NewRows(0, new, rows))
    finally:
        apply_mod.TILING = tiling
    misses, hits = after["misses"] - before["misses"], after["hits"] - before["hits"]
    return dict(
        batch=batch,
        policy=str(policy),
        gpu_slots=gpu_slots,
        miss_target=miss_percent,
        miss_measured=100 * misses / max(1, misses + hits),
        misses=misses,
        evicted=after["victims"] - before["victims"],
        bytes_moved=(after["bytes_in"] - before["bytes_in"]) + (after["bytes_out"] - before["bytes_out"]),
        prepare=_counted(plain),
        one_plan=_counted(one_plan),
    )


def print_locality(batches: list[int], misses: list[float], gpu_slots: int) -> None:
    print(
        "| batch | policy | misses (target, measured) | evicted | prepare: launches (busiest ops) | ops"
        " | ops in waves | us | one plan: launches | ops | ops in waves | us |"
    )
    print("|---" * 12 + "|")
    for batch in batches:
        for miss in misses:
            for policy in (ExactLRU(), PBLRU(8)):
                t0 = time.perf_counter()
                row = measure_locality(batch, policy, miss, gpu_slots)
                p, o = row["prepare"], row["one_plan"]
                cells = [
                    str(batch),
                    row["policy"],
                    f"{miss:g} % / {row['miss_measured']:.1f} % ({row['misses']})",
                    str(row["evicted"]),
                    f"{p['launches']}: {p['detail']}",
                    str(p["ops"]),
                    str(p["ops_in_waves"]),
                    f"**{p['us']:.0f}**",
                    f"{o['launches']}: {o['detail']}",
                    str(o["ops"]),
                    str(o["ops_in_waves"]),
                    f"**{o['us']:.0f}**",
                ]
                print("| " + " | ".join(cells) + " |", flush=True)
                print(f"<!-- {time.perf_counter() - t0:.0f} s -->", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", choices=("locality", "dsa"), default="locality")
    parser.add_argument("--batch", type=int, nargs="+", default=None, help="default: 64 256 (dsa: 16 64)")
    parser.add_argument("--miss", type=float, nargs="+", default=list(MISS_TARGETS), help="percent")
    parser.add_argument("--gpu-slots", type=int, default=1 << 20)
    args = parser.parse_args()
    if args.trace == "locality":
        print_locality(args.batch or [64, 256], args.miss, args.gpu_slots)
        return
    args.batch = args.batch or [16, 64]
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
