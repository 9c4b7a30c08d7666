"""The ``ulakv`` command: ``capacity`` (admitted requests per system), ``replay``
(a trace through every policy and layout), ``demo`` (the main job: three systems side by side)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .capacity import (
    BASELINES,
    SGLANG_BASELINES,
    SGLANG_ULAKV,
    ULAKV_MODES,
    Scenario,
    default_selection_shape,
    fit_systems,
    measure_selection_shape,
)
from .presets import HARDWARE, MODELS

# -- ulakv capacity -----------------------------------------------------------------------------


def _choices(text: str, allowed: Sequence[str], what: str) -> list[str]:
    picked = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in picked if t not in allowed]
    if bad or not picked:
        raise argparse.ArgumentTypeError(f"{what}: pick from {', '.join(allowed)} (comma-separated)")
    return picked


def _gb(n: float) -> str:
    return f"{n:8.1f}"


def _check_numbers(args: argparse.Namespace) -> None:
    if getattr(args, "world", 1) < 1:
        raise argparse.ArgumentTypeError("--world: at least 1")
    if not 0 < getattr(args, "mem_fraction", 0.5) <= 1:
        raise argparse.ArgumentTypeError("--mem-fraction: a fraction in (0, 1]")
    if getattr(args, "quota", 1) < 1:
        raise argparse.ArgumentTypeError("--quota: at least 1")


# ``--systems``: which systems a table compares, and which of them are ulakv's.
SYSTEM_SETS = {"ulakv": (BASELINES, ULAKV_MODES), "sglang": (SGLANG_BASELINES, SGLANG_ULAKV)}


def run_capacity(args: argparse.Namespace) -> int:
    _check_numbers(args)
    theirs, ours = SYSTEM_SETS[args.systems]
    systems = theirs + ours
    gpus = _choices(args.gpu.lower(), list(HARDWARE), "--gpu")
    modes = [m.upper() for m in _choices(args.mode.upper(), ["TP", "DP"], "--mode")]
    specs = [s == "on" for s in _choices(args.spec, ["on", "off"], "--spec")]
    if args.trace or args.sglang:  # the working set measured on the user's own selections
        trace, described = _load_trace(args)
        measured = measure_selection_shape(trace, args.world, f"measured on {described}")
        shapes = dict.fromkeys(specs, measured)
    else:
        shapes = {spec: default_selection_shape(spec, args.world) for spec in set(specs)}
    fits = []
    for gpu in gpus:
        for mode in modes:
            for spec in specs:
                scenario = Scenario(
                    MODELS[args.model],
                    HARDWARE[gpu],
                    mode,
                    spec,
                    world=args.world,
                    mem_fraction_static=args.mem_fraction,
                    slots_per_request=args.quota,
                    shape=shapes[spec],
                )
                fits.append(fit_systems(scenario, systems))
    rows = [row for p in fits for row in p.rows(explain=args.explain)]
    if args.plot:
        from .plots import admitted_bars

        title = f"{MODELS[args.model].name}: requests of 64K-128K tokens admitted at once, equal memory"
        admitted_bars(rows, args.plot, title)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    common = fits[0].scenario.assumptions()
    if args.explain:
        print("Assumptions (value, source); each configuration below lists those it changes:")
        for what, value, source in common:
            print(f"  {what:28s} {value:40s} {source}")
        print()
    width = max(12, *(len(s) for s in systems))
    header = (
        f"{'config':22s} " + " ".join(f"{s:>{width}s}" for s in systems) + "   best ulakv / best baseline"
    )
    print(header)
    for p in fits:
        sc = p.scenario
        name = f"{sc.hardware.name} {sc.mode} spec {'on' if sc.spec else 'off'}"
        n = {s: p.systems[s].admitted for s in systems if s in p.systems}
        print(f"{name:22s} " + " ".join(f"{n[s]:{width}d}" for s in n) + f"   {_ratio(p, ours, theirs):>10s}")
        if args.explain:
            for what, value, source in p.scenario.assumptions():
                if (what, value, source) not in common:
                    print(f"    {what:26s} {value:40s} {source}")
            _explain(p, ours, theirs)
    return 0


def _ratio(p, ours_among: tuple[str, ...] = ULAKV_MODES, theirs_among: tuple[str, ...] = BASELINES) -> str:
    """ulakv's best mode over the best baseline, in requests admitted."""
    ours, theirs = p.best(ours_among), p.best(theirs_among)
    if ours is None or theirs is None:
        return "-"
    return "inf" if not theirs.admitted else f"{ours.admitted / theirs.admitted:.2f}x"


