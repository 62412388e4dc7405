"""Compilations end to end on a wide spread of lengths: TRL's default vs the forecast's best suggestion.

Run from the repository root (about 15 minutes on 2 CPU cores shared with others; each new batch
shape costs the Inductor backend about a minute of compiling here):

    .venv/bin/python bench/wide_compile.py
    .venv/bin/python bench/wide_compile.py --max-steps 6 --rounds 2

It prints a side-by-side table and writes every figure to bench/results/wide_compile-<time>.json.

The runs: recipes/tiny-sft.yaml on builtin:wide (2,000 conversations of 20 to 2,000 tokens, a
long right tail), max_length 1024 (the tiny model's max_position_embeddings; it cuts the tail),
batch 4, --max-steps N steps, torch_compile on with the Inductor backend: it generates and
compiles C++ kernels for real, so a new batch shape costs seconds to minutes here as it costs
minutes on Neuron. Two variants, through RunManager.start() like a click on Start:

    default     TRL's default: each batch padded to its longest sample, in random order
    suggested   the forecast's best suggestion for the default's spec (studio_core/training/forecast.py,
                run as the page and `launch.py plan` run it), applied as --set overrides

Each run gets a compile cache of its own (STUDIO_COMPILE_CACHE in a fresh folder): every run
compiles from cold, as a first run on Trainium does. Compared, per run:
- shapes: the forecast's distinct batch shapes vs those the run's `shape` events saw; they must
  be equal (the bench fails otherwise).
- compilations (compile_end events, forward and backward) and their seconds; `limit hits`: the
  times Dynamo logged "hit config.recompile_limit" (8 per frame by default): past it a frame runs
  eagerly (uncompiled) for new shapes, which hides compile cost on the CPU and on Trainium means
  running uncompiled. N is chosen so the default stays at or under it.
- tokens/s without compilation: real tokens of steps 2..N over their step times (the worker's
  step_s, compile time taken out).
- wall to step N: from the start call (spec check, plan, supervisor, torchrun, model and data
  loading) to the time of step N's progress event: what the user waits.

Noise: before each run the bench waits (up to 30 s) for 2 s in which other processes use under 0.3
cores, and reports the cores they used during the run (`others`, * when over 0.3). With --rounds R
the two variants alternate (default first in odd rounds, suggested first in even ones) and the
table gives each variant's median and spread (min-max) of the wall time and the ratio of medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from common import REPO, BenchError, Noise, run_bench, run_until_final, tail, wait_quiet  # sets sys.path
from studio_core.data.builtin import WIDE_DATASET, ensure_tiny_model, ensure_wide_sample
from studio_core.training.forecast import forecast_in_subprocess
from studio_core.machine.hardware import cpu_hardware
from studio_core.rundir.events import read as read_events
from studio_core.runs.manager import RunManager
from studio_core.recipe.spec import RunSpec, SpecError
from studio_core.recipe.validate import validated

RECIPE = REPO / "recipes" / "tiny-sft.yaml"
QUIET_WAIT_S, QUIET_CORES = 30, 0.3
RUN_TIMEOUT_S = 1800
LIMIT_HIT = "hit config.recompile_limit"  # Dynamo's warning when a frame stops compiling new shapes


def base_spec(args) -> RunSpec:
    return validated(RunSpec.load(RECIPE).with_overrides([
        f"dataset_name={WIDE_DATASET}", "max_length=1024", f"max_steps={args.max_steps}", "logging_steps=5",
        "torch_compile=true", f"torch_compile_backend={args.backend}"]))


def forecast_of(manager: RunManager, spec: RunSpec):
    t0 = time.monotonic()
    try:
        result = forecast_in_subprocess(manager.plan(spec, cpu_hardware()).spec, "cpu")
    except SpecError as error:
        raise BenchError(str(error)) from error
    return result, time.monotonic() - t0


def observed(view, started: float, steps: int) -> dict:
    """What the run's events say: shapes, compilations, limit hits, speed without compiling, wall to step N."""
    progress = [e for e in read_events(view.dir / "events.jsonl") if e["type"] == "progress" and "step_s" in e]
    later = progress[1:]  # step 1 also loads and warms up
    seconds = sum(e["step_s"] for e in later)
    last = next((e for e in progress if e.get("step") == steps), None)
    log = (view.dir / "train.log").read_text(errors="replace") if (view.dir / "train.log").exists() else ""
    forward = [c for c in view.compiles if c["phase"] == "forward"]
    return {
        "run_id": view.id,
        "shapes": sorted({tuple(e["shape"]) for e in view.shapes}),
        "compiles_forward": len(forward),
        "compiles_backward": len(view.compiles) - len(forward),
        "compile_seconds": view.compile_seconds(),
        "limit_hits": log.count(LIMIT_HIT),
        "tokens": view.tokens,
        "tokens_per_s": sum(e.get("tokens", 0) for e in later) / seconds if seconds else None,
        "wall_to_step_s": last["time"] - started if last else None,
        "run_wall_s": view.duration(),
    }


