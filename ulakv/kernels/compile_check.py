"""Compile every kernel the pool launches for a CUDA target, on a machine without a GPU.

The Triton interpreter forgives what the GPU compiler does not (mixed integer widths across a
branch, a loop-carried value that changes type, an unsupported op). This tool drives a real pool
through admit, write, prepare, read and release with every launch intercepted: instead of running,
each distinct specialisation is compiled to a cubin for ``sm_<arch>`` with Triton's own toolchain.

    python -m ulakv.kernels.compile_check [--arch 90]

A launch is intercepted inside Triton's own ``JITFunction.run`` (``intercept_launches``): Triton binds
the arguments and computes the specialisation key exactly as on a GPU (divisibility by 16 and
equality to 1 of integers, 16-byte alignment of pointers, minus what ``do_not_specialize`` and
``do_not_specialize_on_alignment`` exclude); its ``jit_cache_hook`` hands over what it would compile
and stops it. So the variants compiled here are the ones a GPU would compile, no more, no fewer.

Triton reads TRITON_INTERPRET once, at import; when it is on, ``main`` re-runs itself with it off.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

# What a launch hands to ``intercept_launches``' callback: the JITFunction, Triton's cache key of
# the specialisation (one compiled binary per distinct key), and what Triton would compile.
OnLaunch = Callable[[Any, str, dict], None]


class _NoDevice:
    """Triton's active driver, as far as ``JITFunction.run`` asks before it compiles: a CUDA
    target, device 0, stream 0. Nothing here touches a device."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


@contextlib.contextmanager
def intercept_launches(arch: int, on_launch: OnLaunch) -> Iterator[None]:
    """Inside the block, every Triton launch goes through Triton's own ``JITFunction.run`` for a
    CUDA ``sm_<arch>`` target up to the point where it would compile; there ``on_launch(fn, key,
    compile)`` gets the specialisation and nothing is compiled or launched. Needs TRITON_INTERPRET=0
    at triton's first import; no GPU. Kernels never launched for real in this process are assumed
    (their binders, cached per device, are built against the stand-in target)."""
    from ._triton import INTERPRETED

    if INTERPRETED:
        raise RuntimeError("intercepting launches needs TRITON_INTERPRET=0 when triton is first imported")
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    def hook(*, key, fn, compile, **_) -> bool:
        on_launch(fn.jit_function, key, compile)
        return True  # Triton's contract: a true result skips the compilation, and run launches nothing

    previous_driver, previous_hook = driver._active, knobs.runtime.jit_cache_hook
    driver.set_active(_NoDevice(GPUTarget("cuda", arch, 32)))
    knobs.runtime.jit_cache_hook = hook
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = previous_hook
        driver._active = previous_driver


def drive_pool() -> None:
    """Every launch the pool makes, in each configuration the tool covers: two row widths (words
    and bytes), both policies, a striped rank's buffer, PB-LRU's standalone search, an engine-owned
    pool's admission and release, and ``compact_slots``."""
    import torch

    from ulakv import PBLRU, EntrySpec, ExactLRU, Pool, PoolConfig, Tiered, compact_slots
    from ulakv.kernels.buckets import bucket_bits, search
    from ulakv.kernels.operands import readable_rows
    from ulakv.layouts.tiered_state import BufferState, TieredLayout

    for width, policy in ((656, ExactLRU()), (5, ExactLRU()), (656, PBLRU(4))):  # words, bytes
        cfg = PoolConfig(
            entry=EntrySpec(bytes_per_layer=width),
            num_layers=2,
            layers_per_group=2,
            layout=Tiered(gpu_slots=40, cpu_slots=8, policy=policy),
            validate=False,
        )
        pool = Pool(cfg)
        seq = pool.admit(4)
        rows = torch.zeros((4, width), dtype=torch.uint8)
        pool.write(0, seq.addresses, rows)
        pool.prepare(0, seq.addresses.reshape(1, 4).to(torch.int32))
        pool.prepare(0, seq.addresses.reshape(1, 1, 4))
        pool._layout.read(1, seq.addresses)
        pool.release(seq)
        # A striped rank's buffer: the same kernels specialised to drop victims and take fetched rows.
        buffer_cfg = cfg.replace(layout=Tiered(gpu_slots=40, cpu_slots=0, policy=policy))
        state = BufferState.allocate(buffer_cfg, addresses=64)
        state.mapping[:, :4] = -2
        layout = TieredLayout(buffer_cfg, state)
        flat = torch.arange(4, dtype=torch.int64)
        plan, _ = layout.plan(0, flat)
        layout.execute(plan, fetched=readable_rows(torch.zeros((4, 2, width), dtype=torch.uint8)))
    search(bucket_bits(torch.ones(40, dtype=torch.bool)), 40, 4)
    # Engine-owned addresses (both check variants, and release's checked one), then FlashInfer's layout.
    engine = Pool(cfg.replace(engine_addresses=64, page_size=64))
    locs = torch.tensor([9, 3, -1, 17])
    engine.admit_addresses(locs)
    engine.write(0, locs, torch.zeros((4, 656), dtype=torch.uint8))
    slots = engine.prepare(0, locs.view(1, 4)).slots
    engine.release_addresses(locs)
    compact_slots(slots)


def compile_all(arch: int = 90) -> dict[str, int]:
    """Drive a small pool and compile each kernel specialisation it launches; returns the number
    of variants compiled per kernel name."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    compiled: dict[str, set[str]] = {}

    def compile_instead_of_launch(fn: Any, key: str, what: dict) -> None:
        keys = compiled.setdefault(fn.fn.__name__, set())
        if key not in keys:
            attrs = what["configs"][0]
            triton.compile(ASTSource(fn, what["signature"], what["constants"], attrs), target=target)
            keys.add(key)

    with intercept_launches(arch, compile_instead_of_launch):
        drive_pool()
    return {name: len(keys) for name, keys in sorted(compiled.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="SM version, e.g. 90 for H100/H200")
    args = parser.parse_args()
    from ._triton import INTERPRETED

    if INTERPRETED:
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]], env)
    variants = compile_all(args.arch)
    print(f"compiled for sm_{args.arch}: {', '.join(variants)}")
    print(f"variants: {sum(variants.values())} ({', '.join(f'{k} {n}' for k, n in variants.items())})")


if __name__ == "__main__":
    main()