def _explain(p, ours_among: tuple[str, ...] = ULAKV_MODES, theirs_among: tuple[str, ...] = BASELINES) -> None:
    """Bytes per GPU behind each number (GB), what each system pays, and where the ratio of the
    best ulakv mode to the best baseline comes from."""
    sc = p.scenario
    print(
        f"    per GPU: {sc.hardware.hbm_bytes / 1e9:.0f} GB x static fraction {sc.mem_fraction_static} "
        f"- weights {sc.weights_per_gpu() / 1e9:.1f} GB = {sc.kv_budget() / 1e9:.1f} GB for KV; "
        f"CPU {sc.hardware.cpu_bytes / 1e9:.0f} GB"
    )
    print(
        f"    {'GB a GPU':12s} {'KV homes':>8s} {'buffers':>8s} {'index':>8s} {'meta':>8s} {'CPU rows':>8s} "
        f"{'staging':>8s} {'M tokens':>8s}  what stops one more request; pools; what it pays"
    )
    for name, s in p.systems.items():
        b = s.bytes_per_gpu
        ranks = ""
        if len(s.per_rank) > 1:
            ranks = f" ({len(s.per_rank)} ranks: {min(s.per_rank)}-{max(s.per_rank)} each)"
        print(
            f"    {name:12s} {_gb(b.gpu_rows / 1e9)} {_gb(b.gpu_buffers / 1e9)} {_gb(b.gpu_index / 1e9)} "
            f"{_gb(b.gpu_meta / 1e9)} {_gb(b.cpu_rows / 1e9)} {_gb(b.cpu_staging / 1e9)} "
            f"{_gb(s.held / 1e6)}  {s.limit}{ranks}"
        )
        for pool in s.pools:
            print(f"    {'':12s} {pool}")
        print(f"    {'':12s} pays: {s.pays}")
    ours, theirs = p.best(ours_among), p.best(theirs_among)
    if ours is None or theirs is None or not theirs.held:
        return
    a, b = ours.bytes_per_gpu, theirs.bytes_per_gpu
    print(
        f"    {ours.system} / {theirs.system} = {_ratio(p, ours_among, theirs_among)} the requests: "
        "their latent pools admit "
        f"{ours.held / 1e6:.1f} M vs {theirs.held / 1e6:.1f} M distinct tokens on all ranks "
        f"({ours.held / theirs.held:.2f}x; M tokens above); a GPU's KV rows: {a.gpu_rows / 1e9:.1f} GB GPU + "
        f"{a.cpu_rows / 1e9:.1f} GB CPU vs {b.gpu_rows / 1e9:.1f} GB GPU + {b.cpu_rows / 1e9:.1f} GB CPU"
    )


# -- ulakv replay -------------------------------------------------------------------------------


def _load_trace(args: argparse.Namespace):
    import torch

    from .traces import SyntheticSpec, Trace, synthetic

    if args.trace:
        return Trace.load(args.trace), f"trace {args.trace}"
    if args.sglang:
        dumps = torch.load(args.sglang, weights_only=True)
        return Trace.from_sglang(list(dumps)), f"SGLang indexer_topk {args.sglang}"
    spec = SyntheticSpec(
        requests=args.requests,
        prompt=(args.prompt[0], args.prompt[1]),
        steps=args.steps,
        topk=args.topk,
        queries=args.queries,
        groups=args.groups,
        seed=args.seed,
    )
    return synthetic(spec), (
        f"synthetic: {spec.requests} requests, prompts {spec.prompt[0]}-{spec.prompt[1]}, {spec.steps} "
        f"steps, top-{spec.topk}, {spec.queries} query positions, {spec.groups} groups, seed {spec.seed}"
    )


def run_replay(args: argparse.Namespace) -> int:
    from .comparison import SystemComparison

    trace, described = _load_trace(args)
    _check_numbers(args)
    try:
        capacities = [float(c) for c in args.capacities.split(",")]
    except ValueError:
        capacities = []
    if not capacities or min(capacities) <= 0:
        raise argparse.ArgumentTypeError("--capacities: positive multiples, comma-separated (e.g. 1,2,4)")
    comparison = SystemComparison(
        trace,
        capacities,
        buckets=args.buckets,
        backend=args.backend,
        world=args.world,
        striped_world=args.striped_world,
    )
    bar = _progress(args, comparison.steps)
    rows, occupancy = comparison.run(on_step=bar.update)
    bar.close()
    if args.plot:
        from .plots import hit_rate_curves

        hit_rate_curves(rows, args.plot, f"hit rate vs GPU capacity ({described.split(':')[0]})")
    if args.json:
        print(json.dumps({"trace": described, "rows": rows, "occupancy": occupancy}, indent=1))
        return 0
    print(described)
    print(
        f"one step's working set: {comparison.working} distinct positions a group; {comparison.alive} "
        f"requests at most at once; CPU-offload quota = GPU slots / {comparison.alive} (needs >= "
        f"{comparison.per_request})"
    )
    print(f"{'x ws':>5s} {'slots':>6s}  {'system':30s} {'hit rate':>8s} {'Belady':>7s} {'MB in/step':>10s} "
          f"{'MB out/step':>11s}")  # fmt: skip
    for r in rows:
        hit = f"{100 * r['hit_rate']:7.2f}%" if r["hit_rate"] is not None else "  no fit"
        belady = f"{100 * r['belady_hit_rate']:6.2f}%" if r["belady_hit_rate"] is not None else ""
        mb_in = f"{r['bytes_in_per_step'] / 1e6:10.3f}" if r["hit_rate"] is not None else ""
        mb_out = f"{r['bytes_out_per_step'] / 1e6:11.3f}" if r["hit_rate"] is not None else ""
        print(f"{r['x']:5.2f} {r['gpu_slots']:6d}  {r['label']:30s} {hit:>8s} {belady:>7s} {mb_in} {mb_out}")
    print(f"\nreal pools at {comparison.x_mid} x working set, at the step they held most (all ranks):")
    print(f"  {'layout':24s} {'distinct':>9s} {'physical':>9s} {'distinct/physical':>18s} {'hit rate':>9s}")
    for o in occupancy:
        print(
            f"  {o['layout']:24s} {o['distinct_entries']:9d} {o['physical_slots']:9d} "
            f"{o['distinct_per_slot']:18.4f} {100 * o['hit_rate']:8.2f}%"
        )
    return 0


