"""What a GPU would wait for, counted under the Triton interpreter: the memory operations of every
program of every launch.

A GPU runs a launch's programs side by side, so a launch lasts about as long as its busiest program,
and a call as long as the sum of its launches' busiest programs: its *critical path*. Each vector
memory operation (a load, a store, an atomic; up to a block of lanes) is a dependent step of about a
microsecond on one SM. The interpreter runs programs one after another and hides all of that, so this
module counts the operations each program issues::

    with count_memory_ops() as launches:
        pool.prepare(group, topk)
    critical_path(launches)  # sum over launches of the busiest program's operations
    critical_path(launches, sms=H200_SMS)  # the same, each launch run in waves

A launch with more programs than the GPU holds at once runs in waves: its programs share the SMs'
program slots, so it lasts at least its programs' operations divided by the slots, however short
its busiest program. ``Launch.length(slots)`` is the larger of the two (a list schedule of
independent programs ends within one busiest program of that bound). The slots are the kernel's
own: the SMs times the programs of it an SM holds (``ulakv.kernels.grid.FOOTPRINTS``, from the
sm_90 cubins), so classify's 16-warp programs count 132 slots on an H200 and decide's 924. It is
what compares a grid sized by the call with a persistent grid, whose programs stride over the work.

Counting patches the interpreter's builder for the duration of the block (one block at a time).
Only the outermost builder call of an operation counts: the interpreter builds an unmasked load or
store by calling its masked twin (figures in ``benchmarks/RESULTS.md`` dated before 2026-12-02
counted every unmasked load and store twice).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from ulakv.kernels._triton import INTERPRETED
from ulakv.kernels.grid import FOOTPRINTS, H200_SMS

__all__ = ["H200_SMS", "Launch", "Prices", "count_memory_ops", "critical_path"]

# The builder calls that issue a memory operation: loads, stores, atomics (read-modify-write, CAS).
_MEMORY_OPS = (
    "create_load",
    "create_masked_load",
    "create_store",
    "create_masked_store",
    "create_atomic_rmw",
    "create_atomic_cas",
)


@dataclass
class Launch:
    """One kernel launch: its name and each program's count of memory operations."""

    kernel: str
    per_program: dict[tuple[int, int, int], int] = field(default_factory=dict)
    # Of each program's operations, its atomics (read-modify-write, CAS): an L2 round trip each.
    atomics: Counter[tuple[int, int, int]] = field(default_factory=Counter)
    # Active lanes of read-modify-write atomics, by address: same-address contention.
    atomic_lanes: Counter[int] = field(default_factory=Counter)

    @property
    def programs(self) -> int:
        return len(self.per_program)

    @property
    def busiest(self) -> int:
        """Operations of the busiest program: the launch's length on a GPU, in dependent steps."""
        return max(self.per_program.values(), default=0)

    @property
    def total(self) -> int:
        return sum(self.per_program.values())

    def slots(self, sms: int) -> int:
        """Programs of this kernel that ``sms`` SMs hold at once (its sm_90 footprint)."""
        if self.kernel not in FOOTPRINTS:
            raise KeyError(f"{self.kernel}: no footprint in ulakv.kernels.grid.FOOTPRINTS (compile_check)")
        return sms * FOOTPRINTS[self.kernel].programs_per_sm

    def waves(self, sms: int) -> int:
        """Waves the launch's programs run in on ``sms`` SMs."""
        return -(-self.programs // self.slots(sms))

    def length(self, slots: int | None = None) -> int:
        """The launch's length in dependent steps: its busiest program, or with ``slots`` program
        slots, its programs' operations shared by the slots if that is longer (waves)."""
        if slots is None:
            return self.busiest
        return max(self.busiest, -(-self.total // slots))


@dataclass(frozen=True)
class Prices:
    """Microseconds a dependent step costs on a GPU: a global-memory round trip (every load and
    store is priced as one from DRAM, an upper bound: scratch the call just wrote sits in L2, and
    independent operations of one program overlap), an atomic (resolved in L2) and a launch
    boundary inside a CUDA graph (the next launch's programs start after the last of this one's)."""

    round_trip_us: float = 0.6
    atomic_us: float = 0.5
    launch_us: float = 1.5

    def program_us(self, launch: Launch, program: tuple[int, int, int]) -> float:
        atomics = launch.atomics.get(program, 0)
        return (launch.per_program[program] - atomics) * self.round_trip_us + atomics * self.atomic_us

    def launch_us_on(self, launch: Launch, sms: int) -> float:
        """The launch's price on ``sms`` SMs: its busiest program's, or its programs' shared by the
        kernel's slots when that is longer (waves), plus a launch boundary."""
        each = [self.program_us(launch, p) for p in launch.per_program]
        return max(max(each, default=0.0), sum(each) / launch.slots(sms)) + self.launch_us

    def call_us(self, launches: list[Launch], sms: int) -> float:
        return sum(self.launch_us_on(launch, sms) for launch in launches)


def critical_path(launches: list[Launch], slots: int | None = None, sms: int | None = None) -> int:
    """Sum over the launches of their lengths: the busiest program's operations, or the wave-aware
    length (:meth:`Launch.length`) with ``slots`` program slots for every launch, or with ``sms``
    SMs, each launch's own slots (:meth:`Launch.slots`)."""
    if sms is not None:
        return sum(launch.length(launch.slots(sms)) for launch in launches)
    return sum(launch.length(slots) for launch in launches)


@contextmanager
def count_memory_ops() -> Iterator[list[Launch]]:
    """Record every interpreted launch inside the block, program by program."""
    if not INTERPRETED:
        raise RuntimeError("count_memory_ops needs the Triton interpreter (TRITON_INTERPRET=1)")
    from triton.runtime import interpreter

    builder_cls, executor_cls = type(interpreter.interpreter_builder), interpreter.GridExecutor
    launches: list[Launch] = []
    saved = {name: getattr(builder_cls, name) for name in _MEMORY_OPS}
    saved_call, saved_grid_idx = executor_cls.__call__, builder_cls.set_grid_idx

    depth = [0]  # memory-op builder calls in progress: only the outermost one counts

    def counting(name: str):
        op = saved[name]

        def wrapper(self, *args, **kwargs):
            if launches and depth[0] == 0:
                counts = launches[-1].per_program
                counts[self.grid_idx] = counts.get(self.grid_idx, 0) + 1
                if name in ("create_atomic_rmw", "create_atomic_cas"):
                    launches[-1].atomics[self.grid_idx] += 1
                if name == "create_atomic_rmw":  # (op, ptr, val, mask, sem, scope)
                    ptr, mask = args[1].data, args[3].data
                    launches[-1].atomic_lanes.update(ptr[np.broadcast_to(mask, ptr.shape)].tolist())
            depth[0] += 1
            try:
                return op(self, *args, **kwargs)
            finally:
                depth[0] -= 1

        return wrapper

    def launch(self, *args, **kwargs):
        launches.append(Launch(self.fn.__name__))
        return saved_call(self, *args, **kwargs)

    def enter_program(self, x, y, z):
        saved_grid_idx(self, x, y, z)
        if launches:  # a program that issues nothing still ran: it counts at zero
            launches[-1].per_program.setdefault((x, y, z), 0)

    for name in _MEMORY_OPS:
        setattr(builder_cls, name, counting(name))
    executor_cls.__call__ = launch
    builder_cls.set_grid_idx = enter_program
    try:
        yield launches
    finally:
        for name, op in saved.items():
            setattr(builder_cls, name, op)
        executor_cls.__call__ = saved_call
        builder_cls.set_grid_idx = saved_grid_idx
