"""Compilations and padding: a tiny SFT with torch_compile on, unpadded vs padded vs packed.

Run from the repository root (3-4 minutes on 2 idle CPU cores; longer when other processes load it):

    .venv/bin/python bench/compile_shapes.py
    .venv/bin/python bench/compile_shapes.py --max-steps 120 --backend eager

It prints a side-by-side table and writes every figure to bench/results/compile_shapes-<time>.json.

The runs: recipes/tiny-sft.yaml (the built-in tiny Qwen3 model on builtin:qa, batch 4, max_length
128) with max_steps 60, torch_compile on and the aot_eager Dynamo backend: cheap on the CPU, while
Dynamo still compiles once per new batch shape as it would on Trainium (the studio turns
automatic dynamic shapes off when torch_compile is on). Four variants of it:

    unpadded   each batch padded to its longest sample (TRL's default): a shape per length mix
    pad-64     pad_to_multiple_of=64: one shape, some padding
    pad-128    pad_to_multiple_of=128: one shape, more padding (what Neuron's "auto" would pick)
    packed     packing=true, packing_strategy=wrapped: one shape, samples cut into 128-token rows

For each: the shape forecast (studio_core/training/forecast.py, run on the resolved spec, as the page and
`launch.py plan` run it), then a real run through RunManager.start(), waited on until `finished`.
Compared:
- shapes: the forecast's distinct batch shapes vs those the run's `shape` events saw reach the
  model; `equal` says whether the two sets are the same.
- compilations: the run's compile_end events, forward and backward. The tiny model's step is
  several Dynamo frames (graph breaks), each compiled once per shape it sees, so `max/frame`, the
  most compilations of any one frame, is the figure to hold against the forecast's shape count.
  compile s: their total seconds.
- padding waste: the forecast's (1 - real / padded tokens). The run counts its real tokens (TRL's
  own count behind its num_tokens metric: the attention mask's sum, over every data-parallel
  process, as the forecast counts them) but not its padded ones, so the run's waste is 1 - run
  tokens / the forecast's padded tokens, given only when the shape sets are equal; and the run's
  real tokens are held against the forecast's, which should be the same number.
- speed without compilation: steps/s = steps 2..N / the sum of their step times (the worker's
  `step_s`, compile time taken out; step 1 also loads and warms up), tokens/s likewise (real
  tokens). Packed rows carry three times the real tokens of the others at the same shape as pad-128,
  so tokens/s, not steps/s, is the figure to compare across variants.

Noise: before each run the bench waits (up to 30 s) for 2 s in which other processes use under 0.3
cores, and reports the cores they used during the run (column `others`, * when over 0.3). One run
per variant: the speed figures are single measurements, the shape and compile counts are exact.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

from common import (REPO, BenchError, Noise, ok, run_bench, run_until_final,  # sets sys.path
                    tail, wait_quiet)
from studio_core.data.builtin import ensure_tiny_model
from studio_core.rundir.events import read as read_events
from studio_core.training.forecast import forecast_in_subprocess
from studio_core.machine.hardware import cpu_hardware
from studio_core.rundir.events import WARMUP_STEPS
from studio_core.runs.manager import RunManager
from studio_core.runs.view import RunView
from studio_core.recipe.spec import RunSpec, SpecError
from studio_core.recipe.validate import validated

RECIPE = REPO / "recipes" / "tiny-sft.yaml"
VARIANTS = {  # name -> the overrides it adds to the recipe
    "unpadded": [],
    "pad-64": ["pad_to_multiple_of=64"],
    "pad-128": ["pad_to_multiple_of=128"],
    "packed": ["packing=true", "packing_strategy=wrapped"],
}
QUIET_WAIT_S, QUIET_CORES = 30, 0.3
RUN_TIMEOUT_S = 300


def variant_spec(overrides: list[str], args) -> RunSpec:
    base = [f"max_steps={args.max_steps}", "torch_compile=true", f"torch_compile_backend={args.backend}"]
    return validated(RunSpec.load(RECIPE).with_overrides(base + overrides))


def run_to_end(manager: RunManager, spec: RunSpec) -> tuple[RunView, float]:
    """Start a studio run and wait until it finished; (its view, cores other processes used meanwhile)."""
    noise = Noise()
    view, state, _ = run_until_final(manager, spec, cpu_hardware(), RUN_TIMEOUT_S)
    others = noise.others_cores()
    if state != "finished":
        raise BenchError(f"run {view.id} ended {state}: {view.error_text}\n{tail(view.dir / 'train.log')}")
    return view, others


def observed(view: RunView) -> dict:
    """What the run's events say about shapes, compilations, tokens and speed (compile time left out)."""
    forward = [c for c in view.compiles if c["phase"] == "forward"]
    per_frame = Counter(c["graph"].split("/")[0] for c in forward)  # graph "4/2": frame 4, 3rd compile
    progress = [e for e in read_events(view.dir / "events.jsonl") if e["type"] == "progress" and "step_s" in e]
    later = progress[1:]  # step 1 also loads and warms up
    seconds = sum(e["step_s"] for e in later)
    return {
        "run_id": view.id,
        "shapes": [[*e["shape"], e["step"]] for e in view.shapes],  # [batch, length, first step]
        "compiles_forward": len(forward),
        "compiles_backward": len(view.compiles) - len(forward),
        "frames": len(per_frame),
        "max_compiles_per_frame": max(per_frame.values(), default=0),
        "recompiles": len([c for c in forward if c.get("reason")]),
        "compile_steps": sorted({c["step"] for c in view.compiles}),
        "late_compile_steps": sorted({c["step"] for c in view.compiles if c["step"] > WARMUP_STEPS}),
        "compile_seconds": view.compile_seconds(),
        "compiles": [{k: c.get(k) for k in ("graph", "phase", "step", "seconds", "reason")} for c in view.compiles],
        "tokens": view.tokens,
        "steps": len(progress),
        "steps_per_s": len(later) / seconds if seconds else None,
        "tokens_per_s": sum(e.get("tokens", 0) for e in later) / seconds if seconds else None,
        "studio_tokens_per_s": view.tokens_per_second(),  # the run panel's figure: all steps
        "wall_s": view.duration(),
    }


