"""Every kernel against its plain reference, stage by stage, on states reached by real traffic.

Each stage of a call (plan: claim, then classify + plan; apply, whole or in the phase steps an engine
uses) starts from the same state and the same poisoned scratch; the Triton kernels and the
references must leave every tensor bit-identical.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import assert_tensors_equal, pool_config, random_rows, release_against_reference, small_pool

from ulakv import PBLRU, ExactLRU, Tiered
from ulakv.address_space import LogicalAllocator
from ulakv.invariants import check_invariants
from ulakv.kernels import apply as apply_mod
from ulakv.kernels import common as K
from ulakv.kernels import gather as gather_mod
from ulakv.kernels import lookup as lookup_mod
from ulakv.kernels import segments
from ulakv.kernels._triton import tl
from ulakv.kernels.operands import as_words, readable_rows
from ulakv.layouts.tiered_state import REFERENCE, TRITON, BufferState, TieredRunner
from ulakv.transfer import Phase

POISON = -7


def poison(scratch) -> None:
    """Poison what a call writes before it reads (not the counts it carries to the next call)."""
    for name, t in scratch.tensors().items():
        if name not in scratch.CARRIED:
            t.fill_(POISON)


def apply_steps(layers: range, split: bool) -> list[tuple[tuple[int, int], range]]:
    """The launches of one apply: all phases at once, or the way an engine runs a multi-layer group
    (out + evict, the first layer in, the other layers in + commit)."""
    if not split or len(layers) < 2:
        return [((int(Phase.OUT), int(Phase.COMMIT)), layers)]
    first = range(layers.start, layers.start + 1)
    rest = range(layers.start + 1, layers.stop)
    return [
        ((int(Phase.OUT), int(Phase.EVICT)), range(0)),
        ((int(Phase.IN), int(Phase.IN)), first),
        ((int(Phase.IN), int(Phase.COMMIT)), rest),
    ]


def run_stagewise(
    pool, group: int, flat: torch.Tensor, rows=None, layer: int = 0, split: bool = False
) -> None:
    """One call, stage by stage, each stage checked against its reference on a cloned copy;
    ``split`` runs the apply in the phase steps an engine with cross-layer prefetch uses."""
    layout = pool.internals().runner
    st = layout.state
    T = flat.numel()
    scratch = layout.scratch(T)
    poison(scratch)
    layers = pool.config.group_layers(group)
    width = pool.config.entry.bytes_per_layer
    slots = torch.full((T,), POISON, dtype=torch.int32)
    words = readable_rows(rows) if rows is not None else None
    write = rows is not None
    stages = [("plan", lambda k, s, sc: k.plan(s, group, flat, sc, write, len(layers) * width, width))]
    for phases, in_layers in apply_steps(layers, split and not write):
        stages.append(
            (
                f"apply{phases}",
                lambda k, s, sc, out, phases=phases, in_layers=in_layers: k.apply(
                    s, group, sc, flat, layers, words, layer, out, phases=phases, in_layers=in_layers
                ),
            )
        )
    for name, stage in stages:
        st_ref, sc_ref, slots_ref = st.clone(), scratch.clone(), slots.clone()
        if name.startswith("apply"):
            stage(TRITON, st, scratch, slots)
            stage(REFERENCE, st_ref, sc_ref, slots_ref)
        else:
            stage(TRITON, st, scratch)
            stage(REFERENCE, st_ref, sc_ref)
        assert_tensors_equal(st.tensors(), st_ref.tensors(), f"{name}: state ")
        assert_tensors_equal(scratch.tensors(), sc_ref.tensors(), f"{name}: scratch ")
        assert torch.equal(slots, slots_ref), f"{name}: slots"


CASES = [
    # id, gpu_slots, cpu_slots, bytes, layers, per group, policy
    ("lru-gpu-only-odd", 7, 0, 5, 1, 1, ExactLRU()),
    ("lru-656B", 6, 11, 656, 2, 2, ExactLRU()),
    ("lru-short-group", 5, 13, 12, 3, 2, ExactLRU()),
    ("lru-tiny-gpu", 2, 9, 3, 2, 1, ExactLRU()),
    ("pblru2-gpu-only-odd", 7, 0, 5, 1, 1, PBLRU(2)),
    ("pblru3-656B", 6, 11, 656, 2, 2, PBLRU(3)),
    ("pblru4-70-slots", 70, 40, 4, 2, 2, PBLRU(4)),  # 70 slots: 3 leaf words under one summary word
    ("pblru8-tiny-gpu", 2, 9, 3, 2, 1, PBLRU(8)),
]


@pytest.mark.parametrize(
    ("gpu", "cpu", "width", "layers", "per_group", "policy"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_stages_match_reference_under_random_traffic(gpu, cpu, width, layers, per_group, policy) -> None:
    pool = small_pool(gpu, cpu, width, layers, per_group, policy)
    rng, gen = random.Random(gpu * 100 + cpu), torch.Generator().manual_seed(width)
    seqs = []
    for _ in range(16):
        op = rng.random()
        live = [a for s in seqs for a in s.address_list]
        if (op < 0.35 or not live) and pool.free_addresses:
            seq = pool.admit(rng.randint(1, min(4, pool.free_addresses)))
            seqs.append(seq)
            for layer in range(layers):
                addrs = seq.addresses
                if rng.random() < 0.3:  # a padding row goes to the dummy slot
                    addrs = torch.cat([addrs, torch.tensor([-1])])
                run_stagewise(
                    pool, pool.config.group_of(layer), addrs, random_rows(gen, addrs.numel(), width), layer
                )
        elif op < 0.45 and seqs:
            seq = seqs.pop(rng.randrange(len(seqs)))
            release_against_reference(pool, seq)
        elif live:
            group = rng.randrange(pool.num_groups)
            cand = rng.sample(live, min(len(live), gpu, 12))
            q = rng.choice([1, 3])
            k = rng.randint(1, 5)
            sel = torch.tensor([[rng.choice([*cand, -1]) for _ in range(k)] for _ in range(q)])
            run_stagewise(pool, group, sel.reshape(-1), split=rng.random() < 0.5)
        pool.check_invariants()


def test_failed_call_stages_match_reference() -> None:
    """A released address fails the lookup; plan and apply then do nothing (and say so identically)."""
    pool = small_pool()
    seq = pool.admit(3)
    pool.release(seq)
    keep = pool.admit(2)
    run_stagewise(pool, 0, torch.tensor([keep.address_list[0], 4, 40, -1]))
    assert int(pool.internals().state.ctl[int(K.E_PENDING)]) & int(K.ST_BAD_ADDRESS)


def test_selection_spanning_chunks_matches_reference() -> None:
    """More elements than one CHUNK: per-chunk offsets, misses that straddle the free slots and
    the evictions, and duplicates across chunks."""
    pool = small_pool(gpu_slots=600, cpu_slots=700, bytes_per_layer=4, num_layers=1, layers_per_group=1)
    gen = torch.Generator().manual_seed(3)
    seq = pool.admit(1300)
    run_stagewise(pool, 0, seq.addresses, random_rows(gen, 1300, 4), 0)  # 600 on GPU, 700 on CPU
    sel = torch.cat([seq.addresses[500:1100], seq.addresses[500:1000]]).flip(0)  # dups across chunks
    run_stagewise(pool, 0, sel)
    pool.check_invariants()


@pytest.mark.parametrize(
    "tiling", [apply_mod.GPU_TILING, apply_mod.INTERPRETER_TILING], ids=["gpu-tile", "interp-tile"]
)
@pytest.mark.parametrize("policy", [ExactLRU(), PBLRU(3)], ids=["lru", "pblru3"])
def test_tiles_of_either_size_match_reference(tiling, policy, monkeypatch: pytest.MonkeyPatch) -> None:
    """The apply kernel at the GPU's tile height (8 rows) and the interpreter's (64), over miss
    counts that end mid-tile at both (82 written, 37 brought back past 6 hits): CI runs the GPU's
    tiling too, the only one a GPU runs."""
    monkeypatch.setattr(apply_mod, "TILING", tiling)
    pool = small_pool(
        gpu_slots=45, cpu_slots=60, bytes_per_layer=12, num_layers=2, layers_per_group=2, policy=policy
    )
    gen = torch.Generator().manual_seed(tiling.rows)
    seq = pool.admit(82)
    for layer in range(2):  # 45 on the GPU, 37 on the CPU after the first layer's write
        run_stagewise(pool, 0, seq.addresses, random_rows(gen, 82, 12), layer)
    resident = pool.residency(0, seq.addresses) >= 0
    back = seq.addresses[~resident]
    assert back.numel() == 37
    sel = torch.cat([back, seq.addresses[resident][:6], back[:4]]).view(1, -1)  # 37 misses, 6 hits
    run_stagewise(pool, 0, sel.reshape(-1), split=True)
    pool.check_invariants()


def few_program_slots(monkeypatch: pytest.MonkeyPatch, slots: int) -> None:
    """Persistent grids (apply's workers, classify's pool-wide lists) of ``slots`` programs, so
    that each program strides over several tiles or blocks, as on a GPU under a large call."""
    for module in (apply_mod, lookup_mod):
        monkeypatch.setattr(module, "program_slots", lambda device, kernel: slots)


@pytest.mark.parametrize("slots", [None, 3], ids=["slots-of-an-h200", "3-program-slots"])
@pytest.mark.parametrize("policy", [ExactLRU(), PBLRU(3)], ids=["lru", "pblru3"])
def test_element_tiles_across_chunks_match_reference(policy, slots, monkeypatch: pytest.MonkeyPatch) -> None:
    """At the GPU's tiling the chunk's elements are served by 4 programs of 256: a write and
    prepares of 1,331 elements (a chunk and a part, element tiles cut mid-way), hits, misses and
    duplicates in every element tile, some misses past the victims that fit (a write's entries
    that stay on the CPU), give the slots and LRU appends of their references word for word.
    With 3 program slots, each worker moves several tiles of misses."""
    monkeypatch.setattr(apply_mod, "TILING", apply_mod.GPU_TILING)
    if slots is not None:
        few_program_slots(monkeypatch, slots)
    pool = small_pool(
        gpu_slots=300, cpu_slots=900, bytes_per_layer=4, num_layers=1, layers_per_group=1, policy=policy
    )
    gen, rng = torch.Generator().manual_seed(17), random.Random(17)
    seq = pool.admit(1000)
    run_stagewise(pool, 0, seq.addresses[:700], random_rows(gen, 700, 4), 0)  # 300 on GPU, 400 on CPU
    for step in range(3):
        picks = [rng.randrange(1000 if step == 2 else 700) for _ in range(1331)]
        sel = seq.addresses[picks]
        if step == 2:  # a write of fresh and homed entries, duplicates refused: distinct picks
            fresh = torch.tensor(sorted(set(picks)), dtype=torch.long)
            run_stagewise(pool, 0, seq.addresses[fresh], random_rows(gen, fresh.numel(), 4), 0)
        else:
            run_stagewise(pool, 0, sel)
        pool.check_invariants()


def blocks_of(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Count rows of ``n`` chunks and blocks of ``n`` candidate segments (a power of two), so that
    a test-sized call spans several of each."""
    monkeypatch.setattr(K, "COUNT_BLOCK", tl.constexpr(n))
    monkeypatch.setattr(segments, "SEG_BLOCK", tl.constexpr(n))
    monkeypatch.setattr(segments, "LOG2_SEG_BLOCK", tl.constexpr(n.bit_length() - 1))


