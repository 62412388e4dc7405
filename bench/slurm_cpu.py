"""A Slurm run and a Ray run vs a local run on this machine's CPU: time from submit to the first
step, and how soon the engine's view of a cluster run shows each step.

Run from the repository root (about 9-10 minutes for the default 5 rounds on 2 CPU cores; needs
root, Debian's slurm-wlm and munge, as tests/slurm_cluster.py does):

    .venv/bin/python bench/slurm_cpu.py                  # 5 rounds
    .venv/bin/python bench/slurm_cpu.py --rounds 1       # a quick check

It prints a table of rounds and, per side, the median and spread (min-max), and writes every
figure to bench/results/slurm_cpu-<time>.json.

Setup: a real 2-node Slurm cluster on this machine (tests/slurm_cluster.py: one slurmctld, two
slurmd "nodes" on localhost) in a fresh temporary folder, found through SLURM_CONF (set in this
process's environment, so the engine's sbatch/squeue/scontrol and the job itself use it), a real
2-node Ray cluster (tests/ray_cluster.py: a head and a second node, one CPU each, reached through
its dashboard's Jobs API), and a fresh temporary runs folder. Both clusters are up for the whole
bench and stopped (by pid) however it ends; the Ray daemons' own CPU while idle is left out of the
quiet gate's "others" (it is the Ray side's standing cost, not noise). The three sides train the
same recipe, recipes/tiny-sft.yaml with max_steps=20 (2 processes each):
  slurm: studio.run_on=slurm, studio.nodes=2 -- one batch job, 2 nodes x 1 process, whose srun
         starts a supervisor per node, each running that node's torchrun (c10d rendezvous);
  ray:   studio.run_on=ray, studio.nodes=2 -- one Ray job, whose driver places a bundle per node
         and starts a supervisor per node, each running that node's torchrun;
  local: studio.nproc=2 -- the local backend: a supervisor and torchrun with 2 processes here.
Each side runs once uncounted first (--warmup), then --rounds rounds, the sides alternating (round 1:
slurm, ray, local; round 2: local, ray, slurm; ...). A run is started with RunManager.start(spec,
cpu_hardware()) (Slurm: returns after sbatch), followed to its end, and only then -- once its
processes are gone (Slurm: the job has left squeue, COMPLETING included) -- does the next start, so
the sides never overlap. A run that ends other than `finished` stops the bench (its error and
train.log tail are printed), unless it trained and reported every step first: then its figures are
kept, marked !, and the bench reports the failure after the table and exits 1.

1. Submit -> first step: from just before RunManager.start() to the `time` of the first `progress`
   event with step >= 1 in the run's events.jsonl (read after the run ended). Also shown: the start
   call itself, start -> `running` (the trainer's on_train_begin) and the whole run (start -> the
   final status event).
2. Event -> view (the Slurm side; the local side's is shown as a reference): while a run goes, the
   bench polls RunManager.view(run_id) every --poll seconds (default 0.05) and notes the wall time
   at which view.step first reaches each step; a step's delay = that time - the `time` of its
   progress event (a step the view jumps over counts as seen when the view passes it). Median and
   p95 over every step of every round (and the per-round medians' spread). The poll interval adds
   up to --poll to each figure. The web page adds more on top: the run panel redraws on its 1 s
   timer (gr.Timer(1.0)), so a step reaches the page up to one tick (1 s) after the view has it.
   The view's end state is followed from the events; live_state (which asks squeue on Slurm) is
   read only once a second, as a guard against a job that died without a final status.

Noise: before each run the bench waits (up to --quiet-wait s, default 6) for a 2 s window in which
processes other than the bench and its runs use under 0.3 cores (bench/common.py's wait_quiet), and
records what they used; the load average is read before and after each run. (During a Slurm run
the job's processes are slurmd's children, not the bench's, so no "others" figure is taken during
the runs; the gate before each run and the load average say how busy the machine was.) The machine
is called quiet when every gate found it quiet.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import PROCS, REPO, BenchError, ok, run_bench, tail, wait_quiet  # also sets up sys.path

sys.path.insert(0, str(REPO / "tests"))
from ray_cluster import RayCluster  # noqa: E402
from slurm_cluster import SlurmCluster, available  # noqa: E402

from studio_core.data.builtin import ensure_tiny_model  # noqa: E402
from studio_core.machine.hardware import cpu_hardware  # noqa: E402
from studio_core.rundir.events import FINAL_STATES  # noqa: E402
from studio_core.rundir.events import read as read_events  # noqa: E402
from studio_core.runs.manager import RunManager  # noqa: E402
from studio_core.recipe.spec import RunSpec  # noqa: E402

RECIPE = REPO / "recipes" / "tiny-sft.yaml"
MAX_STEPS = 20
OVERRIDES = {
    "slurm": [f"max_steps={MAX_STEPS}", "studio.run_on=slurm", "studio.nodes=2"],
    "ray": [f"max_steps={MAX_STEPS}", "studio.run_on=ray", "studio.nodes=2"],  # and the cluster's address
    "local": [f"max_steps={MAX_STEPS}", "studio.nproc=2"],
}
SIDES = ("slurm", "ray", "local")
CLUSTERS = ("slurm", "ray")
RAY: dict = {}  # the Ray cluster's address, once it is up
RUN_TIMEOUT_S = 300
GONE_TIMEOUT_S = 90  # after the final status: the job's (or supervisor's) processes ending
LIVE_CHECK_S = 1.0  # how often the follow loop asks live_state (squeue on Slurm)
QUIET_CORES = 0.3
PAGE_TIMER_S = 1.0  # the run panel's gr.Timer


def spec_for(side: str) -> RunSpec:
    address = [f"studio.ray={{address: '{RAY['address']}'}}"] if side == "ray" else []
    return RunSpec.load(RECIPE).with_overrides([*OVERRIDES[side], *address])


def p95(values: list[float]) -> float:
    """The nearest-rank 95th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


