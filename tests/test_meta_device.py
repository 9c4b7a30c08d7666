"""Pools on the meta device: capacity planning only (``docs/design.md``, section 5).

A pool whose device is ``meta`` builds at full size without allocating: it admits, extends and
releases addresses exactly as a real pool of its kind does (capacity and ``CapacityError`` included),
and refuses every call that would touch data (``write``, ``prepare``, ``read``, ``residency``,
``stats``, ``check_invariants``) with a ``UlakvError`` that names the meta device. Every
single-process kind: the tiered pool and both baselines. The capacity model's own use of meta
pools: ``tests/test_capacity.py``.
"""

from __future__ import annotations

import pytest
import torch
from helpers import offload_config, pool_config, replicated_config

from ulakv import CapacityError, EntrySpec, Pool, PoolConfig, Tiered, UlakvError

# GLM-5-shaped: 656-byte rows (an FP8 latent: 512 fp8 + 4 fp32 scales + 64 bf16 rope), 78 layers
# in groups of 4 so the last group holds 2 (78 = 19 x 4 + 2), 2^20 addresses: eight 128K-token requests.
GLM5 = dict(bpl=656, layers=78, lpg=4, device="meta")


def _tiered_meta(gpu: int, cpu: int, bpl: int = 12, layers: int = 3, lpg: int = 2) -> PoolConfig:
    return pool_config(
        entry=EntrySpec(bytes_per_layer=bpl),
        num_layers=layers,
        layers_per_group=lpg,
        layout=Tiered(gpu_slots=gpu, cpu_slots=cpu),
        device="meta",
    )


@pytest.mark.parametrize(
    "cfg",
    [
        _tiered_meta(gpu=2**16, cpu=2**20 - 2**16, bpl=656, layers=78, lpg=4),
        offload_config(cpu=2**20, quota=2048, requests=8, **GLM5),
        replicated_config(world=8, gpu=2**20, **GLM5),
    ],
    ids=["tiered-glm5-shaped", "offload-glm5-shaped", "replicated-w8-glm5-shaped"],
)
def test_meta_device_admits_but_holds_no_data(cfg: PoolConfig) -> None:
    pool = Pool(cfg)
    assert pool.capacity == 2**20 and pool.num_groups == 20  # 78 = 19 x 4 + 2
    seqs = [pool.admit(num_tokens=2**17) for _ in range(8)]  # eight 128K-token requests fill it
    assert pool.free_addresses == 0
    assert [s.addresses.device.type for s in seqs] == ["meta"] * 8
    with pytest.raises(CapacityError):
        pool.admit(num_tokens=1)
    with pytest.raises(CapacityError):
        pool.extend(seqs[0], 1)
    assert pool.gpu_buffer(77).device.type == "meta"
    addrs = torch.zeros(2, dtype=torch.int64, device="meta")
    rows = torch.empty(2, 656, dtype=torch.uint8, device="meta")
    for call in (
        lambda: pool.write(0, addrs, rows),
        lambda: pool.prepare(0, addrs.view(1, 2)),
        lambda: pool.read(0, addrs),
        lambda: pool.residency(0, addrs),
        pool.stats,
        pool.check_invariants,
    ):
        with pytest.raises(UlakvError, match="meta"):
            call()
    assert pool.free_addresses == 0


@pytest.mark.parametrize(
    "cfg",
    [
        _tiered_meta(gpu=16, cpu=48),
        offload_config(cpu=64, quota=8, requests=2, device="meta"),
        replicated_config(gpu=64, device="meta"),
    ],
    ids=["tiered", "offload", "replicated"],
)
def test_meta_device_release(cfg: PoolConfig) -> None:
    pool = Pool(cfg)
    seq = pool.admit(num_tokens=40)
    pool.release(seq)
    assert pool.free_addresses == 64
    pool.admit(num_tokens=64)
