"""Runs forked from a zygote (studio_core/backends/forking.py) against runs started as new processes.

Run from the repository root (about 8 minutes on 2 CPU cores):

    .venv/bin/python bench/zygote.py
    .venv/bin/python bench/zygote.py --rounds 7 --runs 5

Each round has two sides, in alternating order (A B, then B A, ...): a fresh Python process that
starts --runs tiny SFT runs (recipes/tiny-sft.yaml, max_steps=1) one after another through the run
manager, as the web app does, waiting --pause seconds between them (a person's pace; the zygote
imports meanwhile), (A) keeping a zygote (RunManager.fork_runs_from_a_zygote, as the app does) and
(B) not (every run's supervisor and worker new processes). For each run it records the time from
start() to the end of step 1 (the run's first `progress` event) and whether it was forked; for each
side the whole machine's busy CPU seconds (bench/common.py's busy_cpu_s) over the side (forked runs are not this
bench's children to be counted apart), after waiting for a quiet 2 s (bench/common.py's wait_quiet),
whose load by other processes it records. It prints the medians and spreads and writes bench/results/zygote-<time>.json.
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

from bench.common import BenchError, busy_cpu_s, run_bench, wait_quiet  # noqa: E402
from bench.startup import spread  # noqa: E402

SIDE = r"""
import json, sys, time
from studio_core.machine.hardware import cpu_hardware
from studio_core.recipe.spec import RunSpec
from studio_core.rundir.events import read
from studio_core.runs.manager import RunManager
runs_dir, count, pause, forked = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "zygote"
if forked:
    RunManager.fork_runs_from_a_zygote()
manager = RunManager(runs_dir)
for index in range(count):
    if index:
        time.sleep(pause)
    began = time.time()
    view = manager.wait(manager.start(RunSpec.load(sys.argv[5]).with_overrides(["max_steps=1", f"run_name=r{index}"]),
                                      cpu_hardware()).id)
    events = read(view.dir / "events.jsonl")
    step_1 = next((e["time"] for e in events if e["type"] == "progress"), None)
    print(json.dumps({"state": view.state, "step_1": None if step_1 is None else step_1 - began,
                      "forked": any("forked from the studio's zygote" in e.get("message", "") for e in events)}),
          flush=True)
"""


def side(work: Path, mode: str, args) -> dict:
    runs = work / f"{mode}-{time.monotonic_ns()}"
    quiet = wait_quiet(30, 0.3)  # the machine's CPU below is the side's only if nothing else runs
    before = busy_cpu_s()
    done = subprocess.run([sys.executable, "-c", SIDE, str(runs), str(args.runs), str(args.pause), mode,
                           str(REPO / "recipes" / "tiny-sft.yaml")], cwd=REPO, capture_output=True, text=True,
                          timeout=900, check=False, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin",
                                                         "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"})
    cpu = busy_cpu_s() - before
    if done.returncode != 0:
        raise BenchError(f"the {mode} side exited {done.returncode}: {done.stderr[-1500:]}")
    runs_made = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if len(runs_made) != args.runs or any(r["state"] != "finished" or r["step_1"] is None for r in runs_made):
        raise BenchError(f"the {mode} side's runs: {runs_made}")
    return {"runs": runs_made, "busy_cpu_s": cpu, "others_cores": quiet["others_cores_before"]}


def measure(work: Path, args, report: dict) -> None:
    rounds = []
    for index in range(args.rounds):
        order = ("zygote", "new") if index % 2 == 0 else ("new", "zygote")
        got = {mode: side(work, mode, args) for mode in order}
        rounds.append(got)
        print(f"[bench] round {index + 1}: " + ", ".join(
            f"{mode} step 1 after the first {statistics.median(r['step_1'] for r in got[mode]['runs'][1:]):.2f} s, "
            f"forked {sum(r['forked'] for r in got[mode]['runs'])}/{args.runs}, machine CPU {got[mode]['busy_cpu_s']:.1f} s"
            for mode in ("zygote", "new")), file=sys.stderr)
    report["rounds"] = rounds


def print_report(report: dict) -> None:
    rounds = report.get("rounds") or []
    if not rounds:
        return
    print(f"\n{len(rounds)} rounds of {len(rounds[0]['zygote']['runs'])} runs a side, median (min-max):")
    for mode, label in (("zygote", "a zygote kept (the app)"), ("new", "new processes")):
        first = [r[mode]["runs"][0]["step_1"] for r in rounds]
        later = [run["step_1"] for r in rounds for run in r[mode]["runs"][1:]]
        forked = sum(run["forked"] for r in rounds for run in r[mode]["runs"])
        print(f"  {label}:")
        print(f"    first run, start to step 1   {spread(first)} s")
        print(f"    later runs, start to step 1  {spread(later)} s   ({forked} of {len(later) + len(first)} forked)")
        print(f"    machine CPU for the side     {spread([r[mode]['busy_cpu_s'] for r in rounds])} s")
    others = [r[mode]["others_cores"] for r in rounds for mode in ("zygote", "new")]
    print(f"  other processes before a side  {spread(others)} cores busy "
          f"({'quiet' if max(others) < 0.3 else 'NOT quiet'})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=4, help="runs a side, one after another")
    parser.add_argument("--pause", type=float, default=8.0, help="seconds between a side's runs")
    parser.add_argument("--keep", action="store_true", help="keep the runs folders")
    return run_bench("zygote", parser.parse_args(), measure, print_report)


if __name__ == "__main__":
    sys.exit(main())
