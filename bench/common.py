"""Helpers shared by the benches in bench/: cleanup, noise measurement, the run-and-report frame.

Not run by itself. bench/studio_vs_plain.py (speed and start-up) and bench/app_memory.py (the web
app's memory) import it; each calls run_bench(), which stops every process the bench started --
also on error, Ctrl-C or SIGTERM -- and writes bench/results/<name>-<time>.json.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub is imported (via studio_core)
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from studio_core.rundir.events import FINAL_STATES  # noqa: E402
from studio_core.machine.procs import kill_run_processes  # noqa: E402
from studio_core.runs.manager import RunManager  # noqa: E402

RESULTS_DIR = REPO / "bench" / "results"
POLL_S = 0.5
MB = 2 ** 20


class BenchError(RuntimeError):
    """A measurement could not be made; the bench reports it and exits 1."""


# --- cleanup: everything started is registered here and stopped by run_bench() -----------------
class Processes:
    def __init__(self) -> None:
        self.groups: list[subprocess.Popen] = []  # started with start_new_session=True
        self.runs: list[tuple[RunManager, str]] = []  # studio runs (also those the app started)

    def stop_group(self, proc: subprocess.Popen, first=signal.SIGTERM, grace_s: float = 15) -> None:
        """Signal the process group, wait, then SIGKILL whatever of the group is left."""
        if proc.poll() is None and signal_group(proc.pid, first):
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                print(f"[bench] pid {proc.pid} ignored signal {first}; killing its group", file=sys.stderr)
        signal_group(proc.pid, signal.SIGKILL)  # children that outlived the leader, too
        proc.wait(timeout=10)

    def stop_all(self) -> list[str]:
        """Stop every run and process group; returns what could not be stopped."""
        problems = []
        for manager, run_id in self.runs:
            try:
                if manager.view(run_id).live_state not in FINAL_STATES:
                    manager.stop(run_id)
                # by their STUDIO_RUN_ID marker: also ranks whose supervisor is gone
                left = kill_run_processes(run_id)
                if left:
                    problems.append(f"run {run_id}: processes survived SIGKILL: {[p.pid for p in left]}")
            except (KeyError, RuntimeError, OSError, psutil.Error) as error:
                problems.append(f"run {run_id}: {type(error).__name__}: {error}")
        for proc in self.groups:
            try:
                self.stop_group(proc)
            except (OSError, subprocess.TimeoutExpired) as error:
                problems.append(f"pid {proc.pid}: {type(error).__name__}: {error}")
        return problems


PROCS = Processes()


def signal_group(pgid: int, signum: int) -> bool:
    """Send a signal to a process group; False when the group no longer exists."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    return True


# --- noise: CPU used by other processes on the machine (other people's tests, ...) -------------
# On 2 cores another process using a fraction of a core slows a 2-thread run a lot (one core's worth
# of other load took it from ~50 to ~5 steps/s), so the benches measure it rather than guess.
def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq


def own_cpu_s() -> float:
    """CPU seconds of this process plus its reaped descendants (runs whose parents waited for them)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a live process and its live descendants (a server the bench started)."""
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue  # ended meanwhile
        total += times.user + times.system
    return total


class Noise:
    """Cores' worth of CPU that processes other than the bench and its runs used over an interval:
    machine busy time minus the bench's own and its reaped runs' CPU time, and minus that of the
    live process trees in `mine` (pids of servers the bench started and has not reaped)."""

    def __init__(self, mine: tuple[int, ...] = ()) -> None:
        self.mine = mine
        self.t, self.busy, self.own = time.monotonic(), busy_cpu_s(), self._own()

    def _own(self) -> float:
        return own_cpu_s() + sum(tree_cpu_s(pid) for pid in self.mine)

    def others_cores(self) -> float:
        elapsed = time.monotonic() - self.t
        return ((busy_cpu_s() - self.busy) - (self._own() - self.own)) / max(elapsed, 1e-6)


def wait_quiet(max_wait_s: float, threshold: float, mine: tuple[int, ...] = ()) -> dict:
    """Wait (up to max_wait_s) for a 2 s window in which others (not the process trees of `mine`)
    use under `threshold` cores."""
    t0 = time.monotonic()
    while True:
        window = Noise(mine)
        time.sleep(2)
        others = window.others_cores()
        if others < threshold or time.monotonic() - t0 >= max_wait_s:
            return {"waited_s": time.monotonic() - t0, "others_cores_before": others,
                    "quiet": others < threshold}


def reap(pid: int, timeout_s: float = 30) -> None:
    """Wait until a child that has ended or is about to (a studio supervisor) is reaped: only then is
    its CPU time, and its runs', in RUSAGE_CHILDREN and so left out of Noise's `others`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return  # already reaped, by RunManager's reaper thread
        if done:
            return
        time.sleep(0.05)
    raise BenchError(f"the studio supervisor (pid {pid}) did not exit {timeout_s:.0f} s after `finished`")


# --- small utilities -------------------------------------------------------------------------
def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return f"({path} not written)"


def ok(good: bool) -> str:
    return "OK" if good else "MISSED"


def rate(a: float, b: float, seconds: float) -> float:
    """(b - a) per second; a counter's increase over a sampling window."""
    return (b - a) / max(seconds, 1e-6)


def on_signal(signum, frame):
    raise SystemExit(128 + signum)  # unwinds into run_bench()'s finally, which stops everything


def run_bench(name: str, args, measure, print_report) -> int:
    """Run measure(work_dir, args, report) in a fresh temporary folder, then -- however it ended --
    stop every registered process, write the report to bench/results/<name>-<time>.json and print it
    with print_report(report). The folder is removed unless --keep is given or the bench failed."""
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    report: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "work_dir": str(work)}
    code = 1
    try:
        measure(work, args, report)
        code = 0
    except BenchError as error:
        report["error"] = str(error)
        print(f"[bench] FAILED: {error}", file=sys.stderr)
    except BaseException as error:  # a bug, Ctrl-C or SIGTERM: recorded, cleaned up, then re-raised
        report["error"] = f"{type(error).__name__}: {error}"
        raise
    finally:
        problems = PROCS.stop_all()
        if problems:
            report["cleanup_problems"] = problems
            print("[bench] cleanup problems:\n  " + "\n  ".join(problems), file=sys.stderr)
            code = 1
        report["bench_seconds"] = time.time() - t0
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        out = RESULTS_DIR / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.write_text(json.dumps(report, indent=2, default=str))
        keep = args.keep or code != 0  # a failed bench keeps its runs and logs to look at
        if not keep:
            shutil.rmtree(work)
        print_report(report)
        if report.get("error"):
            print(f"FAILED: {report['error']}")
        print(f"bench took {report['bench_seconds']:.0f} s")
        print(f"\nAll figures: {out.relative_to(REPO)}" + (f"; runs and logs kept in {work}" if keep else ""))
    return code


def run_until_final(manager: RunManager, spec, hardware, timeout_s: float) -> tuple:
    """Start a studio run, wait for its final state, reap its supervisor (so its CPU does not
    count as other processes'); returns (view, state, the time the start call returned)."""
    view = manager.start(spec, hardware)
    started = time.time()
    PROCS.runs.append((manager, view.id))
    deadline = time.monotonic() + timeout_s
    while (state := manager.view(view.id).live_state) not in FINAL_STATES:
        if time.monotonic() > deadline:
            raise BenchError(f"run {view.id} still {state} after {timeout_s} s")
        time.sleep(POLL_S)
    view = manager.view(view.id)
    reap(json.loads((view.dir / "supervisor.json").read_text())["pid"])
    return view, state, started