# --- one run ---------------------------------------------------------------------------------
def run_once(manager: RunManager, side: str, poll_s: float) -> dict:
    """Start a run, follow its view until it ends, wait until its processes are gone; its figures."""
    spec = spec_for(side)
    hardware = cpu_hardware()
    load_before = os.getloadavg()
    t0 = time.time()
    view = manager.start(spec, hardware)
    t_started = time.time()
    run_id = view.id
    PROCS.runs.append((manager, run_id))
    seen: dict[int, float] = {}  # step -> wall time the view first showed it (or a later one)
    last, polls, poll_cost = 0, 0, 0.0
    next_live = time.monotonic() + LIVE_CHECK_S
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        before = time.time()
        view = manager.view(run_id)
        now = time.time()
        polls += 1
        poll_cost += now - before
        if view.step > last:
            for step in range(last + 1, view.step + 1):
                seen[step] = now
            last = view.step
        if view.state in FINAL_STATES:
            break
        if time.monotonic() >= next_live:
            if view.live_state in FINAL_STATES:  # ended without a final status of its own
                break
            next_live = time.monotonic() + LIVE_CHECK_S
        if time.monotonic() > deadline:
            raise BenchError(f"{side} run {run_id} still {view.live_state} at step {view.step} after "
                             f"{RUN_TIMEOUT_S} s:\n{tail(view.dir / 'train.log')}")
        time.sleep(poll_s)
    t_final_seen = time.time()
    # the run's processes gone (Slurm: the job out of squeue, its epilog included) before the next
    gone_deadline = time.monotonic() + GONE_TIMEOUT_S
    while view.backend.alive(view.dir):
        if time.monotonic() > gone_deadline:
            raise BenchError(f"{side} run {run_id}: still alive {GONE_TIMEOUT_S} s after its final status")
        time.sleep(0.2)
    t_gone = time.time()
    load_after = os.getloadavg()
    view = manager.view(run_id)
    state = view.live_state
    events = read_events(view.dir / "events.jsonl")
    progress = [e for e in events if e["type"] == "progress"]
    failure = None
    if state != "finished":
        failure = (f"{side} run {run_id} ended {state}: {view.error_text}\n"
                   f"--- {view.dir / 'train.log'} (tail) ---\n{tail(view.dir / 'train.log', 40)}")
        if not progress or progress[-1].get("step") != MAX_STEPS:  # no whole run to measure
            raise BenchError(failure)
        # Every step was trained and reported, only the end went wrong: its figures stand, and
        # the bench reports the failure (and exits 1) after the table.
        print(f"[bench] ENGINE FAILURE (figures kept, the bench will exit 1): {failure}", flush=True)
    first = next((e for e in progress if e.get("step", 0) >= 1), None)
    running = next((e for e in events if e["type"] == "status" and e.get("state") == "running"), None)
    ended = next((e for e in events if e["type"] == "status" and e.get("state") in FINAL_STATES), None)
    if first is None or running is None or ended is None:
        raise BenchError(f"{side} run {run_id}: no progress event, running or final status in its events")
    delays = {}
    for event in progress:
        step = event["step"]
        if step in seen and step not in delays:
            delays[step] = seen[step] - event["time"]
    missing = sorted({e["step"] for e in progress} - set(delays))
    return {
        "side": side, "run_id": run_id, "where": view.where(),
        "first_step": first["step"], "steps": progress[-1]["step"] if progress else 0,
        "startup_s": first["time"] - t0,
        "start_call_s": t_started - t0,
        "to_running_s": running["time"] - t0,
        "running_to_first_step_s": first["time"] - running["time"],
        "wall_s": ended["time"] - t0, "ended": state, "failure": failure,
        "final_seen_s": t_final_seen - t0, "gone_s": t_gone - t0,
        "view_delays_s": [delays[s] for s in sorted(delays)],
        "view_delay_steps": sorted(delays), "steps_never_seen": missing,
        "view_delay_median_s": statistics.median(delays.values()) if delays else None,
        "view_delay_p95_s": p95(list(delays.values())) if delays else None,
        "polls": polls, "poll_cost_mean_s": poll_cost / max(polls, 1),
        "load_before": load_before, "load_after": load_after,
    }


