"""The ulakv command: capacity's explanations and figure, replay's table, JSON and figure, and the
occupancy of real pools after a replay (ulakv 1.0, striped local 1.0 over all ranks, striped fetch
and CPU offload below 1, Replicated 1/world)."""

from __future__ import annotations

import json

import pytest

from ulakv.cli import main

PNG = b"\x89PNG\r\n\x1a\n"
TINY = ["--requests", "3", "--prompt", "60", "90", "--steps", "4", "--topk", "16", "--groups", "1"]


def test_capacity_explains_its_assumptions_and_bytes(capsys, tmp_path) -> None:
    figure = tmp_path / "admitted.png"
    args = ["capacity", "--gpu", "h200", "--mode", "DP", "--spec", "on", "--explain", "--plot", str(figure)]
    assert main(args) == 0
    out = capsys.readouterr().out
    for needle in (
        "Assumptions",
        "published setting",
        "mem_fraction_static",
        "KV homes",
        "buffers",
        "staging_slots",
        "H200 DP",
        "pays: ",
        "a DCP group of one rank",
        "DCP: index keys",
        "distinct tokens on all ranks",
    ):
        assert needle in out
    for system in ("gpu_only", "cpu_offload", "dcp", "ulakv", "ulakv_local"):
        assert f"    {system} " in out  # a row of the byte breakdown each
    assert figure.read_bytes().startswith(PNG)


def test_capacity_table_compares_the_best_modes(capsys) -> None:
    """Five systems a configuration; the ratio is ulakv's better mode over the best baseline."""
    assert main(["capacity", "--gpu", "h200", "--mode", "TP", "--spec", "off"]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split()[1:6] == ["gpu_only", "cpu_offload", "dcp", "ulakv", "ulakv_local"]
    assert "best ulakv / best baseline" in header
    n = [int(x) for x in row.split()[4:9]]
    assert float(row.split()[-1].rstrip("x")) == pytest.approx(max(n[3:]) / max(n[:3]), abs=0.006)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["capacity", "--gpu", "a100"], "pick from"),
        (["capacity", "--world", "0"], "--world"),
        (["capacity", "--mem-fraction", "1.5"], "--mem-fraction"),
        (["replay", "--capacities", "0,x"], "--capacities"),
    ],
    ids=["gpu", "world", "fraction", "capacities"],
)
def test_bad_arguments_are_refused_clearly(capsys, args, says) -> None:
    assert main(args) == 2
    assert says in capsys.readouterr().err


@pytest.fixture(scope="module")
def replayed(tmp_path_factory) -> tuple[dict, bytes]:
    import contextlib
    import io

    figure = tmp_path_factory.mktemp("replay") / "hit_rate.png"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        args = [
            "replay",
            *TINY,
            "--capacities",
            "1,2",
            "--world",
            "4",
            "--json",
            "--no-progress",
            "--plot",
            str(figure),
        ]
        assert main(args) == 0
    return json.loads(out.getvalue()), figure.read_bytes()


def test_replay_reports_every_policy_and_layout(replayed) -> None:
    data, figure = replayed
    labels = {r["label"] for r in data["rows"]}
    assert labels == {"ulakv, exact_lru", "ulakv, pblru(8)", "CPU offload, per-request LRU"}
    for r in data["rows"]:
        if r["hit_rate"] is not None:
            assert 0 <= r["hit_rate"] <= r["belady_hit_rate"] <= 1
    assert figure.startswith(PNG)


def test_replay_occupancy_from_real_pools(replayed) -> None:
    data, _ = replayed
    by = {o["layout"]: o for o in data["occupancy"]}
    assert by["ulakv (Tiered)"]["distinct_per_slot"] == 1.0
    assert by["Replicated (world 4)"]["distinct_per_slot"] == 0.25
    offload = by["CPU offload"]
    assert 0 < offload["distinct_per_slot"] < 1
    assert offload["distinct_entries"] == by["ulakv (Tiered)"]["distinct_entries"]
    local = by["Striped local (world 2)"]  # every rank's slice together: one home each, no copies
    assert local["distinct_per_slot"] == 1.0
    assert local["distinct_entries"] == by["ulakv (Tiered)"]["distinct_entries"]
    fetch = by["Striped fetch (world 2)"]  # the same homes, and the buffers' copies of selections
    assert fetch["distinct_entries"] == local["distinct_entries"]
    assert 0 < fetch["distinct_per_slot"] < 1


def test_replay_prints_a_table(capsys) -> None:
    assert main(["replay", *TINY, "--capacities", "1.5", "--striped-world", "0", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "Belady" in out and "distinct/physical" in out and "MB in/step" in out


def test_plan_measures_the_working_set_on_a_given_trace(capsys, tmp_path) -> None:
    """A trace whose query positions overlap little has a larger union: fewer requests fit
    ulakv's buffers, and the count says where its number came from."""
    from ulakv.traces import SyntheticSpec, synthetic

    path = tmp_path / "wide.pt"
    synthetic(SyntheticSpec(requests=2, prompt=(3000, 4000), steps=3, topk=256, query_overlap=0.0)).save(path)
    args = ["capacity", "--gpu", "h200", "--mode", "TP", "--spec", "on", "--explain", "--trace", str(path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"measured on trace {path}" in out
    union = float(out.split("step working set")[1].split("union ")[1].split(" ")[0])
    assert union > 1.5  # three query positions that share no far picks


def test_a_comparison_counts_the_steps_it_runs_and_refuses_bad_capacities() -> None:
    """``SystemComparison`` (what ``ulakv replay`` runs): its ``steps`` are the progress bar's total,
    ticked exactly by ``run``; a quota too small for one request's selection is a row of ``None``."""
    from ulakv.comparison import SystemComparison
    from ulakv.errors import InvalidInputError
    from ulakv.traces import SyntheticSpec, synthetic

    trace = synthetic(SyntheticSpec(requests=3, prompt=(60, 90), steps=4, topk=16, groups=1))
    comparison = SystemComparison(trace, [1.0, 3.0], world=2)
    ticks = []
    rows, occupancy = comparison.run(on_step=ticks.append)
    assert sum(ticks) == comparison.steps == (6 + len(comparison.occupancy_runs)) * trace.horizon
    assert [r["label"].split(",")[0] for r in rows] == ["ulakv", "ulakv", "CPU offload"] * 2
    for run, r in zip(comparison.runs, rows, strict=True):
        assert (r["hit_rate"] is None) == (not run.fits)  # no quota holds one request's selection
    assert occupancy[0]["distinct_per_slot"] == 1.0 and occupancy[1]["distinct_per_slot"] == 0.5
    with pytest.raises(InvalidInputError, match="capacities"):
        SystemComparison(trace, [0.0])
