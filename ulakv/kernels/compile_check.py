"""Compile every kernel the pool launches for a CUDA target, on a machine without a GPU.

The Triton interpreter forgives what the GPU compiler does not (mixed integer widths across a
branch, a loop-carried value that changes type, an unsupported op). This tool drives a real pool
through admit, write, prepare, read and release with every launch intercepted: instead of running,
each distinct specialisation is compiled to a cubin for ``sm_<arch>`` with Triton's own toolchain.

    python -m ulakv.kernels.compile_check [--arch 90] [--json variants.json]

It prints, for every variant, what decides how an SM runs it: registers a thread, the stack frame
(spilled registers), shared memory, warps, the warps an SM keeps resident, and the widest global
load and store in the PTX (a row moved 16 bytes at a time shows 128 bits). It stays in the package
because users need it too: every variant of their pool's kernels checked for an architecture on a
machine without that GPU.

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
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .grid import resident_warps

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
    and bytes), both policies, a striped rank's buffer, census and fetch bookkeeping, an engine-owned
    pool's admission and release, ULAKV_DEBUG's apply, and ``compact_slots``."""
    import torch

    from ulakv import PBLRU, EntrySpec, ExactLRU, NewRows, Pool, PoolConfig, Tiered, compact_slots
    from ulakv.kernels.operands import readable_rows
    from ulakv.layouts.census import CensusState
    from ulakv.layouts.row_exchange import RowExchange
    from ulakv.layouts.tiered_state import BufferState, TieredRunner

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
        new = pool.extend(seq, 2)  # a prepare with the step's new rows: one plan
        pool.prepare(
            0, seq.addresses.reshape(1, 6), new=NewRows(0, new, torch.zeros((2, width), dtype=torch.uint8))
        )
        pool.read(1, seq.addresses)
        pool.release(seq)
        # A striped rank's buffer: the same kernels specialised to drop victims and take fetched rows.
        buffer_cfg = cfg.replace(layout=Tiered(gpu_slots=40, cpu_slots=0, policy=policy))
        state = BufferState.allocate(buffer_cfg, addresses=64)
        state.mapping[:, :4] = -2
        layout = TieredRunner(buffer_cfg, state)
        flat = torch.arange(4, dtype=torch.int64)
        plan, _ = layout.plan(0, flat)
        layout.execute(plan, fetched=readable_rows(torch.zeros((4, 2, width), dtype=torch.uint8)))
    # A striped rank's census (a write's, a local or read one's, a fetch-mode prepare's) and its
    # fetch's bookkeeping, as StripedPool launches them, on the last buffer's plan.
    census = CensusState(2, 1, 64, flat.device)
    live = torch.ones(64, dtype=torch.bool)
    census.take(flat, live=live, unique=True)
    census.take(flat, live=live, per_home=4)
    fetched = census.take(
        flat, live=live, per_home=4, most=8, buffer_map=state.mapping[0], buffer_slots=40, fetch_width=4
    )
    exchange = RowExchange(2, 1, 4, 2, 656, flat.device)
    slots = torch.zeros(4, dtype=torch.int32)
    for selection in (flat, flat.int()):  # an engine's top-k is often int32: read as it is
        census.take(
            selection, live=live, per_home=4, most=8, buffer_map=state.mapping[0], buffer_slots=40,
            fetch_width=4,
        )  # fmt: skip
        exchange.route(selection, plan.scratch, slots, 40)
    exchange.merge_slots(fetched.local, slots, 41)
    # ULAKV_DEBUG's apply, which claims every home its moves write (a state with the claims table;
    # the debug switch itself would check each call's state, which nothing here runs).
    debug = Pool(cfg)
    debug.internals().state.home_claims = torch.zeros((1, 40 + 8 + 40 + 1), dtype=torch.int64)
    seq = debug.admit(4)
    debug.write(0, seq.addresses, torch.zeros((4, 656), dtype=torch.uint8))
    debug.prepare(0, seq.addresses.reshape(1, 4))
    new = debug.extend(seq, 2)
    debug.prepare(
        0, seq.addresses.reshape(1, 6), new=NewRows(0, new, torch.zeros((2, 656), dtype=torch.uint8))
    )
    # Engine-owned addresses (both check variants, and release's checked one), then FlashInfer's layout.
    engine = Pool(cfg.replace(engine_addresses=64, page_size=64))
    locs = torch.tensor([9, 3, -1, 17])
    engine.admit_addresses(locs)
    engine.write(0, locs, torch.zeros((4, 656), dtype=torch.uint8))
    slots = engine.prepare(0, locs.view(1, 4)).slots
    engine.release_addresses(locs)
    compact_slots(slots)