def _progress(args: argparse.Namespace, total: int):
    from tqdm import tqdm

    return tqdm(
        total=total, unit="step", desc="replay", disable=args.no_progress, file=sys.stderr, leave=False
    )


# -- the command --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ulakv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "capacity",
        help="requests each system admits, from real pools on the meta device",
    )
    p.add_argument("--model", choices=sorted(MODELS), default="glm-5.3")
    p.add_argument("--gpu", default="h200,b300", help="h200,b300")
    p.add_argument("--mode", default="TP,DP", help="TP,DP")
    p.add_argument("--spec", default="on,off", help="speculative decoding: on,off")
    p.add_argument("--world", type=int, default=8, help="GPUs (default 8)")
    p.add_argument("--mem-fraction", type=float, default=0.88, help="the engine's static memory fraction")
    p.add_argument("--quota", type=int, default=4096, help="CPU-offload GPU entries a request and layer")
    p.add_argument("--json", action="store_true", help='a list of {"gpu","mode","spec","system","admitted"}')
    p.add_argument("--explain", action="store_true", help="assumptions with sources, bytes per GPU")
    p.add_argument("--plot", metavar="FILE.png", help="admitted requests as grouped bars")
    p.add_argument(
        "--trace", metavar="FILE", help="measure one step's working set on this saved trace (Trace.save)"
    )
    p.add_argument("--sglang", metavar="FILE", help="... or on torch.save'd SGLang indexer_topk tensors")
    p.add_argument(
        "--systems",
        choices=sorted(SYSTEM_SETS),
        default="ulakv",
        help="ulakv: the five systems; sglang: GPU only, HiSparse, SGLang's DCP, and SGLang's DCP over ulakv",
    )
    p.set_defaults(run=run_capacity)

    r = sub.add_parser("replay", help="a selection trace through every policy and layout")
    r.add_argument("--trace", metavar="FILE", help="a trace saved by ulakv.traces.Trace.save")
    r.add_argument("--sglang", metavar="FILE", help="torch.save'd list of SGLang indexer_topk tensors")
    r.add_argument("--requests", type=int, default=6)
    r.add_argument("--prompt", type=int, nargs=2, default=(600, 1200), metavar=("LO", "HI"))
    r.add_argument("--steps", type=int, default=16)
    r.add_argument("--topk", type=int, default=128)
    r.add_argument("--queries", type=int, default=3)
    r.add_argument("--groups", type=int, default=2)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument(
        "--capacities", default="1,1.25,1.5,2,3,4", help="GPU slots as multiples of the working set"
    )
    r.add_argument("--buckets", type=int, default=8, help="PB-LRU ring size")
    r.add_argument("--world", type=int, default=8, help="ranks of the Replicated layout")
    r.add_argument(
        "--striped-world",
        type=int,
        default=2,
        help="also replay a Striped pool on this many gloo processes (0: skip)",
    )
    r.add_argument(
        "--backend",
        choices=["model", "pool"],
        default="model",
        help="hit-rate curves from the policies' plain models (same decisions, fast) or the kernels",
    )
    r.add_argument("--json", action="store_true")
    r.add_argument("--plot", metavar="FILE.png", help="hit rate vs GPU capacity with the Belady bound")
    r.add_argument("--no-progress", action="store_true")
    r.set_defaults(run=run_replay)

    sub.add_parser("demo", help="the main job: three systems side by side (see `ulakv demo --help`)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        from . import demo

        return demo.main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except argparse.ArgumentTypeError as exc:
        print(f"ulakv: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