def measure(work: Path, args, report: dict) -> None:
    ensure_tiny_model()
    manager, hardware = RunManager(work / "runs"), cpu_hardware()
    rows: list[dict] = []
    report["settings"] = {"recipe": str(RECIPE.relative_to(REPO)), "max_steps": args.max_steps,
                          "backend": args.backend, "variants": VARIANTS, "quiet_wait_s": QUIET_WAIT_S,
                          "quiet_cores": QUIET_CORES}
    report["variants"] = rows  # filled as variants end: a failed bench still reports those it made
    for name, overrides in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        spec = variant_spec(overrides, args)
        t0 = time.monotonic()
        try:
            forecast = forecast_in_subprocess(manager.plan(spec, hardware).spec, "cpu")
        except SpecError as error:
            raise BenchError(f"{name}: {error}") from error
        row = {"variant": name, "overrides": overrides, "forecast_seconds": time.monotonic() - t0,
               "forecast": {"shapes": forecast.shapes, "graphs": forecast.graphs, "waste": forecast.waste,
                            "real_tokens": forecast.real_tokens, "padded_tokens": forecast.padded_tokens,
                            "steps": forecast.steps, "capped": forecast.capped}}
        print(f"[bench] {name}: forecast {forecast.graphs} shape(s), waste {forecast.waste:.1%} "
              f"({row['forecast_seconds']:.1f} s); running {args.max_steps} steps", flush=True)
        row["quiet_gate"] = wait_quiet(QUIET_WAIT_S, QUIET_CORES)
        view, row["others_cores"] = run_to_end(manager, spec)
        run = row["run"] = observed(view)
        forecast_set = {(b, length) for b, length, _ in forecast.shapes}
        row["shapes_equal"] = forecast_set == {(b, length) for b, length, _ in run["shapes"]}
        row["tokens_equal"] = run["tokens"] == forecast.real_tokens
        row["run_waste"] = (1 - run["tokens"] / forecast.padded_tokens
                            if row["shapes_equal"] and forecast.padded_tokens else None)
        row["disturbed"] = row["others_cores"] > QUIET_CORES
        rows.append(row)
        print(f"[bench] {name}: {len(run['shapes'])} shape(s) seen ({ok(row['shapes_equal'])}), "
              f"{run['compiles_forward']}+{run['compiles_backward']} compilations in "
              f"{run['compile_seconds']:.1f} s, {run['steps_per_s']:.1f} steps/s without them, "
              f"others used {row['others_cores']:.2f} cores", flush=True)
    if not rows:
        raise BenchError(f"no variant chosen: --only takes {', '.join(VARIANTS)}")
    mismatched = [r["variant"] for r in rows if not (r["shapes_equal"] and r["tokens_equal"])]
    if mismatched:
        raise BenchError(f"the forecast did not match the run for: {', '.join(mismatched)} (see the table)")


