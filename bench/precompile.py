"""Precompile vs compiling in the run: wall time to step N of a tiny SFT with torch_compile (Inductor).

Run from the repository root (about 10 minutes a round on 2 idle CPU cores):

    .venv/bin/python bench/precompile.py
    .venv/bin/python bench/precompile.py --rounds 3 --steps 8 --jobs 2

It prints a table and writes every figure to bench/results/precompile-<time>.json.

The run: recipes/tiny-sft.yaml on --dataset (default builtin:wide, the long-tailed sample) with
torch_compile on and Dynamo's Inductor backend, which compiles C++ for real on this CPU (seconds
per shape, as Neuron's compiler takes minutes), --steps steps and --set overrides (default: the
length-grouped batches padded to a multiple of 64 that the shape forecast suggests for it).
Two variants, each with an empty compile cache of its own (STUDIO_COMPILE_CACHE), alternated
A B, B A, ... over --rounds rounds:

    in-run       each new batch shape compiles at the step where it first appears, one after another
    precompile   studio.precompile with --jobs jobs: the shapes compile first, in parallel processes
                 on the run's core and the free ones, into the cache; the run then hits it

Figures per run: wall time from RunManager.start() to the `progress` event of step N (what the user
waits), the precompile's own seconds, the run's compile seconds, its compile_end events by cache
answer (hit / miss), and the distinct shapes. How it scales: the precompile's time is about
(shapes / jobs) x the compile time of one shape + one job's start-up (imports, model, data walk);
with one job per idle core it falls with the cores until there are as many jobs as shapes.

Noise: before each run the bench waits (up to 60 s) for 2 s in which other processes use under 0.3
cores and reports the cores they used during it (`others`, * over 0.3).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from common import REPO, BenchError, Noise, ok, run_bench, run_until_final, tail, wait_quiet  # sets sys.path
from studio_core.data.builtin import ensure_tiny_model
from studio_core.machine.hardware import cpu_hardware
from studio_core.rundir.events import read as read_events
from studio_core.runs.manager import RunManager
from studio_core.recipe.spec import RunSpec
from studio_core.recipe.validate import validated

RECIPE = REPO / "recipes" / "tiny-sft.yaml"
SUGGESTED = ["train_sampling_strategy=group_by_length", "pad_to_multiple_of=64", "max_length=1024"]
QUIET_WAIT_S, QUIET_CORES = 60, 0.3
RUN_TIMEOUT_S = 1800


def variant_spec(args, precompile: bool) -> RunSpec:
    overrides = [f"dataset_name={args.dataset}", f"max_steps={args.steps}", "torch_compile=true",
                 "torch_compile_backend=inductor", *args.set]
    if precompile:
        overrides += ["studio.precompile=true", f"studio.precompile_jobs={args.jobs}"]
    return validated(RunSpec.load(RECIPE).with_overrides(overrides))


def one_run(work: Path, name: str, round_: int, args) -> dict:
    cache = work / f"cache-{name}-{round_}"
    os.environ["STUDIO_COMPILE_CACHE"] = str(cache)  # empty: the plan points the run (and its jobs) at it
    manager = RunManager(work / "runs")
    gate = wait_quiet(QUIET_WAIT_S, QUIET_CORES)
    noise = Noise()
    t0 = time.time()
    view, state, _ = run_until_final(manager, variant_spec(args, name == "precompile"), cpu_hardware(), RUN_TIMEOUT_S)
    others = noise.others_cores()
    if state != "finished":
        raise BenchError(f"{name} run {view.id} ended {state}: {view.error_text}\n{tail(view.dir / 'train.log')}")
    events = read_events(view.dir / "events.jsonl")
    step_n = next(e for e in events if e["type"] == "progress" and e["step"] == args.steps)
    first = next(e for e in events if e["type"] == "progress")
    ends = [e for e in events if e["type"] == "compile_end"]
    pre = view.precompile or {}
    return {"variant": name, "round": round_, "run_id": view.id, "quiet_gate": gate, "others": others,
            "to_step_n_s": step_n["time"] - t0, "to_step_1_s": first["time"] - t0,
            "precompile_s": pre.get("seconds"), "precompile_shapes": pre.get("total"),
            "precompiled": [{k: d.get(k) for k in ("shape", "job", "seconds", "cache")} for d in pre.get("done", [])],
            "run_compile_s": sum(e.get("seconds", 0.0) for e in ends), "compiles": len(ends),
            "hits": sum(e.get("cache") == "hit" for e in ends), "misses": sum(e.get("cache") == "miss" for e in ends),
            "backward_compiles": sum(e["phase"] == "backward" for e in ends),
            "shapes": [e["shape"] for e in events if e["type"] == "shape"]}


def measure(work: Path, args, report: dict) -> None:
    ensure_tiny_model()
    report["settings"] = {"recipe": str(RECIPE.relative_to(REPO)), "dataset": args.dataset, "steps": args.steps,
                          "jobs": args.jobs, "set": args.set, "cpus": os.cpu_count()}
    rows = report["runs"] = []
    for round_ in range(args.rounds):
        order = ("in-run", "precompile") if round_ % 2 == 0 else ("precompile", "in-run")
        for name in order:
            print(f"[bench] round {round_ + 1}: {name} ...", flush=True)
            rows.append(one_run(work, name, round_, args))
            row = rows[-1]
            print(f"[bench]   to step {args.steps}: {row['to_step_n_s']:.1f} s; precompile {row['precompile_s']}; "
                  f"run compiles {row['compiles']} ({row['hits']} hit, {row['misses']} miss) in "
                  f"{row['run_compile_s']:.1f} s; others {row['others']:.2f} cores", flush=True)
    summary = {}
    for name in ("in-run", "precompile"):
        times = [r["to_step_n_s"] for r in rows if r["variant"] == name]
        summary[name] = {"median_to_step_n_s": statistics.median(times), "min": min(times), "max": max(times)}
    ratios = [a["to_step_n_s"] / b["to_step_n_s"] for a, b in zip(
        [r for r in rows if r["variant"] == "in-run"], [r for r in rows if r["variant"] == "precompile"])]
    summary["speedup_per_round"] = ratios
    summary["median_speedup"] = statistics.median(ratios)
    report["summary"] = summary


def print_report(report: dict) -> None:
    rows = report.get("runs", [])
    if not rows:
        return
    steps = report["settings"]["steps"]
    print(f"\n{'variant':<11} {'round':>5} {'to step ' + str(steps):>11} {'step 1':>8} {'precomp.':>9} "
          f"{'run comp.':>9} {'hit':>4} {'miss':>4} {'bwd':>4} {'shapes':>6} {'others':>7}")
    for r in rows:
        mark = "*" if r["others"] > QUIET_CORES else " "
        pre = f"{r['precompile_s']:.1f}" if r["precompile_s"] is not None else "-"
        print(f"{r['variant']:<11} {r['round'] + 1:>5} {r['to_step_n_s']:>10.1f}s {r['to_step_1_s']:>7.1f}s "
              f"{pre:>9} {r['run_compile_s']:>8.1f}s {r['hits']:>4} {r['misses']:>4} {r['backward_compiles']:>4} "
              f"{len(r['shapes']):>6} {r['others']:>6.2f}{mark}")
    s = report.get("summary")
    if s:
        print(f"\nmedian wall time to step {steps}: in-run {s['in-run']['median_to_step_n_s']:.1f} s "
              f"({s['in-run']['min']:.1f}-{s['in-run']['max']:.1f}), precompile "
              f"{s['precompile']['median_to_step_n_s']:.1f} s ({s['precompile']['min']:.1f}-"
              f"{s['precompile']['max']:.1f}); speedup per round "
              f"{', '.join(f'{x:.2f}' for x in s['speedup_per_round'])}, median {s['median_speedup']:.2f} "
              f"{ok(s['median_speedup'] > 1)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="N: the step whose wall time is compared")
    parser.add_argument("--jobs", type=int, default=2, help="precompile jobs")
    parser.add_argument("--dataset", default="builtin:wide")
    parser.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                        help=f"recipe overrides (default: {' '.join(SUGGESTED)})")
    parser.add_argument("--keep", action="store_true", help="keep the runs and caches")
    args = parser.parse_args()
    args.set = SUGGESTED if args.set is None else args.set
    return run_bench("precompile", args, measure, print_report)


if __name__ == "__main__":
    raise SystemExit(main())
