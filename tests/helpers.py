"""Shared test helpers: small pools, random rows, and bit-exact comparison of state."""

from __future__ import annotations

import torch

from ulakv import EntrySpec, ExactLRU, Pool, PoolConfig, Tiered


def small_pool(
    gpu_slots: int = 5,
    cpu_slots: int = 9,
    bytes_per_layer: int = 6,
    num_layers: int = 3,
    layers_per_group: int = 2,
    policy=None,
    **kwargs,
) -> Pool:
    return Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=bytes_per_layer),
            num_layers=num_layers,
            layers_per_group=layers_per_group,
            layout=Tiered(gpu_slots=gpu_slots, cpu_slots=cpu_slots, policy=policy or ExactLRU()),
            **kwargs,
        )
    )


def random_rows(gen: torch.Generator, n: int, width: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=gen)


def assert_tensors_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], where: str = "") -> None:
    """Bitwise equality of two dicts of tensors (GPU data compared without the dummy slot; the
    PB-LRU search frontier is scratch the references do not model)."""
    assert a.keys() == b.keys()
    for key in a:
        if key == "frontier":
            continue
        x, y = a[key], b[key]
        if key == "gpu_data":
            x, y = x[:, :-1], y[:, :-1]
        assert x.dtype == y.dtype and x.shape == y.shape, (
            f"{where}{key}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}"
        )
        assert torch.equal(x, y), f"{where}{key} differs:\n{x}\n{y}"