def shape_text(shapes: list[list[int]]) -> str:
    """[[4, 34, 30], ...] -> '4x34 (30)': batch x length and the count (forecast) or first step (run)."""
    return ", ".join(f"{b}x{length} ({n})" for b, length, n in shapes)


def print_report(report: dict) -> None:
    rows = [r for r in report.get("variants") or [] if "run" in r]
    if not rows:
        return
    settings = report["settings"]
    print(f"\ntiny SFT, {settings['max_steps']} steps, torch_compile on ({settings['backend']} backend), "
          "one run per variant")
    print(f"{'variant':9} {'shapes fc':>9} {'run':>4} {'equal':>5} {'compiles f+b':>12} {'max/frame':>9} "
          f"{'compile s':>9} {'waste fc':>8} {'run':>6} {'tokens fc':>9} {'run':>6} {'steps/s':>7} "
          f"{'tok/s':>6} {'wall s':>6} {'others':>6}")
    for r in rows:
        fc, run = r["forecast"], r["run"]
        run_waste = "-" if r["run_waste"] is None else f"{r['run_waste']:.1%}"
        mark = "*" if r["disturbed"] else " "
        print(f"{r['variant']:9} {fc['graphs']:9} {len(run['shapes']):4} {'yes' if r['shapes_equal'] else 'NO':>5} "
              f"{run['compiles_forward']:>7}+{run['compiles_backward']:<4} {run['max_compiles_per_frame']:9} "
              f"{run['compile_seconds']:9.1f} {fc['waste']:8.1%} {run_waste:>6} {fc['real_tokens']:9} "
              f"{run['tokens']:6} {run['steps_per_s']:7.1f} {run['tokens_per_s']:6.0f} {run['wall_s']:6.1f} "
              f"{r['others_cores']:5.2f}{mark}")
    print("shapes fc / run: distinct batch shapes forecast / seen by the run; compiles f+b: forward + backward "
          "compile events;\nmax/frame: most compilations of one Dynamo frame (one per shape); waste: padding "
          "share of the tokens computed (run: its real tokens\nover the forecast's padded ones); tokens: real "
          "tokens trained; steps/s, tok/s: steps 2..N, compile time left out;\nwall s: the run's start to its "
          f"end; others: cores other processes used meanwhile (*: over {QUIET_CORES})")
    for r in rows:
        print(f"  {r['variant']:9} forecast {shape_text(r['forecast']['shapes'])} [shape (batches)]; "
              f"run {shape_text(r['run']['shapes'])} [shape (first step)]; compiled at steps "
              f"{r['run']['compile_steps']} (after the {WARMUP_STEPS}-step warm-up: "
              f"{r['run']['late_compile_steps'] or 'none'}); forecast took {r['forecast_seconds']:.1f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description="Compilations, padding waste and speed: a tiny SFT with "
                                     "torch_compile on, unpadded vs padded vs packed.")
    parser.add_argument("--max-steps", type=int, default=60, help="max_steps of each run (default 60)")
    parser.add_argument("--backend", default="aot_eager",
                        help="torch_compile_backend (default aot_eager; eager is cheaper, inductor dearer)")
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), help="run only these variants")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (runs, logs)")
    return run_bench("compile_shapes", parser.parse_args(), measure, print_report)


if __name__ == "__main__":
    sys.exit(main())