# --- the rounds ------------------------------------------------------------------------------
def measure(work: Path, args, report: dict) -> None:
    if not available():
        raise BenchError("Slurm is not installed here (sbatch, slurmctld, slurmd, munged): apt-get install "
                         "slurm-wlm munge")
    if os.geteuid() != 0:
        raise BenchError("the test Slurm cluster's daemons run as root: run the bench as root")
    ensure_tiny_model()
    report["machine"] = {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
                         "load_at_start": os.getloadavg()}
    report["settings"] = {"max_steps": MAX_STEPS, "overrides": OVERRIDES, "poll_s": args.poll,
                          "quiet_wait_s": args.quiet_wait, "quiet_cores": QUIET_CORES,
                          "page_timer_s": PAGE_TIMER_S}
    cluster_dir = Path(tempfile.mkdtemp(prefix="slurm_cpu-cluster-"))
    report["cluster_dir"] = str(cluster_dir)
    t0 = time.monotonic()
    cluster = SlurmCluster.start(cluster_dir)
    manager, ray = None, None
    try:
        t_ray = time.monotonic()
        ray = RayCluster.start()
        RAY["address"] = ray.address
        report["ray_cluster_start_s"] = time.monotonic() - t_ray
        print(f"[bench] Ray cluster up in {report['ray_cluster_start_s']:.1f} s ({ray.address})", flush=True)
        mine = tuple(node.pid for node in ray.nodes)
        report["cluster_start_s"] = time.monotonic() - t0
        os.environ.update(cluster.env)  # the engine's Slurm commands, and the job, find the cluster by it
        print(f"[bench] Slurm cluster up in {report['cluster_start_s']:.1f} s ({cluster.conf}); runs in "
              f"{work / 'runs'}", flush=True)
        manager = RunManager(work / "runs")
        warmups: list[dict] = []
        report["warmups"] = warmups
        for i in range(args.warmup):
            for side in SIDES:
                row = run_once(manager, side, args.poll)
                warmups.append(row)
                print(f"[bench] warm-up {side}: {format_row(row)}", flush=True)
        rows: list[dict] = []
        report["rounds"] = rows  # filled as runs end: a failed bench still reports what it measured
        for i in range(args.rounds):
            order = SIDES if i % 2 == 0 else SIDES[::-1]
            for side in order:
                gate = wait_quiet(args.quiet_wait, QUIET_CORES, mine)
                row = run_once(manager, side, args.poll)
                row.update(round=i + 1, quiet_gate=gate)
                rows.append(row)
                print(f"[bench] round {i + 1} {side}: {format_row(row)}; before it others used "
                      f"{gate['others_cores_before']:.2f} cores", flush=True)
        report["summary"] = summarize(rows)
        failures = [r["failure"] for r in [*warmups, *rows] if r["failure"]]
        if failures:
            report["engine_failures"] = failures
            raise BenchError(f"{len(failures)} run(s) ended other than finished (their figures are in the table, "
                             f"marked !):\n" + "\n".join(failures))
    finally:
        try:
            if manager is not None:  # a run still going is cancelled while its cluster can still answer
                for registered, run_id in list(PROCS.runs):
                    try:
                        if registered.view(run_id).live_state not in FINAL_STATES:
                            registered.stop(run_id)
                    except Exception as error:  # noqa: BLE001 -- report, and still stop the cluster
                        print(f"[bench] stopping run {run_id}: {type(error).__name__}: {error}", file=sys.stderr)
        finally:
            if ray is not None:
                ray.stop()
            cluster.stop()
            report["machine"]["load_at_end"] = os.getloadavg()
            if args.keep:
                print(f"[bench] cluster folder kept: {cluster_dir}")
            else:
                shutil.rmtree(cluster_dir, ignore_errors=True)


