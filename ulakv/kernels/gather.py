"""Gather: the bytes of logical addresses in one layer, wherever they live (the slow read path).

Entries without a home read as zeros. Validation happens in the caller (reads may synchronise).
"""

from __future__ import annotations

import torch

from . import common as K
from ._triton import INTERPRETED, tl, triton
from .rows import load_units, store_units, unit_offsets, vector_unit, vectors_per_row

# Rows a program moves. On a GPU 8 rows x 64 vectors x 16 B (656-byte rows: 41 vectors, the axis
# rounded up to 64) is 8 KiB a program: 40 registers a thread, 48 warps resident an SM on sm_90 (16
# rows took 80 registers and 24 warps). The interpreter pays per operation, not per element, and
# takes 4x larger tiles.
ROWS = 32 if INTERPRETED else 8


# Not specialised: n (varies), G (pool constant, no vectorisable access), the alignment of every
# pointer (a layer's rows sit at layer x rows x W: the launcher checks their alignment and picks the
# vector width ``UNIT``, ``ulakv.kernels.rows``). Specialised: V (row width in vectors, fixed per
# pool), constexprs. One variant a pool.
@triton.jit(
    do_not_specialize=["n", "G"],
    do_not_specialize_on_alignment=["addr_ptr", "map_ptr", "gpu_ptr", "cpu_ptr", "out_ptr"],
)
def gather_kernel(
    addr_ptr,
    n,
    map_ptr,
    G,
    gpu_ptr,
    cpu_ptr,
    out_ptr,
    V,
    ROWS: tl.constexpr,
    VECS: tl.constexpr,
    UNIT: tl.constexpr,
    UNIT_BYTES: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    im = i < n
    a = tl.load(addr_ptr + i, mask=im, other=0).to(tl.int64)
    h = tl.load(map_ptr + a, mask=im, other=K.M_UNHOMED).to(tl.int64)
    on_gpu = im & (h >= 0) & (h < G)
    on_cpu = im & (h >= G)
    src, vm = unit_offsets(tl.where(on_cpu, h - G, h), V, VECS, UNIT)
    dst, _ = unit_offsets(i, V, VECS, UNIT)
    row = load_units(gpu_ptr, src, on_gpu[:, None, None] & vm, UNIT, UNIT_BYTES)
    from_cpu = load_units(cpu_ptr, src, on_cpu[:, None, None] & vm, UNIT, UNIT_BYTES)
    row = tl.where(on_cpu[:, None, None], from_cpu, row)
    store_units(out_ptr, dst, row, im[:, None, None] & vm, UNIT, UNIT_BYTES)


def gather(addrs, mapping, gpu_slots: int, gpu_layer, cpu_layer) -> torch.Tensor:
    """Rows ``[n, W]`` of ``addrs`` (int64 ``[n]``) from one layer's GPU and CPU buffers (word or
    byte views ``[slots, W]``); an address with no home reads as zeros. One launch, no host sync;
    rows move in the widest vectors their width and alignment allow (16 B for 656-byte rows)."""
    n, W = addrs.numel(), gpu_layer.shape[-1]
    out = torch.empty((n, W), dtype=gpu_layer.dtype, device=gpu_layer.device)
    if n:
        unit = vector_unit(W, gpu_layer, cpu_layer, out)
        vectors, vecs = vectors_per_row(W, unit)
        gather_kernel[(K.cdiv(n, ROWS),)](
            addr_ptr=addrs,
            n=n,
            map_ptr=mapping,
            G=gpu_slots,
            gpu_ptr=gpu_layer,
            cpu_ptr=cpu_layer,
            out_ptr=out,
            V=vectors,
            ROWS=ROWS,
            VECS=vecs,
            UNIT=unit,
            UNIT_BYTES=unit * out.element_size(),
        )
    return out


def gather_reference(addrs, mapping, gpu_slots: int, gpu_layer, cpu_layer) -> torch.Tensor:
    """Plain-Python twin of :func:`gather`: each address's row from its GPU slot or CPU row."""
    out = torch.zeros((addrs.numel(), gpu_layer.shape[-1]), dtype=gpu_layer.dtype)
    for i, a in enumerate(addrs.tolist()):
        h = int(mapping[a])
        if 0 <= h < gpu_slots:
            out[i] = gpu_layer[h]
        elif h >= gpu_slots:
            out[i] = cpu_layer[h - gpu_slots]
    return out
