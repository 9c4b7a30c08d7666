"""Reading a tiered pool's CPU tier in the clean-eviction tests: homes, copies, free rows, and the
counters a call moves (``tests/test_clean_evictions.py``, ``test_write_copies.py``,
``test_kernels_clean.py``)."""

from __future__ import annotations

from helpers import addr_tensor, policy_cases

from ulakv import EntrySpec, Pool, PoolConfig, Tiered

POLICIES = policy_cases(3)
COUNTERS = ("hits", "misses", "bytes_in", "bytes_out", "victims", "clean_evictions")


def tiered(
    policy,
    gpu: int,
    cpu: int,
    width: int = 12,
    layers: int = 3,
    per_group: int = 2,
    staging: int | None = None,
    write_copies: bool = False,
) -> Pool:
    return Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=width),
            num_layers=layers,
            layers_per_group=per_group,
            layout=Tiered(
                gpu_slots=gpu,
                cpu_slots=cpu,
                policy=policy,
                staging_slots=staging,
                write_copies=write_copies,
            ),
            device="cpu",
        )
    )


def row_bytes(pool: Pool, group: int) -> int:
    """Bytes one entry of ``group`` holds: what a dirty eviction or a swap-in moves."""
    return len(pool.group_layers(group)) * pool.config.entry.bytes_per_layer


def deltas(before: dict, after: dict) -> dict[str, int]:
    return {k: after[k] - before[k] for k in COUNTERS}


def counts(hits=0, misses=0, bytes_in=0, bytes_out=0, victims=0, clean_evictions=0) -> dict[str, int]:
    return dict(
        hits=hits,
        misses=misses,
        bytes_in=bytes_in,
        bytes_out=bytes_out,
        victims=victims,
        clean_evictions=clean_evictions,
    )


def split(pool: Pool, group: int, addrs: list[int]) -> tuple[list[int], list[int]]:
    """``addrs`` homed on the GPU, and those homed on the CPU, in ``group``."""
    res = pool.residency(group, addr_tensor(addrs)).tolist()
    on_gpu = [a for a, r in zip(addrs, res, strict=True) if r >= 0]
    on_cpu = [a for a, r in zip(addrs, res, strict=True) if r < 0]
    return on_gpu, on_cpu


def cpu_row(pool: Pool, group: int, a: int) -> int:
    """The CPU row that is ``a``'s home in ``group`` (fails if ``a`` lives on the GPU)."""
    st = pool.internals().state
    home = int(st.mapping[group, a])
    assert home >= st.gpu_slots, f"address {a} is not homed on the CPU (mapping {home})"
    return home - st.gpu_slots


def copies(pool: Pool, group: int) -> dict[int, int]:
    """The copies a clean eviction would trust: {address homed on the GPU: free row with its bytes}."""
    st = pool.internals().state
    copy_row, copy_slot = st.copy_row[group].tolist(), st.copy_slot[group].tolist()
    owner = st.owner[group].tolist()
    return {owner[s]: r for s, r in enumerate(copy_row) if r >= 0 and copy_slot[r] == s}


def free_rows(pool: Pool, group: int) -> list[int]:
    """The group's free CPU rows, bottom first (pops take the end)."""
    return pool.internals().state.free_cpu_rows(group).tolist()


def homes(pool: Pool, group: int) -> dict[int, int]:
    """Every homed address's mapping value in ``group``."""
    mapping = pool.internals().state.mapping[group].tolist()
    return {a: h for a, h in enumerate(mapping) if h >= 0}
