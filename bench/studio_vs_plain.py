"""Studio vs plain TRL: training speed and start-up time of the same tiny SFT.

Run from the repository root (6-10 minutes on 2 idle CPU cores; longer when other processes load
the machine, as the bench waits for quiet and redoes disturbed rounds):

    .venv/bin/python bench/studio_vs_plain.py
    .venv/bin/python bench/studio_vs_plain.py --rounds 7 --max-steps 1000

It prints a table and writes every figure to bench/results/studio_vs_plain-<time>.json.
The web app's memory is measured by bench/app_memory.py.

The run: the built-in tiny Qwen3 model and Q&A set, recipes/tiny-sft.yaml with max_steps raised
(--max-steps, default 600) and the CPU settings the studio's planner applies. (A) the studio:
RunManager(tmp).start(spec, cpu_hardware()), waited on until `finished`. (B) bench/plain_sft.py,
a plain TRL SFTTrainer script under `torchrun --standalone --nproc-per-node=1`, given the SFTConfig
keyword arguments studio_core/training/worker.py builds from the studio's resolved spec, pinned (taskset) to
the same OS CPU as the studio's run (the bench's runs folder is its own, so every studio run takes
core 0) and with its OMP_NUM_THREADS: both train on the same core with the same threads. After one
uncounted 20-step warm-up of each (page cache, the compile cache), --rounds rounds (default 5), the
order alternating: A B, then B A, ... so neither side always goes first.

Why the figure used to swing (per-round ratios 0.86-1.09 for an effect of a fraction of a percent):
steps/s over the wall time from the first step to the last counts every stall, and on 2 cores
shared with other processes the core both runs are pinned to is taken from them now and then, for
one run of a round more than the other. So:

1. Speed: each run's median step time, the time between consecutive on_step_end calls (the
   studio's `progress` events' step_s, the plain script's callback's step-end times; the first
   step, which warms up, left out). A burst of other load moves some steps, not the median. Per
   round, ratio = plain median / studio median (the studio's speed relative to plain TRL); the
   figure is the median of the per-round ratios, with their min and max. Target >= 0.99. Also
   reported: the same ratio by the training thread's CPU time per step (steps 2..N; the studio's
   `studio_cost` event carries it, the plain script prints it), which a core shared with other
   processes does not stretch as it stretches wall time; and, to show the swing, the ratio of
   steps/s over the whole wall time.
2. The studio's own cost, measured in its training process: the `studio_cost` event (wall and
   CPU time per step of everything the studio runs per step), and that as a share of the median
   step: the direct figure of what the studio costs a step.
3. Start-up: launch -> end of the first step. Studio: from just before RunManager.start() to the
   first `progress` event's time; plain: from just before Popen(torchrun ...) to the time the script
   prints at step 1. Added start-up: the median of the per-round differences (studio - plain), with
   their min and max; target <= 0.5 s. Also reported: the phases both sides can see (process
   start -> on_train_begin -> first step) and each run's wall time.

Noise: before each run the bench waits (up to 30 s) for 2 s in which other processes use under
0.3 cores; it measures the cores other processes used during each run (column `others`) and redoes
a round in which either run had others > 0.3 (at most 5 extra rounds). Disturbed rounds stay in the
table and the JSON, marked *, but not in the medians (unless every round was disturbed: said so).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import (PROCS, REPO, BenchError, Noise, ok, run_bench, run_until_final,  # sets sys.path
                    tail, wait_quiet)
from studio_core.data.builtin import BUILTIN_DATASETS, ensure_tiny_model
from studio_core.rundir.events import read as read_events
from studio_core.machine.hardware import cpu_hardware, studio_cpus
from studio_core.machine.cores import parse_cores
from studio_core.runs.manager import RunManager
from studio_core.recipe.spec import RunSpec
from studio_core.recipe.validate import validated
from studio_core.recipe.trl_schema import trl_schema

RECIPE = REPO / "recipes" / "tiny-sft.yaml"
PLAIN_SCRIPT = REPO / "bench" / "plain_sft.py"
WARMUP_STEPS = 20
QUIET_WAIT_S, QUIET_CORES, MAX_REDOS = 30, 0.3, 5
RUN_TIMEOUT_S = 600
TARGET_RATIO, TARGET_STARTUP_S = 0.99, 0.5


# --- the spec both sides train -----------------------------------------------------------------
def bench_spec(max_steps: int) -> RunSpec:
    return validated(RunSpec.load(RECIPE).with_overrides([f"max_steps={max_steps}"]))


def plain_sft_kwargs(resolved: RunSpec) -> dict:
    """The SFTConfig keyword arguments studio_core/training/worker.py builds from a resolved spec."""
    schema = trl_schema()
    model_fields, script_fields = set(schema["ModelConfig"]), set(schema["ScriptArguments"])
    args = dict(resolved.args)
    model = {name: field["default"] for name, field in schema["ModelConfig"].items()}
    model.update({k: v for k, v in args.items() if k in model_fields})
    if model.get("use_peft"):  # the worker would add a PEFT config; plain_sft.py does not
        raise BenchError("the recipe uses PEFT; plain_sft.py does not build a PEFT config")
    config = {k: v for k, v in args.items() if k not in model_fields | script_fields}
    config["model_init_kwargs"] = {"revision": model["model_revision"],
                                   "attn_implementation": model["attn_implementation"],
                                   "dtype": model["dtype"], **(config.get("model_init_kwargs") or {})}
    config["run_name"] = resolved.run_name
    return config


def median_step_s(times: list[float]) -> float:
    """The median time between consecutive step ends: robust to a burst of other load."""
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


# --- A: the studio ---------------------------------------------------------------------------
def run_studio(manager: RunManager, spec: RunSpec) -> dict:
    load, noise = os.getloadavg()[0], Noise()
    t0 = time.time()
    view, state, t_started = run_until_final(manager, spec, cpu_hardware(), RUN_TIMEOUT_S)
    t_seen = time.time()
    others = noise.others_cores()
    if state != "finished":
        raise BenchError(f"studio run {view.id} ended {state}: {view.error_text}\n{tail(view.dir / 'train.log')}")
    events = read_events(view.dir / "events.jsonl")
    progress = [e for e in events if e["type"] == "progress"]
    final = [e for e in events if e["type"] == "metrics" and "train_steps_per_second" in e]
    cost = next((e for e in events if e["type"] == "studio_cost"), None)
    running = next(e for e in events if e["type"] == "status" and e.get("state") == "running")
    torchrun_started = next((e["time"] for e in events if e["type"] == "log"
                             and str(e.get("message", "")).startswith(("torchrun started", "the worker started"))), None)
    finished = next(e for e in events if e["type"] == "status" and e.get("state") == "finished")
    if len(progress) < 2 or not final:
        raise BenchError(f"studio run {view.id}: {len(progress)} progress events, {len(final)} final metrics")
    first, last = progress[0], progress[-1]
    return {
        "kind": "studio", "run_id": view.id, "load_avg_1m_before": load, "others_cores": others,
        "steps": last["step"], "first_step": first["step"],
        "steps_per_s": (last["step"] - first["step"]) / (last["time"] - first["time"]),
        "median_step_s": median_step_s([e["time"] for e in progress]),  # as the plain side's, at full precision
        "trainer_steps_per_s": final[-1]["train_steps_per_second"],
        "train_runtime_s": final[-1].get("train_runtime"),
        "startup_s": first["time"] - t0,
        "wall_s": finished["time"] - t0,
        "wall_observed_s": t_seen - t0,
        "phases_s": {"start_call": t_started - t0,
                     "launch_to_torchrun_started": None if torchrun_started is None else torchrun_started - t0,
                     "launch_to_train_begin": running["time"] - t0,
                     "train_begin_to_first_step": first["time"] - running["time"],
                     "last_step_to_end": finished["time"] - last["time"]},
        "events": len(events), "progress_events": len(progress),
        "studio_cost": cost and {k: cost.get(k) for k in ("steps", "per_step_ms", "cpu_per_step_ms", "parts")},
        "step_cpu_ms": cost and cost.get("step_cpu_ms"),
    }


# --- B: the plain script ---------------------------------------------------------------------
TORCHRUN = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=1"]


def run_plain(work: Path, name: str, config_file: Path, studio_env: dict, cores: str) -> dict:
    """Pinned to the cores the studio's run takes, with the studio's thread count: like for like."""
    out_dir, log_path = work / name, work / f"{name}.log"
    argv = ["taskset", "-c", cores, *TORCHRUN, str(PLAIN_SCRIPT), "--model", str(ensure_tiny_model()),
            "--dataset", str(BUILTIN_DATASETS["builtin:qa"]), "--config", str(config_file),
            "--output-dir", str(out_dir)]
    load, noise = os.getloadavg()[0], Noise()
    with open(log_path, "wb") as log:
        t0 = time.time()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                cwd=work, start_new_session=True,
                                env=dict(os.environ, OMP_NUM_THREADS=studio_env["OMP_NUM_THREADS"]))
    PROCS.groups.append(proc)
    try:
        code = proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        raise BenchError(f"plain run {name} still running after {RUN_TIMEOUT_S} s") from error
    t_end = time.time()
    others = noise.others_cores()
    if code != 0:
        raise BenchError(f"plain run {name} exited {code}:\n{tail(log_path)}")
    lines = {}  # the script's two timing lines, by their marker
    for line in log_path.read_text(errors="replace").splitlines():
        marker, _, payload = line.partition(" ")
        if marker in ("PLAIN_SFT_RESULT", "PLAIN_SFT_FIRST_STEP"):
            lines[marker] = json.loads(payload)
    if len(lines) != 2:
        raise BenchError(f"plain run {name}: no PLAIN_SFT_RESULT / PLAIN_SFT_FIRST_STEP line\n{tail(log_path)}")
    result, first_step = lines["PLAIN_SFT_RESULT"], lines["PLAIN_SFT_FIRST_STEP"]
    return {
        "kind": "plain", "run_id": name, "load_avg_1m_before": load, "others_cores": others,
        "steps": result["last_step"], "first_step": result["first_step"],
        "steps_per_s": (result["last_step"] - result["first_step"])
        / (result["last_step_time"] - result["first_step_time"]),
        "median_step_s": median_step_s(result["step_times"]),
        "step_cpu_ms": (result["last_step_cpu"] - result["first_step_cpu"])
        / (result["last_step"] - result["first_step"]) * 1000,
        "trainer_steps_per_s": result["train_steps_per_second"],
        "train_runtime_s": result["train_runtime"],
        "startup_s": first_step["time"] - t0,
        "wall_s": t_end - t0,
        "phases_s": {"launch_to_script_start": result["script_start_time"] - t0,
                     "launch_to_train_begin": result["train_begin_time"] - t0,
                     "train_begin_to_first_step": result["first_step_time"] - result["train_begin_time"],
                     "last_step_to_end": t_end - result["last_step_time"]},
        "torch_threads": result["torch_threads"], "omp_num_threads_env": result["omp_num_threads_env"],
    }


# --- the rounds ------------------------------------------------------------------------------
def measure(work: Path, args, report: dict) -> None:
    ensure_tiny_model()
    manager = RunManager(work / "studio-runs")

    def planned(max_steps: int, file_name: str):
        """The spec, and the file with the SFTConfig kwargs the worker would build from its plan."""
        spec = bench_spec(max_steps)
        resolved = manager.plan(spec, cpu_hardware(), this_machine=True)  # the cores a start takes now
        (work / file_name).write_text(json.dumps(plain_sft_kwargs(resolved.spec), indent=2))
        return spec, work / file_name, resolved

    spec, config_file, resolved = planned(args.max_steps, "sft_kwargs.json")
    sft_kwargs = plain_sft_kwargs(resolved.spec)
    report["settings"] = {"warmup_steps": WARMUP_STEPS, "quiet_wait_s": QUIET_WAIT_S,
                          "quiet_cores": QUIET_CORES, "max_redos": MAX_REDOS, "run_timeout_s": RUN_TIMEOUT_S}
    report["setup"] = {
        "cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
        "python": platform.python_version(), "studio_env": resolved.env,
        "studio_applied": [[k, v] for k, v, _ in resolved.applied],
        "sft_kwargs_both": sft_kwargs, "plain_argv": [*TORCHRUN, "bench/plain_sft.py", "..."],
        "bench_env_OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }
    print(f"[bench] work folder {work}; SFTConfig values for both: {json.dumps(sft_kwargs)}", flush=True)
    print(f"[bench] studio adds env: {resolved.env}", flush=True)

    warm_spec, warm_file, _ = planned(WARMUP_STEPS, "sft_kwargs_warmup.json")
    print(f"[bench] warm-up (uncounted): studio {WARMUP_STEPS} steps, plain {WARMUP_STEPS} steps", flush=True)
    run_studio(manager, warm_spec)
    cores = ",".join(str(studio_cpus()[core]) for core in parse_cores(resolved.spec.layout.cores))  # OS CPUs
    run_plain(work, "plain-warmup", warm_file, resolved.env, cores)

    runs, clean, round_no = [], 0, 0
    report["runs"] = runs  # filled as rounds end: a failed bench still reports the rounds it made
    while clean < args.rounds and round_no < args.rounds + MAX_REDOS:
        round_no += 1
        pair = []
        order = ("studio", "plain") if round_no % 2 else ("plain", "studio")  # A B, then B A, ...
        for kind in order:
            gate = wait_quiet(QUIET_WAIT_S, QUIET_CORES)
            row = run_studio(manager, spec) if kind == "studio" else run_plain(work, f"plain-{round_no}", config_file,
                                                                               resolved.env, cores)
            row["round"], row["quiet_gate"] = round_no, gate
            pair.append(row)
            print(f"[bench] round {round_no} {kind:6}: median step {row['median_step_s'] * 1000:.2f} ms, "
                  f"{row['steps_per_s']:.2f} steps/s over the wall time, start-up {row['startup_s']:.2f} s, other "
                  f"processes used {row['others_cores']:.2f} cores meanwhile (waited {gate['waited_s']:.0f} s "
                  "for quiet)", flush=True)
        disturbed = any(r["others_cores"] > QUIET_CORES for r in pair)
        for row in pair:
            row["disturbed"] = disturbed
        clean += not disturbed
        if disturbed:
            print(f"[bench] round {round_no} disturbed by other processes (> {QUIET_CORES} cores): "
                  f"{'redoing it' if round_no < args.rounds + MAX_REDOS else 'no redo left'}", flush=True)
        runs += pair
    report["summary"] = summarize(runs)


def summarize(all_runs: list[dict]) -> dict:
    """Medians of the per-round figures over the undisturbed rounds (over all rounds, flagged, when
    none was undisturbed), each with its min and max."""
    runs = [r for r in all_runs if not r["disturbed"]] or all_runs
    pairs: dict[int, dict] = {}
    for r in runs:
        pairs.setdefault(r["round"], {})[r["kind"]] = r
    rounds = [p for p in pairs.values() if len(p) == 2]
    costs = [p["studio"]["studio_cost"] for p in rounds if p["studio"].get("studio_cost")]
    out: dict = {
        "rounds_used": sorted(r["studio"]["round"] for r in rounds),
        "only_disturbed_rounds": runs is all_runs and any(r["disturbed"] for r in all_runs),
        "others_cores": spread([r["others_cores"] for r in runs]),
        # the studio's speed relative to plain TRL: plain's median step time / the studio's
        "ratio_median_step": spread([p["plain"]["median_step_s"] / p["studio"]["median_step_s"] for p in rounds]),
        "ratio_step_cpu": spread([p["plain"]["step_cpu_ms"] / p["studio"]["step_cpu_ms"] for p in rounds]),
        "ratio_wall_steps_per_s": spread([p["studio"]["steps_per_s"] / p["plain"]["steps_per_s"] for p in rounds]),
        "added_startup_s": spread([p["studio"]["startup_s"] - p["plain"]["startup_s"] for p in rounds]),
        "added_wall_s": spread([p["studio"]["wall_s"] - p["plain"]["wall_s"] for p in rounds]),
    }
    for kind in ("studio", "plain"):
        out[kind] = {key: statistics.median(p[kind][key] for p in rounds)
                     for key in ("median_step_s", "step_cpu_ms", "steps_per_s", "trainer_steps_per_s", "startup_s",
                                 "wall_s")}
    if costs:
        out["studio_cost_per_step_ms"] = spread([c["per_step_ms"] for c in costs])
        out["studio_cost_cpu_per_step_ms"] = spread([c["cpu_per_step_ms"] for c in costs])
        out["studio_cost_share_of_step"] = spread([p["studio"]["studio_cost"]["per_step_ms"]
                                                   / (p["studio"]["median_step_s"] * 1000) for p in rounds])
    return out


def _spread_text(figure: dict, fmt: str) -> str:
    return (f"{format(figure['median'], fmt)} (min {format(figure['min'], fmt)}, max {format(figure['max'], fmt)}, "
            f"{figure['n']} rounds)")


def print_report(report: dict) -> None:
    runs, summary = report.get("runs"), report.get("summary")
    if runs:
        print(f"\n{'round':>6} {'kind':7} {'med step ms':>11} {'CPU/step ms':>11} {'steps/s':>8} {'trainer':>8} "
              f"{'start-up s':>10} {'wall s':>7} {'to train_begin':>14} {'cost ms':>7} {'others':>6}")
        for r in runs:
            mark = "*" if r["disturbed"] else " "
            cost = (r.get("studio_cost") or {}).get("per_step_ms")
            print(f"{r['round']:>5}{mark} {r['kind']:7} {r['median_step_s'] * 1000:11.3f} {r['step_cpu_ms']:11.3f} "
                  f"{r['steps_per_s']:8.2f} "
                  f"{r['trainer_steps_per_s']:8.2f} {r['startup_s']:10.2f} {r['wall_s']:7.2f} "
                  f"{r['phases_s']['launch_to_train_begin']:14.2f} {'' if cost is None else f'{cost:.3f}':>7} "
                  f"{r['others_cores']:6.2f}")
        print("med step ms: the median time between consecutive on_step_end (step 1 left out); CPU/step ms: the "
              "training thread's CPU time per step (steps 2..N);\nsteps/s: (last step "
              "- first step) / the time between them;\ntrainer: the trainer's train_steps_per_second; start-up: "
              "launch -> end of step 1; to train_begin: launch -> on_train_begin;\ncost ms: the studio's own time "
              "per step in its training process (studio_cost); others: cores that other processes used during the "
              f"run;\n*: round disturbed by them (others > {QUIET_CORES}), left out of the medians")
    if summary:
        if summary["only_disturbed_rounds"]:
            print("NOTE: every round was disturbed by other processes; the medians use them all")
        ratio, startup = summary["ratio_median_step"], summary["added_startup_s"]
        print(f"\nstudio speed / plain TRL speed, by median step time (median of per-round ratios): "
              f"{_spread_text(ratio, '.4f')}; target >= {TARGET_RATIO} {ok(ratio['median'] >= TARGET_RATIO)}")
        print("  the same by the training thread's CPU time per step (what other processes' load does not "
              f"stretch): {_spread_text(summary['ratio_step_cpu'], '.4f')}")
        print("  the same by steps/s over the wall time, per round: "
              f"{_spread_text(summary['ratio_wall_steps_per_s'], '.3f')}")
        if "studio_cost_per_step_ms" in summary:
            print("the studio's own cost in its training process: "
                  f"{_spread_text(summary['studio_cost_per_step_ms'], '.4f')} ms per step of wall time, CPU "
                  f"{_spread_text(summary['studio_cost_cpu_per_step_ms'], '.4f')} ms; "
                  f"{summary['studio_cost_share_of_step']['median']:.3%} of the median step")
        print(f"added start-up, launch -> end of step 1 (median of per-round studio - plain): "
              f"{_spread_text(startup, '+.2f')} s; target <= {TARGET_STARTUP_S} s "
              f"{ok(startup['median'] <= TARGET_STARTUP_S)}")
        print(f"added wall time per run: {_spread_text(summary['added_wall_s'], '+.2f')} s; other processes used "
              f"{_spread_text(summary['others_cores'], '.2f')} cores during the runs used")


def main() -> int:
    parser = argparse.ArgumentParser(description="Studio vs plain TRL: training speed and start-up time.")
    parser.add_argument("--rounds", type=int, default=5, help="undisturbed A/B rounds to measure (default 5)")
    parser.add_argument("--max-steps", type=int, default=600, help="steps of each timed run (default 600)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (runs, logs)")
    args = parser.parse_args()
    if args.rounds < 1 or args.max_steps < 2:
        parser.error("--rounds must be >= 1 and --max-steps >= 2")
    return run_bench("studio_vs_plain", args, measure, print_report)


if __name__ == "__main__":
    sys.exit(main())
