"""Every kernel specialisation the pool launches compiles to a Hopper (sm_90) cubin, and fits an SM.

The interpreter forgives type slips the GPU compiler rejects; this runs Triton's real compiler
pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin) in a subprocess, no GPU needed, and reads each
cubin's resources and its PTX's widest access back (``compile_check --json``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

KERNELS = [
    "apply_kernel",
    "census_kernel",
    "claim_kernel",
    "classify_kernel",
    "compact_kernel",
    "decide_kernel",
    "engine_addresses_kernel",
    "gather_kernel",
    "homes_kernel",
    "mark_live_kernel",
    "place_kernel",
    "release_kernel",
    "round_end_kernel",
    "slots_kernel",
]

# Resident warps an SM a memory-bound kernel needs at least to hide HBM latency (of 64 on sm_90).
# Every variant keeps them: apply at 8 warps over 8-row tiles, classify at 8 (exact LRU) or 16
# (PB-LRU) warps, release at 8 (``compile_check`` prints each variant's registers and warps).
WARP_FLOOR = 16


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    report = tmp_path_factory.mktemp("sm90") / "variants.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "ulakv.kernels.compile_check", "--arch", "90", "--json", str(report)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout, json.loads(Path(report).read_text())


def test_every_kernel_compiles_for_sm90(variants: tuple[str, list[dict]]) -> None:
    stdout, _ = variants
    assert f"compiled for sm_90: {', '.join(KERNELS)}" in stdout


def serving(found: list[dict]) -> list[dict]:
    """The variants a pool serves with: not ULAKV_DEBUG's (apply's claims of every home)."""
    return [v for v in found if "DEBUG=1" not in v["flags"]]


def test_no_variant_spills(variants: tuple[str, list[dict]]) -> None:
    """No serving variant spills (ULAKV_DEBUG's write variant of apply may: its claims are off the
    hot path)."""
    _, found = variants
    assert any("DEBUG=1" in v["flags"] for v in found), "the debug variants are compiled too"
    spilled = {(v["kernel"], v["registers"], v["stack_bytes"]) for v in serving(found) if v["stack_bytes"]}
    assert not spilled, f"variants with a stack frame (spilled registers): {sorted(spilled)}"


def test_rows_move_in_16_byte_vectors(variants: tuple[str, list[dict]]) -> None:
    """656-byte rows (41 x 16 B): every apply and gather variant that moves them loads and stores
    128 bits an access; byte rows of odd widths keep a narrower path."""
    _, found = variants
    wide = [v for v in found if v["vector_bytes"] == 16]
    assert {v["kernel"] for v in wide} == {"apply_kernel", "gather_kernel"}
    narrow = [(v["kernel"], v["widest_load_bits"], v["widest_store_bits"]) for v in wide]
    assert all(load == store == 128 for _, load, store in narrow), narrow


def test_every_kernel_keeps_enough_warps_resident(variants: tuple[str, list[dict]]) -> None:
    _, found = variants
    below = sorted(
        (v["kernel"], v["flags"], v["registers"], v["warps"], v["resident_warps"])
        for v in found
        if v["resident_warps"] < WARP_FLOOR
    )
    assert not below, (
        f"variants under {WARP_FLOOR} resident warps an SM "
        f"(kernel, flags, registers, warps, resident): {below}"
    )


# The kernels that move rows hide HBM latency with warps: apply (reading the plan's moves, no
# search) and gather keep 24 an SM or more (apply's tier variants 64-80 registers at 8 warps).
ROW_WARP_FLOOR = 24


def test_row_kernels_keep_more_warps_resident(variants: tuple[str, list[dict]]) -> None:
    _, found = variants
    below = sorted(
        (v["kernel"], v["flags"], v["registers"], v["resident_warps"])
        for v in found
        if v["kernel"] in ("apply_kernel", "gather_kernel") and v["resident_warps"] < ROW_WARP_FLOOR
    )
    assert not below, f"row-moving variants under {ROW_WARP_FLOOR} resident warps an SM: {below}"


def test_grid_footprints_are_the_cubins(variants: tuple[str, list[dict]]) -> None:
    """``kernels/grid.py`` sizes persistent grids and counts waves from each kernel's footprint:
    the variant an SM holds the fewest of, as the sm_90 cubins report it."""
    from ulakv.kernels.grid import FOOTPRINTS

    _, found = variants
    fewest: dict[str, tuple[int, dict]] = {}
    for v in serving(found):
        held = v["programs_per_sm"]
        if v["kernel"] not in fewest or held < fewest[v["kernel"]][0]:
            fewest[v["kernel"]] = (held, v)
    assert set(FOOTPRINTS) == set(KERNELS)
    for kernel, (held, v) in fewest.items():
        assert FOOTPRINTS[kernel].programs_per_sm == held, (kernel, FOOTPRINTS[kernel], v)