def summarize(rows: list[dict]) -> dict:
    out: dict = {}
    for side in SIDES:
        mine = [r for r in rows if r["side"] == side]
        startup = [r["startup_s"] for r in mine]
        delays = [d for r in mine for d in r["view_delays_s"]]
        round_medians = [r["view_delay_median_s"] for r in mine if r["view_delay_median_s"] is not None]
        out[side] = {
            "startup_median_s": statistics.median(startup), "startup_min_s": min(startup),
            "startup_max_s": max(startup), "startup_rounds_s": startup,
            **{f"{key}_median_s": statistics.median(r[f"{key}_s"] for r in mine)
               for key in ("start_call", "to_running", "running_to_first_step", "wall")},
            "view_delay_median_s": statistics.median(delays) if delays else None,
            "view_delay_p95_s": p95(delays) if delays else None,
            "view_delay_max_s": max(delays) if delays else None,
            "view_delay_samples": len(delays),
            "view_delay_round_medians_s": round_medians,
        }
    pairs: dict[int, dict] = {}
    for r in rows:
        pairs.setdefault(r["round"], {})[r["side"]] = r["startup_s"]
    for side in CLUSTERS:
        out[f"{side}_added_startup_s"] = out[side]["startup_median_s"] - out["local"]["startup_median_s"]
        out[f"{side}_added_startup_s_per_round"] = [p[side] - p["local"] for p in pairs.values()
                                                   if side in p and "local" in p]
    out["quiet"] = all(r["quiet_gate"]["quiet"] for r in rows)
    out["others_before_runs"] = [r["quiet_gate"]["others_cores_before"] for r in rows]
    return out


def format_row(row: dict) -> str:
    med, high = row["view_delay_median_s"], row["view_delay_p95_s"]
    return (f"submit -> step 1 {row['startup_s']:.2f} s (start call {row['start_call_s']:.2f}, "
            f"-> running {row['to_running_s']:.2f}), whole run {row['wall_s']:.2f} s; event -> view median "
            f"{'-' if med is None else f'{med * 1000:.0f}'} ms, p95 "
            f"{'-' if high is None else f'{high * 1000:.0f}'} ms over "
            f"{len(row['view_delays_s'])} steps; load {row['load_before'][0]:.2f}->{row['load_after'][0]:.2f}")


