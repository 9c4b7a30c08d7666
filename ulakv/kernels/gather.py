"""Gather: the bytes of logical addresses in one layer, wherever they live (the slow read path).

Entries without a home read as zeros. Validation happens in the caller (reads may synchronise).
"""

from __future__ import annotations

import torch

from . import common as K
from ._triton import tl, triton

ROWS = 16


# Not specialised: n (varies), G (pool constant, no vectorisable access), the alignment of the caller's
# addresses, of group g's mapping row and of layer l's rows (offset l x rows x W: a slow path, not worth
# wide loads). Specialised: W (row width, fixed per pool), out_ptr (a fresh tensor), constexprs.
@triton.jit(
    do_not_specialize=["n", "G"], do_not_specialize_on_alignment=["addr_ptr", "map_ptr", "gpu_ptr", "cpu_ptr"]
)
def gather_kernel(
    addr_ptr, n, map_ptr, G, gpu_ptr, cpu_ptr, out_ptr, W, ROWS: tl.constexpr, WORDS: tl.constexpr
):
    i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    im = i < n
    a = tl.load(addr_ptr + i, mask=im, other=0).to(tl.int64)
    h = tl.load(map_ptr + a, mask=im, other=K.M_UNHOMED).to(tl.int64)
    w = tl.arange(0, WORDS)
    wm = w[None, :] < W
    on_gpu = (im & (h >= 0) & (h < G))[:, None] & wm
    on_cpu = (im & (h >= G))[:, None] & wm
    row = tl.load(gpu_ptr + h[:, None] * W + w[None, :], mask=on_gpu, other=0)
    row = tl.where(on_cpu, tl.load(cpu_ptr + (h - G)[:, None] * W + w[None, :], mask=on_cpu, other=0), row)
    tl.store(out_ptr + i[:, None] * W + w[None, :], row, mask=im[:, None] & wm)


def gather(addrs, mapping, gpu_slots: int, gpu_layer, cpu_layer) -> torch.Tensor:
    """Rows ``[n, words]`` of ``addrs`` from one layer's GPU and CPU buffers (word views)."""
    n, W = addrs.numel(), gpu_layer.shape[-1]
    out = torch.empty((n, W), dtype=gpu_layer.dtype, device=gpu_layer.device)
    if n:
        gather_kernel[(triton.cdiv(n, ROWS),)](
            addr_ptr=addrs,
            n=n,
            map_ptr=mapping,
            G=gpu_slots,
            gpu_ptr=gpu_layer,
            cpu_ptr=cpu_layer,
            out_ptr=out,
            W=W,
            ROWS=ROWS,
            WORDS=K.next_pow2(W),
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
