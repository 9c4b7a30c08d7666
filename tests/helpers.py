"""Shared test helpers: small pools, random rows, and bit-exact comparison of state."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

from ulakv import EntrySpec, ExactLRU, Pool, PoolConfig, Tiered
from ulakv.kernels import common as K
from ulakv.layouts.tiered_state import TieredState


def pool_config(**changes) -> PoolConfig:
    """A small valid config (5-byte entries, 3 layers in groups of 2, 7 GPU slots) with ``changes``."""
    base = dict(
        entry=EntrySpec(bytes_per_layer=5),
        num_layers=3,
        layers_per_group=2,
        layout=Tiered(gpu_slots=7, cpu_slots=0),
    )
    return PoolConfig(**{**base, **changes})


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


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A view whose equality is bit equality (NaN payloads and -0.0 included)."""
    t = t.detach().contiguous().reshape(-1)
    if t.is_floating_point() or t.is_complex():
        return t.view(torch.uint8)
    return t


def assert_same_state(
    before: object, after: object, path: str = "state", ignore: tuple[str, ...] = ()
) -> None:
    """``state_dict()`` snapshots are bit-identical (the host-side launch counter excepted, and
    keys containing any of ``ignore``)."""
    if isinstance(before, dict):
        assert isinstance(after, dict), path
        assert before.keys() == after.keys(), f"{path}: keys changed"
        for key in before:
            if any(word in str(key) for word in ("launch", *ignore)):
                continue
            assert_same_state(before[key], after[key], f"{path}[{key!r}]", ignore)
    elif isinstance(before, (list, tuple)):
        assert isinstance(after, (list, tuple)) and len(before) == len(after), path
        for i, (a, b) in enumerate(zip(before, after, strict=True)):
            assert_same_state(a, b, f"{path}[{i}]", ignore)
    elif isinstance(before, torch.Tensor):
        assert isinstance(after, torch.Tensor), path
        assert before.dtype == after.dtype, f"{path}: dtype {before.dtype} -> {after.dtype}"
        assert before.shape == after.shape, f"{path}: shape {before.shape} -> {after.shape}"
        assert torch.equal(_bits(before), _bits(after)), f"{path} changed"
    else:
        assert before == after, f"{path}: {before!r} -> {after!r}"


def assert_holds_nothing(state: TieredState) -> None:
    """What the release kernel alone must leave once every entry of ``state`` is released: no
    address homed, every GPU slot unowned, both free stacks full (each slot once), no bucket bit."""
    G, C = state.gpu_slots, state.cpu_slots
    assert not bool((state.mapping >= 0).any()), "an address still has a home"
    assert bool((state.owner == -1).all()), "a GPU slot is still owned"
    for g in range(state.num_groups):
        n_gpu, n_cpu = int(state.gctl[g, int(K.G_GPU_FREE)]), int(state.gctl[g, int(K.G_CPU_FREE)])
        assert (n_gpu, n_cpu) == (G, C), f"group {g}: free stacks hold {n_gpu}/{G} GPU, {n_cpu}/{C} CPU"
        ids = torch.arange(max(G, C), dtype=torch.int32, device=state.gpu_free.device)
        assert torch.equal(state.gpu_free[g, :G].sort().values, ids[:G]), f"group {g}: GPU free stack"
        assert torch.equal(state.cpu_free[g, :C].sort().values, ids[:C]), f"group {g}: CPU free stack"
    assert not bool(state.bits.any()), "a PB-LRU bucket still lists a slot"


@contextlib.contextmanager
def looking_behind_reset() -> Iterator[list[TieredState]]:
    """A pool (or a buffer) puts its policy state back to fresh once nothing is left in it (invariant
    6, exactly); that reset would also hide a release kernel that leaks slots. Inside this block every
    reset first checks that the release kernels had already freed everything; yields the states
    reset, so a test can tell it looked."""
    reset, seen = TieredState.reset_residency, []

    def checked_reset(state: TieredState) -> None:
        assert_holds_nothing(state)
        seen.append(state)
        reset(state)

    with mock.patch.object(TieredState, "reset_residency", checked_reset):
        yield seen
