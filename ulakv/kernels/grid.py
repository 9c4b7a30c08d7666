"""How many programs a persistent grid launches: as many as the GPU holds at once.

A grid sized by the call (a program a tile of the call's elements) puts most of its programs on
work that may not exist: at batch 256 x 3 x 2048 a prepare's misses fill a few thousand 8-row
tiles of the 196,608 the call could need, and each idle program still loads its control words
before it finds out. A persistent grid launches the programs the SMs hold at once, and each strides
over the work the plan counted, reading the count on the device (no host read-back).
"""

from __future__ import annotations

import functools

import torch

# The GPU the interpreter's figures model: an H200's 132 SMs. Four programs of 8 warps an SM (32
# warps): the row-moving kernels hold 16-40 resident warps an SM (``compile_check``); a program
# past the resident ones waits for a slot and costs one control-word load, one short of them leaves
# an SM without memory in flight, so the count errs high.
H200_SMS = 132
PROGRAMS_PER_SM = 4
GPU_PROGRAM_SLOTS = H200_SMS * PROGRAMS_PER_SM


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def program_slots(device: torch.device) -> int:
    """Programs a persistent grid launches on ``device``: its SMs x ``PROGRAMS_PER_SM`` (the H200's
    132 SMs off a GPU, so that the interpreter runs the grid a GPU would)."""
    if device.type == "cuda":
        return (
            _sms(device.index if device.index is not None else torch.cuda.current_device()) * PROGRAMS_PER_SM
        )
    return GPU_PROGRAM_SLOTS
