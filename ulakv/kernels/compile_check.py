"""Compile every kernel the pool launches for a CUDA target, on a machine without a GPU.

The Triton interpreter forgives what the GPU compiler does not (mixed integer widths across a
branch, a loop-carried value that changes type, an unsupported op). This tool drives a real pool
through admit, write, prepare, read and release with every launch intercepted: instead of running,
each distinct specialisation is compiled to a cubin for ``sm_<arch>`` with Triton's own toolchain.

    python -m ulakv.kernels.compile_check [--arch 90]

Triton reads TRITON_INTERPRET once, at import; when it is on, ``main`` re-runs itself with it off.
"""

from __future__ import annotations

import argparse
import os
import sys


def compile_all(arch: int = 90) -> list[str]:
    """Drive a small pool and compile each kernel specialisation; returns their names."""
    from ._triton import INTERPRETED

    if INTERPRETED:
        raise RuntimeError("compile_check needs TRITON_INTERPRET=0 when triton is first imported")
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction, mangle_type

    from ulakv import PBLRU, EntrySpec, ExactLRU, Pool, PoolConfig, Tiered
    from ulakv.kernels.buckets import bucket_bits, search
    from ulakv.kernels.operands import readable_rows
    from ulakv.layouts.tiered_state import BufferState, TieredLayout

    target = GPUTarget("cuda", arch, 32)
    compiled: dict[tuple, str] = {}

    def compile_instead_of_launch(self, *args, grid, warmup, **kwargs):
        bound = dict(zip([p.name for p in self.params], args, strict=False))
        bound.update(kwargs)
        signature, constexprs = {}, {}
        for p in self.params:
            value = bound[p.name]
            if p.is_constexpr:
                signature[p.name] = "constexpr"
                constexprs[p.name] = value
            else:
                signature[p.name] = mangle_type(value)
        key = (self.fn.__name__, tuple(signature.items()), tuple(constexprs.items()))
        if key not in compiled:
            triton.compile(ASTSource(self, signature, constexprs), target=target)
            compiled[key] = self.fn.__name__

    JITFunction.run = compile_instead_of_launch
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
    return sorted(set(compiled.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="SM version, e.g. 90 for H100/H200")
    args = parser.parse_args()
    from ._triton import INTERPRETED

    if INTERPRETED:
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]], env)
    names = compile_all(args.arch)
    print(f"compiled for sm_{args.arch}: {', '.join(names)}")


if __name__ == "__main__":
    main()