def run_variant(manager: RunManager, work, name: str, spec: RunSpec, forecast, round_no: int) -> dict:
    os.environ["STUDIO_COMPILE_CACHE"] = str(work / f"compile-cache-{name}-{round_no}")  # read by the plan
    row = {"variant": name, "round": round_no, "quiet_gate": wait_quiet(QUIET_WAIT_S, QUIET_CORES)}
    noise, started = Noise(), time.time()
    view, state, _ = run_until_final(manager, spec, cpu_hardware(), RUN_TIMEOUT_S)
    row["others_cores"] = noise.others_cores()
    if state != "finished":
        raise BenchError(f"{name}: run {view.id} ended {state}: {view.error_text}\n{tail(view.dir / 'train.log')}")
    run = row["run"] = observed(view, started, spec.args["max_steps"])
    row["shapes_equal"] = {tuple(s) for s in run["shapes"]} == {(b, length) for b, length, _ in forecast.shapes}
    row["disturbed"] = row["others_cores"] > QUIET_CORES
    print(f"[bench] {name} (round {round_no}): {len(run['shapes'])} shape(s), {run['compiles_forward']}+"
          f"{run['compiles_backward']} compilations in {run['compile_seconds']:.0f} s, limit hits "
          f"{run['limit_hits']}, wall to step {spec.args['max_steps']}: {run['wall_to_step_s']:.0f} s, others "
          f"{row['others_cores']:.2f} cores", flush=True)
    return row


def measure(work, args, report: dict) -> None:
    ensure_tiny_model()
    ensure_wide_sample()
    manager = RunManager(work / "runs")
    default = base_spec(args)
    default_fc, seconds = forecast_of(manager, default)
    little = [s for s in default_fc.suggestions if s["graphs"] * 2 <= default_fc.graphs and s["waste"] <= 0.15]
    if not default_fc.suggestions:
        raise BenchError(f"the forecast suggests nothing for {args.max_steps} steps")
    best = default_fc.suggestions[0]
    suggested = validated(default.with_overrides([f"{k}={v}" for k, v in best["set"].items()]))
    suggested_fc, suggested_seconds = forecast_of(manager, suggested)
    report["settings"] = {"recipe": str(RECIPE.relative_to(REPO)), "dataset": WIDE_DATASET, "max_length": 1024,
                          "max_steps": args.max_steps, "backend": args.backend, "rounds": args.rounds,
                          "suggestion": best, "suggestion_meets_2x_15pct": bool(little and little[0] is best)}
    report["forecast"] = {
        "default": {"graphs": default_fc.graphs, "waste": default_fc.waste, "truncated": default_fc.truncated,
                    "shapes": default_fc.shapes, "seconds": seconds, "suggestions": default_fc.suggestions},
        "suggested": {"graphs": suggested_fc.graphs, "waste": suggested_fc.waste, "shapes": suggested_fc.shapes,
                      "seconds": suggested_seconds}}
    print(f"[bench] forecast ({seconds:.0f} s): default {default_fc.graphs} shape(s), waste {default_fc.waste:.1%}; "
          f"best suggestion {best['set']}: {best['graphs']} shape(s), waste {best['waste']:.1%}", flush=True)
    variants = {"default": (default, default_fc), "suggested": (suggested, suggested_fc)}
    rows = report["runs"] = []
    for round_no in range(1, args.rounds + 1):
        order = list(variants) if round_no % 2 else list(reversed(variants))  # alternate who goes first
        for name in order:
            rows.append(run_variant(manager, work, name, *variants[name], round_no))
    missed = sorted({r["variant"] for r in rows if not r["shapes_equal"]})
    if missed:
        raise BenchError(f"the forecast's shapes differ from the run's for: {', '.join(missed)}")


