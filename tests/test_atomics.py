"""Same-address atomics: PB-LRU's summary words are touched only when a word below turns
non-empty, so the hits of a round do not all end on their bucket's one top word."""

from __future__ import annotations

from collections import Counter

import pytest

from tools.critical_path import count_memory_ops
from ulakv import PBLRU, EntrySpec, Pool, PoolConfig, Tiered
from ulakv.kernels import common as K
from ulakv.kernels.buckets import level_offsets

GPU_SLOTS = 4096  # 128 leaf words, 4 level-1 words, one top word a bucket
BUCKETS = 4


def word_address(pool, bucket: int, word: int) -> int:
    st = pool.internals().state
    return st.bits[0].data_ptr() + 4 * (bucket * st.bucket_words + word)


@pytest.mark.parametrize("hits", [3000, 37], ids=["3000-hits", "37-hits"])
def test_a_round_of_hits_sets_each_summary_word_once(hits: int) -> None:
    pool = Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=4),
            num_layers=1,
            layers_per_group=1,
            layout=Tiered(gpu_slots=GPU_SLOTS, cpu_slots=16, policy=PBLRU(BUCKETS)),
        )
    )
    seq = pool.admit(hits)
    selection = seq.addresses.view(1, -1)
    pool.prepare(0, selection)  # every entry in, stamped round 1
    with count_memory_ops() as launches:
        pool.prepare(0, selection)  # every entry a hit: all move to round 2's bucket
    touched = sum((launch.atomic_lanes for launch in launches), Counter())
    offsets = level_offsets(GPU_SLOTS)
    bucket = int(pool.internals().state.gctl[0, int(K.G_ROUND)]) % BUCKETS
    leaf_words = -(-hits // 32)
    # Every hit sets its leaf bit once, each leaf word that turns non-empty its level-1 bit once,
    # each level-1 word that does the top bit once.
    leaf = sum(touched[word_address(pool, bucket, w)] for w in range(offsets[1]))
    level1 = sum(touched[word_address(pool, bucket, offsets[1] + w)] for w in range(offsets[2] - offsets[1]))
    top = touched[word_address(pool, bucket, offsets[2])]
    assert leaf == hits
    assert level1 == leaf_words
    assert top == -(-leaf_words // 32)
    pool.check_invariants()  # and the summaries still match the words below
