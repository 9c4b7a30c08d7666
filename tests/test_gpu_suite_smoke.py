"""The one-shot GPU suite cannot rot: its smoke run (every section, tiny sizes; the interpreter on
CPU) must pass, correctness section included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def smoke_run(tmp_path: Path, *args: str) -> dict:
    """Run the suite at smoke sizes with ``args``; its results (the JSON it wrote)."""
    out = tmp_path / "smoke.json"
    suite = str(ROOT / "benchmarks" / "gpu_suite.py")
    done = subprocess.run(
        [sys.executable, suite, "--smoke", *args, "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def test_gpu_suite_smoke(tmp_path: Path) -> None:
    results = smoke_run(tmp_path)
    assert results["errors"] == {}
    assert [row["result"] for row in results["correctness"]] == ["bit-identical"] * 2
    scale = results["correctness_at_scale"]
    assert [row["result"] for row in scale] == ["bit-identical"] * 2
    assert scale[0]["ring_compactions"] >= 1 and all(row["victims"] > 0 for row in scale)
    assert all(0 < row["clean_evictions"] < row["victims"] for row in scale)
    assert all(row["bitmap_levels"] >= 3 and row["elements"] >= 2 * 1024 for row in scale)
    assert {"d2d_GBps", "pinned_h2d_GBps"} <= results["ceilings"].keys()
    assert {row["tier"] for row in results["gather"]} == {"gpu", "cpu"}
    assert all(row["victims_per_prepare"] > 0 for row in results["swap_in"])
    cases = {(row["case"], row["policy"]) for row in results["prepare"]}
    # claim, classify, apply; PB-LRU's round end between the last two
    launches = {row["policy"]: row["launches"] for row in results["prepare"]}
    assert len(cases) == 4 and launches == {"ExactLRU()": 4, "PBLRU(num_buckets=8)": 5}, launches
    assert all(row["victims_per_step"] == 0 for row in results["prepare"] if row["case"] == "fits")
    assert all({"gpu_us", "longest_kernel"} <= row.keys() for row in results["prepare"])
    widths = results["vector_widths"]
    assert {row["case"] for row in widths} == {"gather gpu", "gather cpu", "swap-in"}
    assert all(row["us_16B"] > 0 and row["us_4B"] > 0 for row in widths)
    assert results["compiled"] == []  # the loader's figures exist only on a GPU
    assert results["graph"]["eager_us"] > 0
    assert [row["attention"] for row in results["striped_graph"]] == ["fetch", "local"]
    steps = results["whole_step"]  # a step's calls apart, then one plan a group: fewer launches
    assert [row["calls"] for row in steps] == ["write + prepare", "one plan"]
    assert steps[1]["launches"] < steps[0]["launches"]
    (dcp,) = results["dcp"]  # every rank's rows against SGLang's transform, the GPU cache evicting
    assert dcp["ranks"] == 4 and dcp["rows_checked"] > 0 and dcp["victims"] > 0
    requests = results["requests"]
    assert len(requests) == 6 and all(row["us"] > 0 and row["groups"] == 3 for row in requests)


def test_gpu_suite_runs_the_sections_asked_for(tmp_path: Path) -> None:
    results = smoke_run(tmp_path, "--only", "gather")
    assert {"ceilings", "gather"} <= results.keys() and "correctness" not in results
