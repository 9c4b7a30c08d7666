"""How many programs of a kernel an SM holds at once, and how many a persistent grid launches.

An SM keeps a kernel's programs resident as far as its registers, warps and shared memory allow;
a launch of more programs than the SMs hold runs in waves, each wave after a program of the one
before has left. So a launch's length is set by its resident programs, a kernel's own figure:
classify's 16-warp, 128-register programs fit one an SM (132 on an H200), decide's 4-warp ones
seven. ``FOOTPRINTS`` holds each kernel's sm_90 footprint (its most demanding variant, read from
the cubins by ``python -m ulakv.kernels.compile_check``; ``tests/test_compile_sm90.py`` holds the
table equal to them), ``programs_per_sm`` what an SM holds of it.

A persistent grid (apply's workers, classify's pool-wide lists) launches no more programs than the
SMs hold at once: each strides over the work the plan counted, reading the count on the device (no
host read-back). A grid sized by the call instead (a program a tile of its elements) puts most of
its programs on work that may not exist: at batch 256 x 3 x 2048 a prepare's misses fill a few
thousand 8-row tiles of the 196,608 the call could need. The persistent part is sized by what
one launch of the kernel keeps resident, but a launch may hold more programs beside it (classify's
chunk programs, apply's element programs) and another context's launch may share the SMs, so no
program of these grids may wait for another: a grid-wide wait would need a grid of its own sized
by what is left resident.

``tools/critical_path.py`` counts a launch's waves with the same figures.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# The GPU the interpreter's figures model: an H200 (132 SMs, sm_90).
H200_SMS = 132

# Hopper's SM: 4 sub-partitions of 16,384 registers, allocated 256 to a warp; 64 warps and 32
# programs at most; 228 KiB of shared memory, allocated 128 B at a time, with 1 KiB reserved a program.
_SUBPARTITION_REGISTERS = 16384
_REGISTER_GRANULE = 256
_MAX_WARPS = 64
_MAX_PROGRAMS = 32
_SHARED_BYTES = 228 * 1024
_SHARED_GRANULE = 128
_SHARED_RESERVED = 1024


def resident_programs(registers: int, warps: int, shared_bytes: int) -> int:
    """Programs of ``warps`` warps, ``registers`` a thread and ``shared_bytes`` of shared memory
    that one Hopper SM keeps resident at once."""
    per_warp = -(-registers * 32 // _REGISTER_GRANULE) * _REGISTER_GRANULE
    by_registers = 4 * (_SUBPARTITION_REGISTERS // per_warp) // warps
    shared = -(-shared_bytes // _SHARED_GRANULE) * _SHARED_GRANULE + _SHARED_RESERVED
    return min(_MAX_PROGRAMS, _MAX_WARPS // warps, by_registers, _SHARED_BYTES // shared)


def resident_warps(registers: int, warps: int, shared_bytes: int) -> int:
    """Warps an SM keeps resident for such a kernel: a memory-bound kernel hides latency with
    them (8 of 64 cannot hide HBM's)."""
    return resident_programs(registers, warps, shared_bytes) * warps


@dataclass(frozen=True)
class Footprint:
    """What one program of a kernel holds on an SM: registers a thread, warps, shared memory."""

    registers: int
    warps: int
    shared_bytes: int

    @property
    def programs_per_sm(self) -> int:
        # (at least one: a kernel that fits no SM fails at launch, never with an empty grid)
        return max(1, resident_programs(self.registers, self.warps, self.shared_bytes))


# Each kernel's variant that an SM holds the fewest of, on sm_90 (``compile_check``; the comment
# names the variant and what an SM holds of it).
FOOTPRINTS: dict[str, Footprint] = {
    "apply_kernel": Footprint(80, 8, 4096),  # a one-plan write and read (exact LRU): 3 an SM
    "census_kernel": Footprint(92, 4, 8192),  # 5
    "claim_kernel": Footprint(78, 4, 32),  # a write's: 6
    "classify_kernel": Footprint(128, 16, 8192),  # exact LRU's write: 1
    "compact_kernel": Footprint(80, 4, 256),  # 6
    "decide_kernel": Footprint(72, 4, 2048),  # exact LRU: 7
    "engine_addresses_kernel": Footprint(48, 4, 32),  # 10
    "gather_kernel": Footprint(40, 4, 0),  # 12
    "homes_kernel": Footprint(88, 4, 256),  # 5
    "mark_live_kernel": Footprint(32, 4, 0),  # 16
    "place_kernel": Footprint(81, 4, 8192),  # 5
    "release_kernel": Footprint(102, 8, 256),  # exact LRU: 2
    "round_end_kernel": Footprint(72, 4, 32),  # 7
    "slots_kernel": Footprint(36, 4, 2048),  # 12
}


# Programs an SM holds of each kernel as this process's Triton compiled it for the GPU it runs on
# (``learn``): another Triton allocates other registers (the only H200 run, Triton 3.6, gave apply
# 166-222 registers a thread where this table's 3.9 gives 64-80), so a GPU's grids follow its own.
_LEARNT: dict[str, int] = {}
_SEEN: set[int] = set()


def learn(kernel: str, compiled: object) -> None:
    """After a launch on a GPU: ``compiled`` (what ``kernel[grid](...)`` returns) tells the variant's
    registers, warps and shared memory, and the kernel's persistent grids follow the fewest
    programs an SM any variant launched so far holds. The first launch of a variant sizes its grid
    from ``FOOTPRINTS`` (a captured step is captured after a warm-up). Nothing for the interpreter,
    whose launches compile nothing."""
    n_regs, metadata = getattr(compiled, "n_regs", None), getattr(compiled, "metadata", None)
    if not n_regs or metadata is None or id(compiled) in _SEEN:
        return
    _SEEN.add(id(compiled))
    held = max(1, resident_programs(n_regs, metadata.num_warps, metadata.shared))
    _LEARNT[kernel] = min(_LEARNT.get(kernel, held), held)


def programs_per_sm(kernel: str) -> int:
    """Programs of ``kernel`` (a name in ``FOOTPRINTS``) one SM holds at once: as this process
    compiled it for its GPU once launched there (``learn``), else its sm_90 footprint."""
    return _LEARNT.get(kernel) or FOOTPRINTS[kernel].programs_per_sm


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """SMs of ``device`` (the H200's 132 off a GPU, so that the interpreter runs the grid a GPU would)."""
    if device.type == "cuda":
        return _sms(device.index if device.index is not None else torch.cuda.current_device())
    return H200_SMS


def program_slots(device: torch.device, kernel: str) -> int:
    """Programs of ``kernel`` that ``device``'s SMs hold at once: the most a persistent grid of it
    launches."""
    return sm_count(device) * programs_per_sm(kernel)
