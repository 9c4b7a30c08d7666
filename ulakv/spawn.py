"""Run a function on ``world`` gloo processes (CPU): tests and benchmarks of collective code.

``run_ranks(fn, world, *args)`` spawns the processes, initialises ``torch.distributed`` with gloo
through a file store, calls ``fn(rank, world, *args)`` on each and returns their results in rank
order; an exception on any rank fails the call with that rank's traceback.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, store: str, fn, args: tuple, results) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        results[rank] = ("ok", fn(rank, world, *args))
    except BaseException:  # report, do not hang the others
        results[rank] = ("error", traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        manager = mp.Manager()
        results = manager.dict()
        mp.spawn(
            _worker, args=(world, os.path.join(tmp, "store"), fn, args, results), nprocs=world, join=True
        )
        out = [results[r] for r in range(world)]
        manager.shutdown()
    errors = [f"rank {r}:\n{text}" for r, (kind, text) in enumerate(out) if kind == "error"]
    assert not errors, "\n".join(errors)
    return [value for _, value in out]