@dataclass(frozen=True)
class Variant:
    """One compiled specialisation of a kernel, as the sm_<arch> cubin and its PTX report it."""

    kernel: str
    registers: int  # a thread
    stack_bytes: int  # the local stack frame a thread: spilled registers (Triton keeps no local arrays)
    shared_bytes: int  # dynamic shared memory a program
    warps: int  # a program
    widest_load_bits: int  # widest ld.global in the PTX (a row moved 16 bytes at a time: 128)
    widest_store_bits: int
    vector_bytes: int  # bytes a row's vector holds in this variant (``UNIT_BYTES``), 0 if it moves none
    # The mode flags it was specialised for (WRITE, NEW, POLICY, CACHE, ADMIT, CHECKED: those it has),
    # e.g. "POLICY=0 WRITE=1": which of a kernel's paths a row of the table is.
    flags: str = ""

    @property
    def resident_warps(self) -> int:
        return resident_warps(self.registers, self.warps, self.shared_bytes)

    @property
    def programs_per_sm(self) -> int:
        """Programs an SM holds at once: a launch of more than the SMs hold runs in waves."""
        return self.resident_warps // self.warps


_FLAGS = ("POLICY", "WRITE", "NEW", "CACHE", "ADMIT", "CHECKED", "DEBUG")

_PTX_WIDTHS = {"b8": 8, "b16": 16, "b32": 32, "b64": 64, "u8": 8, "u16": 16, "u32": 32, "u64": 64}


def _widest(ptx: str, op: str) -> int:
    """Bits of the widest global access ``op`` (ld or st) in ``ptx``: lanes x element bits."""
    widest = 0
    for lanes, kind in re.findall(rf"\b{op}\.global(?:\.[a-z_]+)*?(?:\.v(\d))?\.([bu]\d+)\b", ptx):
        widest = max(widest, int(lanes or 1) * _PTX_WIDTHS.get(kind, 0))
    return widest


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) of the cubin's one function, read by the cuobjdump Triton ships."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if found is None:
        raise RuntimeError(f"cuobjdump reported no resource usage: {text!r}")
    return int(found.group(1)), int(found.group(2))


def compile_all(arch: int = 90) -> list[Variant]:
    """Drive a small pool and compile each kernel specialisation it launches; returns every
    distinct variant with its resources, in the order first launched."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    seen: set[tuple[str, str]] = set()
    variants: list[Variant] = []

    def compile_instead_of_launch(fn: Any, key: str, what: dict) -> None:
        name = fn.fn.__name__
        if (name, key) in seen:
            return
        seen.add((name, key))
        attrs = what["configs"][0]
        # The launch's own options (its maxnreg too, which only the specialisation data carries).
        launched = json.loads(what["specialization_data"])["options"]
        options = {
            option: launched[option]
            for option in ("num_warps", "num_stages", "num_ctas", "maxnreg")
            if launched.get(option) is not None
        }
        source = ASTSource(fn, what["signature"], what["constants"], attrs)
        kernel = triton.compile(source, target=target, options=options)
        registers, stack = _resources(kernel.asm["cubin"])
        ptx = kernel.asm["ptx"]
        constants = {fn.arg_names[i]: value for (i, *_), value in what["constants"].items()}
        variants.append(
            Variant(
                kernel=name,
                registers=registers,
                stack_bytes=stack,
                shared_bytes=kernel.metadata.shared,
                warps=kernel.metadata.num_warps,
                widest_load_bits=_widest(ptx, "ld"),
                widest_store_bits=_widest(ptx, "st"),
                vector_bytes=int(constants.get("UNIT_BYTES", 0)),
                flags=" ".join(f"{k}={int(constants[k])}" for k in _FLAGS if k in constants),
            )
        )

    with intercept_launches(arch, compile_instead_of_launch):
        drive_pool()
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="SM version, e.g. 90 for H100/H200")
    parser.add_argument("--json", type=Path, default=None, help="also write every variant's report here")
    args = parser.parse_args()
    from ._triton import INTERPRETED

    if INTERPRETED:
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]], env)
    variants = compile_all(args.arch)
    counts: dict[str, int] = {}
    for v in variants:
        counts[v.kernel] = counts.get(v.kernel, 0) + 1
    names = sorted(counts)
    print(f"compiled for sm_{args.arch}: {', '.join(names)}")
    print(f"variants: {len(variants)} ({', '.join(f'{k} {counts[k]}' for k in names)})")
    print(
        "kernel | registers | stack (B) | shared (B) | warps | resident warps | programs an SM"
        " | widest load | widest store | row vector (B) | flags"
    )
    for v in sorted(variants, key=lambda v: v.kernel):
        print(
            f"{v.kernel} | {v.registers} | {v.stack_bytes} | {v.shared_bytes} | {v.warps} | "
            f"{v.resident_warps} | {v.programs_per_sm} | {v.widest_load_bits} | {v.widest_store_bits} | "
            f"{v.vector_bytes} | "
            f"{v.flags}"
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                [
                    {**asdict(v), "resident_warps": v.resident_warps, "programs_per_sm": v.programs_per_sm}
                    for v in variants
                ]
            )
        )


if __name__ == "__main__":
    main()
