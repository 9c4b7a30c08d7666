"""Run a function on ``world`` gloo processes (CPU): tests and benchmarks of collective code.

``run_ranks(fn, world, *args)`` starts the processes, initialises ``torch.distributed`` with gloo
through a file store, calls ``fn(rank, world, *args)`` on each and returns their results in rank
order; an exception on any rank fails the call with that rank's traceback. With the kernels
interpreted, ranks are forked from one server process per calling process (``_start_method``); each
rank takes the caller's environment of the moment (what modules read at import is the server's).
"""

from __future__ import annotations

import os
import tempfile
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, store: str, fn, args: tuple, results, env: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's when it started
    os.environ.update(env)
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


# What every rank imports before it runs anything: loaded once, in the fork server (see run_ranks).
PRELOAD = (
    "torch",
    "torch.distributed",
    "numpy",
    "triton",
    "ulakv.pool",
    "ulakv.engine",
    "ulakv.layouts.striped",
)


def _start_method() -> str:
    """``forkserver`` when the kernels are interpreted (the CPU runs of tests and benchmarks): one
    server process imports ``PRELOAD`` once and forks every rank from itself, single-threaded, so a
    rank starts in milliseconds instead of importing torch and Triton afresh (1.5 s of CPU a rank, about
    3 minutes of CPU over the suite's launches). Otherwise ``spawn``: a fresh interpreter that reads
    the environment, as before."""
    return "forkserver" if os.environ.get("TRITON_INTERPRET") == "1" else "spawn"


def run_ranks(fn, world: int, *args) -> list:
    method = _start_method()
    context = mp.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(list(PRELOAD))  # read when the server starts, once a process
    with tempfile.TemporaryDirectory() as tmp:
        manager = context.Manager()
        results = manager.dict()
        mp.start_processes(
            _worker,
            args=(world, os.path.join(tmp, "store"), fn, args, results, dict(os.environ)),
            nprocs=world,
            join=True,
            start_method=method,
        )
        out = [results[r] for r in range(world)]
        manager.shutdown()
    errors = [f"rank {r}:\n{text}" for r, (kind, text) in enumerate(out) if kind == "error"]
    assert not errors, "\n".join(errors)
    return [value for _, value in out]
