"""The formulas behind ``benchmarks/striped_traffic.py``, held on gloo (world 2, tiny shapes).

A fetch-mode prepare receives ``(world - 1) x fetch_width x layers x row_bytes`` (padding included;
the group's layers: the last group is shorter), of which ``bytes_needed`` counts the misses homed on
the other rank; a local-mode prepare moves nothing; ``all_gather_partials`` receives
``partial_bytes``. Where the operating system counts socket writes (``/proc/self/io``), the bytes
gloo wrote during each call are checked too: an all-gather is symmetric, so a rank writes what it
receives, plus gloo's framing.
"""

from __future__ import annotations

import torch

from ulakv import EntrySpec, ExactLRU, Pool, PoolConfig, Striped, Tiered
from ulakv.engine.context_parallel import all_gather_partials, partial_bytes
from ulakv.spawn import run_ranks

WIDTH, LAYERS, PER_GROUP = 12, 3, 2  # groups of 2 and 1 layers
BUFFER, SLICE = 64, 40  # the buffer never evicts: a miss is an address the group has not selected yet
FRAMING = 4096  # at most this many bytes of gloo's own a call


def _socket_bytes() -> int:
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    except (OSError, StopIteration):
        return -1


def _config(rank: int, world: int, attention: str) -> PoolConfig:
    fetch = attention == "fetch"
    return PoolConfig(
        entry=EntrySpec(bytes_per_layer=WIDTH),
        num_layers=LAYERS,
        layers_per_group=PER_GROUP,
        layout=Striped(
            world=world,
            rank=rank,
            buffer_slots=BUFFER if fetch else 0,
            policy=ExactLRU(),
            inner=Tiered(gpu_slots=SLICE),
            attention=attention,
        ),
    )


def _ranks(rank: int, world: int) -> dict:
    out: dict = {"fetch": [], "local": []}
    for attention in ("fetch", "local"):
        cfg = _config(rank, world, attention)
        pool = Pool(cfg)
        seqs = [pool.admit(20), pool.admit(13)]
        addrs = torch.cat([s.addresses for s in seqs])  # not written: the bytes counted do not depend on it
        gen = torch.Generator().manual_seed(7)  # the same selections on both ranks
        seen: list[set[int]] = [set(), set()]
        for _ in range(2):
            for group in (0, 1):
                topk = addrs[torch.randint(0, addrs.numel(), (2, 8), generator=gen)]
                topk[0, -1] = -1  # padding
                before, wrote = pool.stats(), _socket_bytes()
                pool.prepare(group, topk)
                wrote = _socket_bytes() - wrote
                after = pool.stats()
                new = {a for a in topk.flatten().tolist() if a >= 0} - seen[group]
                seen[group] |= new
                out[attention].append(
                    dict(
                        layers=len(cfg.group_layers(group)),
                        wire=after["bytes_communicated"] - before["bytes_communicated"],
                        needed=after["bytes_needed"] - before["bytes_needed"],
                        collectives=after["collectives"] - before["collectives"],
                        remote_new=sum(1 for a in new if a % world != rank),
                        socket=wrote,
                        fetch_width=cfg.layout.fetch_width,
                    )
                )
    B, Q, H, D = 3, 2, 4, 8
    o = torch.full((B, Q, H, D), rank + 1.0, dtype=torch.bfloat16)
    lse = torch.full((B, Q, H), rank - 0.5, dtype=torch.float32)
    wrote = _socket_bytes()
    outs, lses = all_gather_partials(o, lse, world)
    wrote = _socket_bytes() - wrote
    assert all(bool((outs[r] == r + 1).all()) and bool((lses[r] == r - 0.5).all()) for r in range(world))
    own = o.numel() * o.element_size() + lse.numel() * lse.element_size()
    out["partials"] = dict(
        received=outs.numel() * outs.element_size() + lses.numel() * lses.element_size() - own,
        formula=partial_bytes(B, Q, H, D, world, element_bytes=2),
        socket=wrote,
    )
    return out


def _socket_matches(socket: int, expected: int) -> bool:
    """Socket bytes agree with ``expected`` up to gloo's framing (or the OS does not count them)."""
    return socket == -1 or expected <= socket <= expected + FRAMING


def test_measured_bytes_equal_the_formulas_on_gloo() -> None:
    world = 2
    for rank, result in enumerate(run_ranks(_ranks, world)):
        for p in result["fetch"]:
            assert p["fetch_width"] == min(BUFFER, SLICE)
            assert p["wire"] == (world - 1) * p["fetch_width"] * p["layers"] * WIDTH, (rank, p)
            assert p["needed"] == p["remote_new"] * p["layers"] * WIDTH, (rank, p)
            assert p["needed"] <= p["wire"]
            assert p["collectives"] == 1
            assert _socket_matches(p["socket"], p["wire"]), (rank, p)
        assert sum(p["remote_new"] for p in result["fetch"]) > 0  # some misses were homed elsewhere
        for p in result["local"]:
            assert p["wire"] == p["needed"] == p["collectives"] == 0, (rank, p)
            assert p["socket"] in (0, -1), (rank, p)
        partials = result["partials"]
        assert partials["received"] == partials["formula"]
        assert _socket_matches(partials["socket"], partials["formula"]), (rank, partials)
