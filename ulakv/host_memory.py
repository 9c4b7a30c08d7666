"""The CPU tier's host memory: reserved as asked, never rounded up, not filled on the host.

``torch.zeros(shape, pin_memory=True)`` goes through torch's caching host allocator, which rounds a
request up to a power of two (192 GiB asked pins 256; 78 GiB pins 128) and then zero-fills every
byte from one host thread: across 8 ranks that can ask for more than the host holds, and start-up
takes minutes. The tier is instead an anonymous memory map of exactly the bytes asked (rounded up
to a page: under 4 KiB more), whose pages the kernel hands out already zero, registered with CUDA
(``cudaHostRegister``) beside a GPU so that apply's copies to and from it run as DMA from
page-locked memory. Before anything is mapped, the bytes asked are checked against the host's
available memory, so a tier the host cannot hold fails at construction with the numbers, not in
the middle of a run (or at the out-of-memory killer).
"""

from __future__ import annotations

import math
import mmap
import weakref
from pathlib import Path

import torch

from .errors import CapacityError

PAGE = mmap.PAGESIZE
_MEMINFO = Path("/proc/meminfo")


def reserved_bytes(nbytes: int) -> int:
    """Host bytes a tier of ``nbytes`` reserves: the map is whole pages."""
    return -(-nbytes // PAGE) * PAGE


def caching_allocator_bytes(nbytes: int) -> int:
    """What torch's pinned caching allocator reserves for ``nbytes``: the next power of two (for
    comparison: ``ulakv capacity`` and the tests show what the map saves)."""
    return 1 << max(nbytes - 1, 0).bit_length()


def host_bytes_available() -> int | None:
    """The host memory the kernel says a new allocation can take without swapping (Linux's
    ``MemAvailable``), or None where it does not say."""
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _register(ptr: int, nbytes: int, what: str) -> None:
    """Page-lock ``nbytes`` at ``ptr`` for CUDA copies."""
    # cudaHostRegisterPortable (1): pinned for every CUDA context of the process, as pin_memory is;
    # cudaHostRegisterMapped (2): mapped into the device's address space, because kernels read and
    # write these bytes in place (apply's rows, the refusal report), not only copies.
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 3))
    if err != 0:
        raise CapacityError(
            f"{what}'s {_gib(nbytes)} could not be page-locked for the GPU (CUDA error {err})"
        )


def _unregister(ptr: int, region: mmap.mmap) -> None:
    """Unlock the map, which this finalizer's reference keeps mapped until it has."""
    torch.cuda.cudart().cudaHostUnregister(ptr)
    del region


def allocate_tier(shape: tuple[int, ...], *, pin: bool, what: str = "the CPU tier") -> torch.Tensor:
    """A uint8 tensor of ``shape`` in host memory that reads as zeros, reserved as asked (the map's
    pages) and page-locked for CUDA when ``pin``. Raises ``CapacityError`` before anything is mapped
    when the host's available memory cannot hold it."""
    nbytes = math.prod(shape)
    if nbytes == 0:
        return torch.zeros(shape, dtype=torch.uint8)
    reserved = reserved_bytes(nbytes)
    available = host_bytes_available()
    if available is not None and reserved > available:
        raise CapacityError(
            f"{what} needs {_gib(reserved)} of host memory ({nbytes} bytes) and the host has "
            f"{_gib(available)} available: lower cpu_slots, or the ranks sharing this host"
        )
    region = mmap.mmap(-1, reserved)  # anonymous: zero pages, taken from the kernel as touched
    view = memoryview(region)  # what the tensors' storage holds: alive while any view of them is
    tensor = torch.frombuffer(view, dtype=torch.uint8, count=nbytes).view(shape)
    if pin:
        _register(tensor.data_ptr(), nbytes, what)
        # Unlocked when the last tensor over the map goes, before the map itself is unmapped.
        weakref.finalize(view, _unregister, tensor.data_ptr(), region)
    return tensor
