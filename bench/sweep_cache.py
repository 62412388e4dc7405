"""A sweep with one shared precompile and compile cache against the same runs one after another,
each with an empty cache of its own.

Run from the repository root:

    .venv/bin/python bench/sweep_cache.py              # 5 rounds (both sides each round, alternating)
    .venv/bin/python bench/sweep_cache.py --rounds 1

The runs: 4 tiny SFT runs (the built-in model, 20 steps, torch_compile on: Inductor on this
machine's CPU), learning_rate 1e-3, 2e-3, 3e-3, 4e-3.
- "sweep": `launch.py sweep --precompile`'s engine (studio_core/runs/sweep.py) over the four, one
  compile cache for all of it, empty at the start: the four differ only in the learning rate, so the
  first run precompiles the shapes (in one job per free core) and the other three wait in the queue
  until it has; then the queue runs as many at once as there are free cores.
- "one by one": each run started after the one before it ended, each with an empty cache of its own.
Each side's wall time runs from the first start to the last run's end; its compile seconds are the
runs' compile_end events plus the precompile's time, and its compile share is those over the sum of
the runs' training times (the precompile's time is in its run's). The two
sides alternate, first side swapped every round; a round waits for a quiet machine first (the
others' CPU, in cores, is recorded). Printed: each side's median and spread over the rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import PROCS, BenchError, run_bench, run_until_final, wait_quiet  # noqa: E402
from studio_core.machine.hardware import cpu_hardware  # noqa: E402
from studio_core.recipe.spec import RunSpec  # noqa: E402
from studio_core.runs import sweep  # noqa: E402
from studio_core.runs.manager import RunManager  # noqa: E402

RATES = ["1e-3", "2e-3", "3e-3", "4e-3"]
SETTINGS = ["max_steps=20", "logging_steps=5", "torch_compile=true", "save_strategy=no"]


def base_spec() -> RunSpec:
    return RunSpec.load(REPO / "recipes" / "tiny-sft.yaml").with_overrides(SETTINGS)


def totals(views) -> dict:
    precompile_s = sum((view.precompile or {}).get("seconds") or 0 for view in views)
    compile_s = sum(view.compile_seconds() for view in views) + precompile_s
    training_s = sum(view.training_seconds() or 0 for view in views)
    return {"compile_s": compile_s, "precompile_s": precompile_s, "training_s": training_s,
            "compile_share": compile_s / training_s,
            "compiles": sum(len(view.compiles) for view in views), "runs": [view.id for view in views]}


def sweep_side(work: Path, n: int) -> dict:
    os.environ["STUDIO_COMPILE_CACHE"] = str(work / f"cache-sweep-{n}")  # empty; the queue runner inherits it
    manager = RunManager(work / f"runs-sweep-{n}")
    start = time.time()
    started = sweep.start(manager, base_spec().with_overrides(["studio.precompile=true"]), {"learning_rate": RATES},
                          cpu_hardware())
    ids = [entry["id"] for entry in started.record["runs"]]
    PROCS.runs += [(manager, run_id) for run_id in ids]
    views = [manager.wait(run_id, timeout=1800) for run_id in ids]
    if any(view.live_state != "finished" for view in views):
        raise BenchError(f"sweep runs ended {[v.live_state for v in views]}: {[v.error_text for v in views]}")
    return {"wall_s": max(view.spans[-1].end for view in views) - start, **totals(views)}


def one_by_one_side(work: Path, n: int) -> dict:
    manager, views, start = RunManager(work / f"runs-one-{n}"), [], time.time()
    for k, rate in enumerate(RATES):
        os.environ["STUDIO_COMPILE_CACHE"] = str(work / f"cache-one-{n}-{k}")  # empty, its own
        view, state, _ = run_until_final(manager, base_spec().with_overrides([f"learning_rate={rate}"]),
                                         cpu_hardware(), timeout_s=1800)
        if state != "finished":
            raise BenchError(f"run {view.id} ended {state}: {view.error_text}")
        views.append(view)
    return {"wall_s": views[-1].spans[-1].end - start, **totals(views)}


SIDES = {"sweep": sweep_side, "one by one": one_by_one_side}


def measure(work: Path, args, report: dict) -> None:
    report["rounds"] = []
    for n in range(args.rounds):
        order = list(SIDES) if n % 2 == 0 else list(SIDES)[::-1]
        found = {"quiet": wait_quiet(60, 0.3)}
        for side in order:
            found[side] = SIDES[side](work, n)
            print(f"round {n + 1} {side:10}: wall {found[side]['wall_s']:6.1f} s, compile "
                  f"{found[side]['compile_s']:6.1f} s ({found[side]['compile_share']:.0%} of training time; "
                  f"precompile {found[side]['precompile_s']:.1f} s), "
                  f"{found[side]['compiles']} compilations", flush=True)
        report["rounds"].append(found)


def print_report(report: dict) -> None:
    rounds = report.get("rounds") or []
    if not rounds:
        return
    print(f"\n{len(rounds)} round(s), sides alternating (4 tiny SFT runs, 20 steps, torch_compile):")
    for side in SIDES:
        walls = [r[side]["wall_s"] for r in rounds if side in r]
        shares = [r[side]["compile_share"] for r in rounds if side in r]
        if walls:
            print(f"  {side:10}: wall median {statistics.median(walls):6.1f} s (spread {min(walls):.1f} to "
                  f"{max(walls):.1f}), compile share median {statistics.median(shares):.0%}")
    others = [round(r["quiet"]["others_cores_before"], 2) for r in rounds if isinstance(r.get("quiet"), dict)]
    print(f"  other processes before each round (cores busy): {others}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the runs folders and caches")
    return run_bench("sweep_cache", parser.parse_args(), measure, print_report)


if __name__ == "__main__":
    sys.exit(main())
