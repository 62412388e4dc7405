"""Start-up: `launch.py train` to the end of step 1, against the bare import of TRL.

Run from the repository root (3-6 minutes on 2 CPU cores):

    .venv/bin/python bench/startup.py
    .venv/bin/python bench/startup.py --rounds 7

Each round runs, in alternating order (A B, then B A, ...), so neither side always goes first:
(A) `launch.py train recipes/tiny-sft.yaml --set max_steps=1` as a user types it, its own runs
folder, timed from the command's start to the time of the run's first `progress` event (the end
of step 1), and split by the run's own events: the CLI's checks (to the `starting` event), the
worker (or torchrun, for several processes) started (its log line), the worker ready (`running`: TRL imported, data read, model loaded,
trainer built), step 1; (B) `python -c "from trl import SFTTrainer, SFTConfig; import peft,
datasets"`, timed to its exit. Also (C) `launch.py plan recipes/tiny-sft.yaml`, warm. One
uncounted round first warms the page cache and what the studio remembers (data/remembered.py).

It prints each side's median and spread, the ratio A/B per round and its median (the goal: at
most 1.2), and the other processes' load during the rounds (bench/common.py's Noise), and writes
every figure to bench/results/startup-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import BenchError, Noise, run_bench  # noqa: E402

PYTHON = sys.executable
RECIPE = str(REPO / "recipes" / "tiny-sft.yaml")
BARE = "from trl import SFTTrainer, SFTConfig; import peft, datasets"
PARTS = ("checks", "launched", "worker_ready", "step_1")


def train_once(runs: Path) -> dict:
    t0 = time.time()
    done = subprocess.run([PYTHON, "launch.py", "train", RECIPE, "--set", "max_steps=1", "--runs-dir", str(runs)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    ended = time.time()
    if done.returncode != 0:
        raise BenchError(f"launch.py train exited {done.returncode}: {done.stderr[-1500:]}")
    [run] = [p for p in runs.iterdir() if not p.name.startswith(".")]
    times = {}
    for line in (run / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        kind, at = event.get("type"), event.get("time", 0) - t0
        if kind == "status" and event.get("state") == "starting":
            times.setdefault("checks", at)
        elif kind == "log" and str(event.get("message", "")).startswith(("torchrun started", "the worker started")):
            times.setdefault("launched", at)
        elif kind == "status" and event.get("state") == "running":
            times.setdefault("worker_ready", at)
        elif kind == "progress":
            times.setdefault("step_1", at)
    if "step_1" not in times:
        raise BenchError(f"run {run} has no progress event")
    return {**times, "command_s": ended - t0}


def bare_once() -> float:
    t0 = time.time()
    subprocess.run([PYTHON, "-c", BARE], cwd=REPO, check=True, capture_output=True)
    return time.time() - t0


def plan_once() -> float:
    t0 = time.time()
    subprocess.run([PYTHON, "launch.py", "plan", RECIPE], cwd=REPO, check=True, capture_output=True)
    return time.time() - t0


def measure(work: Path, args, report: dict) -> None:
    rounds = []
    for index in range(args.rounds + 1):  # round 0 warms up and is not counted
        noise = Noise()
        runs = work / f"runs-{index}"
        runs.mkdir()
        order = ("studio", "bare") if index % 2 else ("bare", "studio")
        got = {}
        for side in order:
            got[side] = train_once(runs) if side == "studio" else bare_once()
        got["plan_s"] = plan_once()
        got["others_cores"] = noise.others_cores()
        got["ratio"] = got["studio"]["step_1"] / got["bare"]
        if index:
            rounds.append(got)
        print(f"[bench] round {index}{' (warm-up)' if not index else ''}: studio {got['studio']['step_1']:.1f} s, "
              f"bare import {got['bare']:.1f} s, ratio {got['ratio']:.2f}, plan {got['plan_s']:.2f} s, "
              f"others {got['others_cores']:.2f} cores", file=sys.stderr)
    report["rounds"] = rounds


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f}  ({min(values):.2f}-{max(values):.2f})"


def print_report(report: dict) -> None:
    rounds = report.get("rounds") or []
    if not rounds:
        return
    print(f"\n{len(rounds)} rounds, median (min-max):")
    for part in PARTS:
        print(f"  studio {part:<14} {spread([r['studio'][part] for r in rounds if part in r['studio']])} s "
              "from the command's start")
    print(f"  bare TRL import       {spread([r['bare'] for r in rounds])} s")
    ratios = [r["ratio"] for r in rounds]
    print(f"  ratio studio/bare     {spread(ratios)}   goal <= 1.2: {'met' if statistics.median(ratios) <= 1.2 else 'not met'}")
    plans = [r["plan_s"] for r in rounds]
    print(f"  launch.py plan, warm  {spread(plans)} s   goal < 1 s: {'met' if statistics.median(plans) < 1 else 'not met'}")
    others = [r["others_cores"] for r in rounds]
    print(f"  other processes       {spread(others)} cores busy ({'quiet' if max(others) < 0.3 else 'NOT quiet'})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the runs folders")
    return run_bench("startup", parser.parse_args(), measure, print_report)


if __name__ == "__main__":
    sys.exit(main())