def print_report(report: dict) -> None:
    rows = report.get("rounds") or []
    if not rows:
        return
    print(f"\n{'round':>5} {'side':>5} {'step 1 s':>8} {'start()':>7} {'running':>7} {'wall s':>6} "
          f"{'view med ms':>11} {'view p95 ms':>11} {'steps':>5} {'others':>6} {'load 1m':>11}  run")
    for r in rows:
        med, high = r["view_delay_median_s"], r["view_delay_p95_s"]
        mark = " " if r["ended"] == "finished" else "!"
        print(f"{r['round']:>4}{mark} {r['side']:>5} {r['startup_s']:>8.2f} {r['start_call_s']:>7.2f} "
              f"{r['to_running_s']:>7.2f} {r['wall_s']:>6.2f} {'-' if med is None else f'{med * 1000:.0f}':>11} "
              f"{'-' if high is None else f'{high * 1000:.0f}':>11} {len(r['view_delays_s']):>5} "
              f"{r['quiet_gate']['others_cores_before']:>6.2f} "
              f"{r['load_before'][0]:>5.2f}->{r['load_after'][0]:<5.2f}  {r['run_id']}")
    print("step 1 s: submit (just before RunManager.start) -> the first progress event's time; start(): the start "
          "call (Slurm: incl. sbatch);\nrunning: submit -> the `running` status (on_train_begin); wall s: submit -> "
          "final status; view med/p95: event -> RunManager.view shows the step;\nothers: cores other processes used "
          "in the 2 s before the run; load 1m: load average before -> after the run;\n!: the run ended other than "
          "finished after training every step (its figures are kept; see the failure below)")
    summary = report.get("summary")
    if not summary:
        return
    poll_ms = report["args"]["poll"] * 1000
    print()
    for side in SIDES:
        s = summary[side]
        print(f"{side:>5}: submit -> first step median {s['startup_median_s']:.2f} s, spread "
              f"{s['startup_min_s']:.2f}-{s['startup_max_s']:.2f} over {len(s['startup_rounds_s'])} rounds "
              f"(start call {s['start_call_median_s']:.2f} s, -> running {s['to_running_median_s']:.2f} s, "
              f"running -> step 1 {s['running_to_first_step_median_s']:.2f} s; whole run {s['wall_median_s']:.2f} s)")
    for side in CLUSTERS:
        print(f"{side} - local, submit -> first step (medians): {summary[f'{side}_added_startup_s']:+.2f} s; per "
              f"round {', '.join(f'{x:+.2f}' for x in summary[f'{side}_added_startup_s_per_round'])}")
    for side in SIDES:
        s = summary[side]
        if s["view_delay_median_s"] is None:
            continue
        label = {"slurm": "Slurm run", "ray": "Ray run"}.get(side, "local run (reference)")
        per_round = s["view_delay_round_medians_s"]
        print(f"event -> view, {label}: median {s['view_delay_median_s'] * 1000:.0f} ms, p95 "
              f"{s['view_delay_p95_s'] * 1000:.0f} ms, max {s['view_delay_max_s'] * 1000:.0f} ms over "
              f"{s['view_delay_samples']} steps; per-round medians {min(per_round) * 1000:.0f}-"
              f"{max(per_round) * 1000:.0f} ms")
    print(f"  (the view polled every {poll_ms:.0f} ms, which adds up to {poll_ms:.0f} ms; the web page adds up to "
          f"its {PAGE_TIMER_S:.0f} s timer tick on top: the run panel redraws on gr.Timer({PAGE_TIMER_S:.1f}))")
    machine = report["machine"]
    others = summary["others_before_runs"]
    print(f"machine: {machine['cpus']} CPUs; load average (1, 5, 15 min) at the start "
          f"{', '.join(f'{x:.2f}' for x in machine['load_at_start'])}, at the end "
          f"{', '.join(f'{x:.2f}' for x in machine.get('load_at_end', ()))}; "
          f"{'quiet' if summary['quiet'] else 'NOT quiet'}: other processes used {min(others):.2f}-{max(others):.2f} "
          f"cores in the 2 s before each run (quiet: under {QUIET_CORES} before every one)")


def main() -> int:
    parser = argparse.ArgumentParser(description="A Slurm run and a Ray run vs a local run: submit -> first step, "
                                                 "and event -> view latency of the cluster runs.")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; each side once per round (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted runs of each side first (default 1)")
    parser.add_argument("--poll", type=float, default=0.05, help="seconds between view polls (default 0.05)")
    parser.add_argument("--quiet-wait", type=float, default=6,
                        help="seconds to wait at most for a quiet machine before each run (default 6)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folders (runs, cluster)")
    args = parser.parse_args()
    if args.rounds < 1 or args.warmup < 0 or args.poll <= 0:
        parser.error("--rounds must be at least 1, --warmup at least 0, --poll positive")
    return run_bench("slurm_cpu", args, measure, print_report)


if __name__ == "__main__":
    sys.exit(main())