def summary(rows: list[dict], key: str) -> tuple[float, float, float] | None:
    values = [r["run"][key] for r in rows if r["run"].get(key) is not None]
    return (statistics.median(values), min(values), max(values)) if values else None


def print_report(report: dict) -> None:
    rows = [r for r in report.get("runs") or [] if "run" in r]
    if not rows:
        return
    settings = report["settings"]
    print(f"\ntiny SFT on {settings['dataset']}, max_length {settings['max_length']}, {settings['max_steps']} steps, "
          f"torch_compile on ({settings['backend']} backend), cold compile cache per run")
    print(f"suggestion: {settings['suggestion']['set']} ({settings['suggestion']['cost']})")
    print(f"{'variant':9} {'round':>5} {'shapes fc':>9} {'run':>4} {'equal':>5} {'compiles f+b':>12} "
          f"{'compile s':>9} {'limit hits':>10} {'waste fc':>8} {'tok/s':>6} {'wall to N':>9} {'others':>6}")
    fc = report["forecast"]
    for r in rows:
        run = r["run"]
        mark = "*" if r["disturbed"] else " "
        print(f"{r['variant']:9} {r['round']:5} {fc[r['variant']]['graphs']:9} {len(run['shapes']):4} "
              f"{'yes' if r['shapes_equal'] else 'NO':>5} {run['compiles_forward']:>7}+{run['compiles_backward']:<4} "
              f"{run['compile_seconds']:9.0f} {run['limit_hits']:10} {fc[r['variant']]['waste']:8.1%} "
              f"{run['tokens_per_s'] or 0:6.0f} {run['wall_to_step_s'] or 0:9.0f} {r['others_cores']:5.2f}{mark}")
    walls = {name: summary([r for r in rows if r["variant"] == name], "wall_to_step_s") for name in fc}
    for name, figures in walls.items():
        if figures:
            print(f"  {name}: wall to step {settings['max_steps']} median {figures[0]:.0f} s "
                  f"(min {figures[1]:.0f}, max {figures[2]:.0f})")
    if walls["default"] and walls["suggested"]:
        print(f"  default / suggested, medians: {walls['default'][0] / walls['suggested'][0]:.2f}x")
    print("shapes fc / run: distinct batch shapes forecast / seen by the run; compiles f+b: forward + backward "
          "compile events;\nlimit hits: Dynamo's recompile-limit warnings in the run's log; tok/s: steps 2..N, "
          "compile time left out;\nwall to N: the start call to step N; others: cores other processes used "
          f"meanwhile (*: over {QUIET_CORES})")


def main() -> int:
    parser = argparse.ArgumentParser(description="End to end on builtin:wide with Inductor: TRL's default vs the "
                                     "shape forecast's best suggestion.")
    parser.add_argument("--max-steps", type=int, default=10,
                        help="max_steps of each run (default 10: the default's shapes stay within Dynamo's limit of 8)")
    parser.add_argument("--backend", default="inductor", help="torch_compile_backend (default inductor)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each variant, alternating (default 1)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (runs, logs)")
    args = parser.parse_args()
    if args.max_steps < 2 or args.rounds < 1:
        parser.error("--max-steps takes 2 or more, --rounds 1 or more")
    return run_bench("wide_compile", args, measure, print_report)


if __name__ == "__main__":
    sys.exit(main())
