"""Studio vs plain TRL: training speed and start-up time of the same tiny SFT.

Run from the repository root (4-6 minutes on 2 idle CPU cores; longer when other processes load
the machine, as the bench waits for quiet and redoes disturbed rounds):

    .venv/bin/python bench/studio_vs_plain.py
    .venv/bin/python bench/studio_vs_plain.py --rounds 5 --max-steps 1000

It prints a table and writes every figure to bench/results/studio_vs_plain-<time>.json.
The web app's memory is measured by bench/app_memory.py.

The run: the built-in tiny Qwen3 model and Q&A set, recipes/tiny-sft.yaml with max_steps raised
(--max-steps, default 600) and the CPU settings the studio's planner applies. (A) the studio:
RunManager(tmp).start(spec, cpu_hardware()), waited on until `finished`. (B) bench/plain_sft.py,
a plain TRL SFTTrainer script under `torchrun --standalone --nproc-per-node=1`, given the SFTConfig
keyword arguments studio_core/worker.py builds from the studio's resolved spec, pinned (taskset) to
the core the studio's run takes and with its OMP_NUM_THREADS, so both train on the same resources. After one uncounted
20-step warm-up of each, A and B alternate, A B A B ..., for --rounds rounds (default 3).

1. Speed. Both sides take time.time() in the trainer's on_step_end (the studio's `progress` events,
   the plain script's callback): steps/s = (last step - first step) / (time of last step - time of
   first step). Also reported: the trainer's own train_steps_per_second, and 1 / the median time
   between steps, which a short burst of other load hardly moves. Ratio = studio / plain of the
   medians; target >= 0.97.
2. Start-up: launch -> end of the first step. Studio: from just before RunManager.start() to the
   first `progress` event; plain: from just before Popen(torchrun ...) to the time the script
   prints at step 1. Added start-up = median(studio) - median(plain); target < 1 s. Also reported:
   each run's wall time (studio: start() to the `finished` event; plain: Popen to exit) and the
   phases both sides can see (process start -> on_train_begin -> first step).

Noise: before each run the bench waits (up to 120 s) for 2 s in which other processes use under
0.3 cores; it measures the cores other processes used during each run (column `others`) and redoes
a round in which either run had others > 0.3 (at most 5 extra rounds). Disturbed rounds stay in the
table and the JSON, marked *, but not in the medians.
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
from studio_core.builtin import BUILTIN_DATASETS, ensure_tiny_model
from studio_core.runs.events import read as read_events
from studio_core.hardware import cpu_hardware, studio_cpus
from studio_core.cores import parse_cores
from studio_core.runs.manager import RunManager
from studio_core.spec import RunSpec, validated
from studio_core.trl_schema import trl_schema

RECIPE = REPO / "recipes" / "tiny-sft.yaml"
PLAIN_SCRIPT = REPO / "bench" / "plain_sft.py"
WARMUP_STEPS = 20
QUIET_WAIT_S, QUIET_CORES, MAX_REDOS = 120, 0.3, 5
RUN_TIMEOUT_S = 600
TARGET_RATIO, TARGET_STARTUP_S = 0.97, 1.0


# --- the spec both sides train -----------------------------------------------------------------
def bench_spec(max_steps: int) -> RunSpec:
    return validated(RunSpec.load(RECIPE).with_overrides([f"max_steps={max_steps}"]))


def plain_sft_kwargs(resolved: RunSpec) -> dict:
    """The SFTConfig keyword arguments studio_core/worker.py builds from a resolved spec."""
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


def median_step_rate(times: list[float]) -> float:
    """1 / the median time between consecutive step ends: robust to a burst of other load."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    return 1 / statistics.median(gaps)


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
    running = next(e for e in events if e["type"] == "status" and e.get("state") == "running")
    torchrun_started = next((e["time"] for e in events if e["type"] == "log"
                             and str(e.get("message", "")).startswith("torchrun started")), None)
    finished = next(e for e in events if e["type"] == "status" and e.get("state") == "finished")
    if len(progress) < 2 or not final:
        raise BenchError(f"studio run {view.id}: {len(progress)} progress events, {len(final)} final metrics")
    first, last = progress[0], progress[-1]
    return {
        "kind": "studio", "run_id": view.id, "load_avg_1m_before": load, "others_cores": others,
        "steps": last["step"], "first_step": first["step"],
        "steps_per_s": (last["step"] - first["step"]) / (last["time"] - first["time"]),
        "median_step_rate": median_step_rate([e["time"] for e in progress]),
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
        "median_step_rate": median_step_rate(result["step_times"]),
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
        for kind in ("studio", "plain"):
            gate = wait_quiet(QUIET_WAIT_S, QUIET_CORES)
            row = run_studio(manager, spec) if kind == "studio" else run_plain(work, f"plain-{round_no}", config_file,
                                                                               resolved.env, cores)
            row["round"], row["quiet_gate"] = round_no, gate
            pair.append(row)
            print(f"[bench] round {round_no} {kind:6}: {row['steps_per_s']:.2f} steps/s, "
                  f"start-up {row['startup_s']:.2f} s, wall {row['wall_s']:.2f} s, other processes used "
                  f"{row['others_cores']:.2f} cores meanwhile (waited {gate['waited_s']:.0f} s for quiet)",
                  flush=True)
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
    """Medians over the undisturbed rounds (over all rounds, flagged, when none was undisturbed)."""
    runs = [r for r in all_runs if not r["disturbed"]] or all_runs
    pairs: dict[int, dict] = {}
    for r in runs:
        pairs.setdefault(r["round"], {})[r["kind"]] = r
    out: dict = {"rounds_used": sorted(pairs),
                 "only_disturbed_rounds": runs is all_runs and any(r["disturbed"] for r in all_runs)}
    for kind in ("studio", "plain"):
        out[kind] = {key: statistics.median(r[key] for r in runs if r["kind"] == kind)
                     for key in ("steps_per_s", "median_step_rate", "trainer_steps_per_s", "startup_s", "wall_s")}
    studio, plain = out["studio"], out["plain"]
    out["ratio_steps_per_s"] = studio["steps_per_s"] / plain["steps_per_s"]
    out["ratio_median_step_rate"] = studio["median_step_rate"] / plain["median_step_rate"]
    out["ratio_trainer_steps_per_s"] = studio["trainer_steps_per_s"] / plain["trainer_steps_per_s"]
    out["added_startup_s"] = studio["startup_s"] - plain["startup_s"]
    out["added_startup_s_per_round"] = [p["studio"]["startup_s"] - p["plain"]["startup_s"] for p in pairs.values()]
    out["added_wall_s"] = studio["wall_s"] - plain["wall_s"]
    out["ratio_per_round"] = [p["studio"]["steps_per_s"] / p["plain"]["steps_per_s"] for p in pairs.values()]
    out["median_ratio_per_round"] = statistics.median(out["ratio_per_round"])
    return out


def print_report(report: dict) -> None:
    runs, summary = report.get("runs"), report.get("summary")
    if runs:
        print(f"\n{'round':>6} {'kind':7} {'steps/s':>8} {'1/med step':>10} {'trainer':>8} {'start-up s':>10} "
              f"{'wall s':>7} {'to train_begin':>14} {'others':>6}")
        for r in runs:
            mark = "*" if r["disturbed"] else " "
            print(f"{r['round']:>5}{mark} {r['kind']:7} {r['steps_per_s']:8.2f} {r['median_step_rate']:10.2f} "
                  f"{r['trainer_steps_per_s']:8.2f} {r['startup_s']:10.2f} {r['wall_s']:7.2f} "
                  f"{r['phases_s']['launch_to_train_begin']:14.2f} {r['others_cores']:6.2f}")
    if summary:
        for kind in ("studio", "plain"):
            m = summary[kind]
            print(f"{'median':>6} {kind:7} {m['steps_per_s']:8.2f} {m['median_step_rate']:10.2f} "
                  f"{m['trainer_steps_per_s']:8.2f} {m['startup_s']:10.2f} {m['wall_s']:7.2f}")
    if runs:
        print("steps/s: (last step - first step) / time between their on_step_end; 1/med step: 1 / median time "
              "between steps;\ntrainer: the trainer's train_steps_per_second; start-up: launch -> end of step 1; "
              "to train_begin: launch -> on_train_begin;\nothers: cores that other processes on the machine used "
              f"during the run; *: round disturbed by them (others > {QUIET_CORES}), left out of the medians")
    if summary:
        if summary["only_disturbed_rounds"]:
            print("NOTE: every round was disturbed by other processes; the medians use them all")
        print(f"\nsteps/s studio/plain (medians over rounds {summary['rounds_used']}): "
              f"{summary['ratio_steps_per_s']:.3f} (target >= {TARGET_RATIO}) "
              f"{ok(summary['ratio_steps_per_s'] >= TARGET_RATIO)}; per round "
              f"{', '.join(f'{x:.3f}' for x in summary['ratio_per_round'])} (median "
              f"{summary['median_ratio_per_round']:.3f}); by 1/median step "
              f"{summary['ratio_median_step_rate']:.3f}; by the trainer's figure "
              f"{summary['ratio_trainer_steps_per_s']:.3f}")
        print(f"added start-up, launch -> end of step 1 (median studio - median plain): "
              f"{summary['added_startup_s']:+.2f} s (target < {TARGET_STARTUP_S:.0f} s) "
              f"{ok(summary['added_startup_s'] < TARGET_STARTUP_S)}; per round "
              f"{', '.join(f'{x:+.2f}' for x in summary['added_startup_s_per_round'])}")
        print(f"total wall time (medians): studio {summary['studio']['wall_s']:.2f} s, "
              f"plain {summary['plain']['wall_s']:.2f} s ({summary['added_wall_s']:+.2f} s)")


def main() -> int:
    parser = argparse.ArgumentParser(description="Studio vs plain TRL: training speed and start-up time.")
    parser.add_argument("--rounds", type=int, default=3, help="undisturbed A/B rounds to measure (default 3)")
    parser.add_argument("--max-steps", type=int, default=600, help="steps of each timed run (default 600)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (runs, logs)")
    args = parser.parse_args()
    if args.rounds < 1 or args.max_steps < 2:
        parser.error("--rounds must be >= 1 and --max-steps >= 2")
    return run_bench("studio_vs_plain", args, measure, print_report)


if __name__ == "__main__":
    sys.exit(main())
