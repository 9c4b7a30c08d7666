"""The host's time per pool call and launches per decode step, with the kernels themselves taken
out: what the Python around the launches costs, which a GPU cannot hide unless the step is captured.

    python benchmarks/host_cost.py              # 61 one-layer groups, batch 64 x top-2048

A non-validating pool reads nothing back, so its calls can run with every launch replaced by a
no-op that only counts it: the time left is ulakv's own (argument checks, views, the launch
arguments), not Triton's launcher (a few microseconds a launch more on a GPU) nor the kernels.
Per call kind, the median over ``--calls`` calls after a warm-up, in microseconds; then one
decode step of every group (a write and a prepare each), its launches and host milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from ulakv import PBLRU, EntrySpec, ExactLRU, Pool, PoolConfig, Tiered
from ulakv.engine import SparseKV
from ulakv.kernels._triton import INTERPRETED


@contextlib.contextmanager
def launches_skipped():
    """Every Triton launch in the block is counted and not run."""
    if INTERPRETED:
        from triton.runtime.interpreter import InterpretedFunction as launcher
    else:
        from triton.runtime.jit import JITFunction as launcher
    original, count = launcher.run, [0]

    def run(self, *args, **kwargs):
        count[0] += 1

    launcher.run = run
    try:
        yield count
    finally:
        launcher.run = original


def measure(groups: int, batch: int, topk: int, calls: int, policy) -> dict:
    pool = Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=16),  # the row width costs the host nothing
            num_layers=groups,
            layers_per_group=1,
            layout=Tiered(gpu_slots=batch * topk, cpu_slots=batch * topk, policy=policy),
            validate=False,
        )
    )
    kv = SparseKV(pool, max_batch=batch, top_k=topk)
    seq = pool.admit(batch * topk)
    selection = seq.addresses.view(batch, topk)
    new, rows = seq.addresses[:batch], torch.zeros((batch, 16), dtype=torch.uint8)
    out = {"groups": groups, "batch": batch, "topk": topk, "policy": str(policy)}
    with launches_skipped() as launched:
        for name, call in (
            ("write", lambda g: kv.write(g, new, rows)),
            ("prepare", lambda g: kv.prepare(g, selection)),
        ):
            call(0)
            before, times = launched[0], []
            for i in range(calls):
                t = time.perf_counter()
                call(i % groups)
                times.append((time.perf_counter() - t) * 1e6)
            out[f"{name}_us"] = round(statistics.median(times), 1)
            out[f"{name}_launches"] = (launched[0] - before) / calls
        before, t = launched[0], time.perf_counter()
        for g in range(groups):
            kv.write(g, new, rows)
            kv.prepare(g, selection)
        kv.join()
        out["step_host_ms"] = round((time.perf_counter() - t) * 1e3, 2)
        out["step_launches"] = launched[0] - before
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=61)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    keys = [
        "policy",
        "write_us",
        "write_launches",
        "prepare_us",
        "prepare_launches",
        "step_launches",
        "step_host_ms",
    ]
    print("| " + " | ".join(keys) + " |")
    print("|---" * len(keys) + "|")
    for policy in (ExactLRU(), PBLRU(8)):
        row = measure(args.groups, args.batch, args.topk, args.calls, policy)
        print("| " + " | ".join(str(row[k]) for k in keys) + " |", flush=True)


if __name__ == "__main__":
    main()
