"""Every kernel specialisation the pool launches compiles to a Hopper (sm_90) cubin.

The interpreter forgives type slips the GPU compiler rejects; this runs Triton's real compiler
pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin) in a subprocess, no GPU needed.
"""

from __future__ import annotations

import os
import subprocess
import sys

KERNELS = [
    "_search_kernel",
    "apply_kernel",
    "claim_kernel",
    "classify_kernel",
    "compact_kernel",
    "engine_addresses_kernel",
    "gather_kernel",
    "mark_live_kernel",
    "release_kernel",
]


def test_every_kernel_compiles_for_sm90() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "ulakv.kernels.compile_check", "--arch", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"compiled for sm_90: {', '.join(KERNELS)}" in done.stdout