@pytest.mark.parametrize("block", [None, 2], ids=["one-block", "blocks-of-2"])
@pytest.mark.parametrize("policy", [ExactLRU(), PBLRU(3)], ids=["lru", "pblru3"])
def test_misses_found_across_many_chunks(policy, block, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decide finds each chunk's offsets from the count rows of the blocks before it and the
    counts before it in its block: a prepare of 5 chunks and a part (5,500 elements) whose chunks
    hold misses, only hits, only padding, misses again, so that several chunks start at the same
    miss; with blocks of 2 chunks (and of 2 ring segments), 3 blocks and a chunk alone in the
    last; 2 workers of 8-row tiles stride over the misses; plan and apply equal their references
    word for word."""
    monkeypatch.setattr(apply_mod, "TILING", apply_mod.GPU_TILING)
    few_program_slots(monkeypatch, 2)
    if block is not None:
        blocks_of(monkeypatch, block)
    pool = small_pool(
        gpu_slots=500, cpu_slots=900, bytes_per_layer=4, num_layers=1, layers_per_group=1, policy=policy
    )
    gen = torch.Generator().manual_seed(23)
    seq = pool.admit(1300)
    run_stagewise(pool, 0, seq.addresses, random_rows(gen, 1300, 4), 0)  # 500 on the GPU
    resident = pool.residency(0, seq.addresses) >= 0
    on_gpu, on_cpu = seq.addresses[resident], seq.addresses[~resident]
    pad = torch.full((1024,), -1, dtype=seq.addresses.dtype)
    hits = on_gpu[torch.arange(1024) % 60]
    sel = torch.cat(
        [on_cpu[:37], hits[:987], hits, pad, pad, on_cpu[37:90].repeat(20)[:1024], on_cpu[90:400]]
    )
    assert sel.numel() == 5 * 1024 + 310
    run_stagewise(pool, 0, sel)
    pool.check_invariants()


@pytest.mark.parametrize("block", [None, 2, 4], ids=["one-block", "blocks-of-2", "blocks-of-4"])
def test_victims_found_across_segment_blocks(block, monkeypatch: pytest.MonkeyPatch) -> None:
    """PB-LRU over 2,100 GPU slots lists 3 slot ranges in each of 4 buckets: with blocks of 2
    segments, 2 range blocks a bucket (the second holds one range and a padded slot), sealed by
    whichever of 3 programs arrives last; prepares that take victims from the cold bucket and from
    older rounds' buckets find each one by the two-level search. Plan and apply equal their
    references word for word, every block's seal included, and the arrivals are back at zero."""
    few_program_slots(monkeypatch, 3)
    if block is not None:
        blocks_of(monkeypatch, block)
    pool = small_pool(
        gpu_slots=2100, cpu_slots=1500, bytes_per_layer=4, num_layers=1, layers_per_group=1, policy=PBLRU(4)
    )
    gen, rng = torch.Generator().manual_seed(29), random.Random(29)
    seq = pool.admit(3000)
    run_stagewise(pool, 0, seq.addresses, random_rows(gen, 3000, 4), 0)  # 2,100 on the GPU
    summed = set()
    for step in range(4):
        picks = rng.sample(range(3000), 700 + 150 * step)
        run_stagewise(pool, 0, seq.addresses[picks])
        summed.add(int(pool.internals().state.ctl[int(K.E_SEG_BLOCKS)]))
        assert not pool.internals().runner.scratch(1).seg_arrivals.any()
        pool.check_invariants()
    if block == 2:
        assert max(summed) > 2, summed  # victims past the cold bucket's blocks


def test_lru_ring_compaction_matches_reference() -> None:
    """Re-touching the same GPU entries fills the ring with stale pairs until it compacts."""
    pool = small_pool(gpu_slots=3, cpu_slots=4, num_layers=1, layers_per_group=1)
    gen = torch.Generator().manual_seed(5)
    seq = pool.admit(5)
    run_stagewise(pool, 0, seq.addresses, random_rows(gen, 5, 6), 0)
    for step in range(6):
        sel = seq.addresses[[step % 5, (step + 1) % 5, (step + 3) % 5]].reshape(1, 3)
        run_stagewise(pool, 0, sel.reshape(-1))
        pool.check_invariants()


@pytest.mark.parametrize(
    ("split", "slots"),
    [(False, None), (True, None), (False, 1)],
    ids=["one-apply", "engine-split", "one-program-slot"],
)
def test_ring_compaction_across_blocks_matches_reference(split: bool, slots, monkeypatch) -> None:
    """A ring of 1,202 pairs (two blocks of CHUNK, 601 slots): hot entries touched again every call
    leave stale pairs and fresh picks take victims, so calls compact with the head inside a block,
    pairs dropped before it, the ring wrapped, and writes (whose round tail lies before the tail)
    between; each compacting call's plan and apply equal their references word for word. With one
    program slot, one classify program packs both blocks and one apply worker copies them."""
    if slots is not None:
        few_program_slots(monkeypatch, slots)
    pool = small_pool(gpu_slots=601, cpu_slots=420, bytes_per_layer=4, num_layers=1, layers_per_group=1)
    gen, rng = torch.Generator().manual_seed(11), random.Random(11)
    seq = pool.admit(1000)
    run_stagewise(pool, 0, seq.addresses, random_rows(gen, 1000, 4), 0)  # 601 on the GPU
    st, Qcap = pool.internals().state, pool.internals().state.q_slot.shape[1]
    hot = rng.sample(range(1000), 100)
    compacted, dropped, wrapped = 0, 0, False  # two-block compactions, with pairs dropped, across the end
    for step in range(24):
        span = [int(st.gctl[0, int(w)]) for w in (K.G_HEAD, K.G_TAIL)]
        upkeep = int(st.stats[int(K.S_ROUND_READS)])
        if step % 4 == 3:  # a write of entries on either tier: round tail < tail
            picks = rng.sample(range(1000), 37)
            rows = random_rows(gen, 37, 4)
            run_stagewise(pool, 0, seq.addresses[picks], rows, 0)
        else:
            picks = hot + rng.sample(range(1000), 51)
            run_stagewise(pool, 0, seq.addresses[picks], split=split)
        blocks, before_head = int(st.ctl[int(K.E_RING_BLOCKS)]), int(st.ctl[int(K.E_RING_DROPPED)])
        compacted += blocks == 2
        scanned = span[1] - span[0] if blocks else 0  # the policy's upkeep: every pair of the span
        assert int(st.stats[int(K.S_ROUND_READS)]) - upkeep == scanned
        dropped += blocks > 0 and before_head > 0
        wrapped |= blocks > 0 and span[0] // Qcap != (span[1] - 1) // Qcap  # scanned across the end
        pool.check_invariants()
    assert compacted >= 3 and dropped >= 3 and wrapped, (compacted, dropped, wrapped)


def test_epoch_wrap_clears_scratch_identically() -> None:
    pool = small_pool()
    seq = pool.admit(4)
    pool.internals().state.ctl[int(K.E_EPOCH)] = K.EPOCH_LIMIT - 1
    pool.internals().state.claim.fill_(123)
    run_stagewise(pool, 0, seq.addresses)
    assert int(pool.internals().state.ctl[int(K.E_EPOCH)]) == 1
    assert int(pool.internals().state.claim.sum()) == 0
    sel = pool.prepare(0, seq.addresses.reshape(2, 2))  # dedup still works after the reset
    assert sel.slots.unique().numel() == 4


@pytest.mark.parametrize("width", [5, 12, 656], ids=["5B-bytes", "12B-words", "656B-words"])
def test_gather_matches_reference(width) -> None:
    pool = small_pool(gpu_slots=3, cpu_slots=6, bytes_per_layer=width, num_layers=2, layers_per_group=2)
    gen = torch.Generator().manual_seed(width)
    seq = pool.admit(7)
    pool.write(1, seq.addresses[:5], random_rows(gen, 5, width))  # 2 of 7 never written: zeros
    st = pool.internals().state
    addrs = seq.addresses.flip(0)
    for layer in range(2):
        gpu, cpu = as_words(st.gpu_data[layer]), as_words(st.cpu_data[layer])
        got = gather_mod.gather(addrs, st.mapping[0], st.gpu_slots, gpu, cpu)
        assert torch.equal(got, gather_mod.gather_reference(addrs, st.mapping[0], st.gpu_slots, gpu, cpu))


def test_references_are_what_the_layout_runs() -> None:
    """The stage table the layout uses points at the kernels these tests exercise."""
    assert TRITON.plan is lookup_mod.lookup_and_plan
    assert TRITON.apply is apply_mod.apply


@pytest.mark.parametrize("policy", [ExactLRU(), PBLRU(3)], ids=["lru", "pblru3"])
def test_buffer_stages_match_reference(policy) -> None:
    """A striped rank's buffer (victims dropped, misses filled from fetched rows), whole and split
    the way an engine runs it, against the references."""
    cfg = pool_config(layout=Tiered(gpu_slots=9, cpu_slots=0, policy=policy))
    st = BufferState.allocate(cfg, addresses=40)
    st.mapping[:, :30] = -2  # 30 live addresses, none buffered yet
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    layout = TieredRunner(cfg, st)
    allocator = LogicalAllocator(40)
    allocator.take(30)
    for step in range(12):
        group = rng.randrange(2)
        picks = rng.sample(range(30), rng.randint(1, 9))
        flat = torch.tensor([rng.choice([*picks, -1]) for _ in range(12)])
        scratch = layout.scratch(12)
        poison(scratch)
        layers = cfg.group_layers(group)
        T = flat.numel()
        st_ref, sc_ref = st.clone(), scratch.clone()
        TRITON.plan(st, group, flat, scratch, False, len(layers) * 5, 5)
        REFERENCE.plan(st_ref, group, flat, sc_ref, False, len(layers) * 5, 5)
        assert_tensors_equal(st.tensors(), st_ref.tensors(), f"step {step} plan: state ")
        assert_tensors_equal(scratch.tensors(), sc_ref.tensors(), f"step {step} plan: scratch ")
        # Rows in home order, as an all-gather leaves them: miss j's is row fetch_rows[j] of twice
        # as many (the others are padding).
        fetched = random_rows(gen, 2 * T * len(layers), 5).view(2 * T, len(layers), 5)
        fetch_rows = torch.randperm(2 * T, generator=gen)[:T]
        slots, slots_ref = (
            torch.full((T,), POISON, dtype=torch.int32),
            torch.full((T,), POISON, dtype=torch.int32),
        )
        for phases, in_layers in apply_steps(layers, split=step % 2 == 1):
            for k, s, sc, out in ((TRITON, st, scratch, slots), (REFERENCE, st_ref, sc_ref, slots_ref)):
                k.apply(
                    s,
                    group,
                    sc,
                    flat,
                    layers,
                    None,
                    0,
                    out,
                    phases=phases,
                    in_layers=in_layers,
                    fetched=fetched,
                    fetch_rows=fetch_rows,
                )
            assert_tensors_equal(st.tensors(), st_ref.tensors(), f"step {step} apply{phases}: state ")
            assert torch.equal(slots, slots_ref)
        held = flat >= 0
        assert (slots[held] >= 0).all() and (slots[~held] == -1).all()
        # Miss j (chunk by chunk, in order) holds row fetch_rows[j] of the fetched rows, every layer.
        need = scratch.counts[: -(-T // K.CHUNK), int(K.C_NEED)].tolist()
        missed = [int(scratch.miss_pos[c * K.CHUNK + r]) for c, n in enumerate(need) for r in range(n)]
        for j, pos in enumerate(missed):
            for i, layer in enumerate(layers):
                got = st.gpu_data[layer, int(slots[pos])]
                assert torch.equal(got, fetched[int(fetch_rows[j]), i]), (step, j, layer)
        check_invariants(st, allocator)


def test_pblru_lists_candidates_only_when_a_victim_is_wanted() -> None:
    """PB-LRU's classify lists the pool's candidates only for a call with misses past the free
    slots: writes that fit the free slots read no leaf word; the write that overflows them lists
    every range (plan and apply still equal their references)."""
    pool = small_pool(
        gpu_slots=40, cpu_slots=60, bytes_per_layer=4, num_layers=1, layers_per_group=1, policy=PBLRU(3)
    )
    gen = torch.Generator().manual_seed(29)
    seq = pool.admit(90)
    reads = []
    for lo, hi in ((0, 25), (25, 40), (40, 90)):  # 25 and 15 fit the 40 free slots; then 50 more
        before = pool.stats()["victim_search_reads"]
        run_stagewise(pool, 0, seq.addresses[lo:hi], random_rows(gen, hi - lo, 4), 0)
        reads.append(pool.stats()["victim_search_reads"] - before)
    assert reads[:2] == [0, 0] and reads[2] > 0, reads
    pool.check_invariants()
