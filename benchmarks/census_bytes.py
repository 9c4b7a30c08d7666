"""Bytes a fetch-mode striped ``prepare`` allocates per selected element (issue 32, item 6).

    python benchmarks/census_bytes.py [--batch 64] [--queries 3] [--k 256] [--world 2]

Every rank of a gloo world (``ulakv.spawn.run_ranks``; kernels under the Triton interpreter when no
GPU is present) builds a fetch-mode ``Striped`` pool, admits and writes 8,192 tokens, and prepares a
``[batch, queries, k]`` int32 selection of them twice: the first call grows the call scratch (once
per size, as a serving loop's first step does), the second is measured. A ``TorchDispatchMode``
counts every tensor an operation creates: the bytes of each output that aliases no input (a view,
an in-place op, an ``out=`` and a collective's output buffer create nothing). Triton launches
allocate nothing through torch on a GPU; under the interpreter they run on the host, so launches
are not counted.

Prints each rank's bytes and bytes per selected element, and the worst rank's ops by bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections import Counter
from collections.abc import Iterator

if __name__ == "__main__":
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from torch.utils._python_dispatch import TorchDispatchMode

TOKENS = 8192  # admitted and written; a selection draws from them (duplicates across queries)
WIDTH = 16  # bytes a row: the rows' size does not change what the census and exchange allocate


class AllocationCounter(TorchDispatchMode):
    """Counts the bytes of every tensor an op creates (its outputs that alias no input), by op."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        returns = func._schema.returns
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        for ret, value in zip(returns, outputs, strict=False):
            if ret.alias_info is not None:  # a view, an in-place op, an out=: nothing new
                continue
            for t in value if isinstance(value, (tuple, list)) else (value,):
                # (a collective returns the output it was given, without an alias annotation)
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                    self.by_op[str(func.overloadpacket.__name__)] += t.untyped_storage().nbytes()
        return out

    @property
    def total(self) -> int:
        return sum(self.by_op.values())


@contextlib.contextmanager
def launches_uncounted(counter: AllocationCounter) -> Iterator[None]:
    """Inside ``counter``: a Triton launch's own host work (the interpreter's) is not counted."""
    from ulakv.kernels._triton import INTERPRETED

    if not INTERPRETED:
        yield
        return
    from torch.utils._python_dispatch import _disable_current_modes
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self, *args, **kwargs):
        with _disable_current_modes():
            return original(self, *args, **kwargs)

    InterpretedFunction.run = run
    try:
        yield
    finally:
        InterpretedFunction.run = original


def measure_rank(rank: int, world: int, batch: int, queries: int, k: int) -> dict:
    """One rank: a warmed fetch-mode prepare of a ``[batch, queries, k]`` selection, counted."""
    from ulakv import EntrySpec, ExactLRU, Pool, PoolConfig, Striped, Tiered

    per_rank = TOKENS // world
    layout = Striped(
        world=world,
        rank=rank,
        buffer_slots=TOKENS,
        policy=ExactLRU(),
        inner=Tiered(gpu_slots=per_rank),
    )
    pool = Pool(
        PoolConfig(entry=EntrySpec(bytes_per_layer=WIDTH), num_layers=1, layout=layout, validate=False)
    )
    seq = pool.admit(TOKENS)
    pool.write(0, seq.addresses, torch.zeros((TOKENS, WIDTH), dtype=torch.uint8))
    gen = torch.Generator().manual_seed(5)  # the same selection on every rank
    picks = torch.randint(0, TOKENS, (batch, queries, k), generator=gen)
    topk = seq.addresses[picks].to(torch.int32)
    topk[:, :, -1] = -1  # some padding
    pool.prepare(0, topk)  # grows the call scratch for this size
    counter = AllocationCounter()
    with counter, launches_uncounted(counter):
        slots = pool.prepare(0, topk).slots
    pool.check()
    assert bool((slots.flatten()[topk.flatten() >= 0] >= 0).all())
    return {"bytes": counter.total, "elements": topk.numel(), "by_op": dict(counter.by_op.most_common(12))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--queries", type=int, default=3)
    parser.add_argument("--k", type=int, default=256)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    from ulakv.spawn import run_ranks

    results = run_ranks(measure_rank, args.world, args.batch, args.queries, args.k)
    for rank, r in enumerate(results):
        print(
            f"rank {rank}: {r['bytes']:,} B allocated over {r['elements']:,} selected elements: "
            f"{r['bytes'] / r['elements']:.2f} B per element"
        )
    worst = max(results, key=lambda r: r["bytes"])
    print("worst rank's ops by bytes:", ", ".join(f"{op} {b:,}" for op, b in worst["by_op"].items()))


if __name__ == "__main__":
    main()
