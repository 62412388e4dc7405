"""The web app's memory while a run streams to an open page.

Run from the repository root (about 2 minutes):

    .venv/bin/python bench/app_memory.py
    .venv/bin/python bench/app_memory.py --seconds 90 --max-steps 5000

It prints the figures and writes them, with every sample, to bench/results/app_memory-<time>.json.

Method: `python launch.py --port <free> --runs-dir <tmp>` is started; a headless Chromium (Debian's
/usr/bin/chromium, driven by Playwright) opens the page, sets max_steps (--max-steps, default 3000)
and clicks Start (#start), so the app itself starts the run and streams it to the open page. The
app's RSS -- the app process plus its descendants that are not part of the run (the run's processes
carry STUDIO_RUN_ID and are left out) -- is sampled every 0.5 s: 5 s idle with the page open, then
while the run streams (--seconds, default 60, from its first step). Peak and median while streaming
are reported in MB (2**20 bytes); target < 500 MB. Also reported: the CPU the app, the browser (with
Playwright's driver), the bench and the whole machine used meanwhile, and the run's steps/s. Then
the page's Stop button (#stop) stops the run, the bench checks that none of the run's processes is
left, and the app is shut down with SIGINT, as Ctrl-C in a terminal would.
"""

from __future__ import annotations

import argparse
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from common import (MB, POLL_S, PROCS, REPO, BenchError, busy_cpu_s, ok, rate,  # also sets up sys.path
                    run_bench, tail)
import psutil
from studio_core.data.builtin import ensure_tiny_model
from studio_core.rundir.events import FINAL_STATES
from studio_core.machine.procs import run_processes
from studio_core.runs.manager import RunManager

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
APP_TIMEOUT_S, RUN_TIMEOUT_S = 180, 600
TARGET_RSS_MB = 500


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, log_path: Path) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < APP_TIMEOUT_S:
        if proc.poll() is not None:
            raise BenchError(f"the app exited with code {proc.returncode} before answering:\n{tail(log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)  # not listening yet
    raise BenchError(f"the app did not answer {url} within {APP_TIMEOUT_S} s:\n{tail(log_path)}")


def app_usage(pid: int) -> tuple[int, int, float]:
    """(RSS bytes, processes counted, CPU seconds so far) of the app and its descendants that do not
    carry STUDIO_RUN_ID: the run's processes are the training's memory, not the app's."""
    total = counted = 0
    cpu = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess as error:
        raise BenchError(f"the app (pid {pid}) is gone") from error
    for proc in procs:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE or "STUDIO_RUN_ID" in proc.environ():
                continue
            total += proc.memory_info().rss
            times = proc.cpu_times()
            cpu += times.user + times.system
            counted += 1
        except psutil.NoSuchProcess:
            continue  # ended between listing and reading: it holds no memory any more
    return total, counted, cpu


def browser_cpu_s(app_pid: int) -> float:
    """CPU seconds of this bench's live descendants other than the app: Playwright's driver and Chromium."""
    total = 0.0
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.pid == app_pid or app_pid in {parent.pid for parent in proc.parents()}:
                continue
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            continue  # ended between listing and reading
    return total


def bench_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_folders(runs_dir: Path) -> list[str]:
    """Run folders the app has started a supervisor in (not the .creating-* ones start() renames)."""
    return sorted(p.name for p in runs_dir.iterdir()
                  if not p.name.startswith(".") and (p / "supervisor.json").exists())


def measure(work: Path, args, report: dict) -> None:
    from playwright.sync_api import sync_playwright

    ensure_tiny_model()  # built once here, so the app's run does not spend its first minute on it
    runs_dir, log_path, port = work / "app-runs", work / "app.log", free_port()
    url = f"http://127.0.0.1:{port}/"
    print(f"[bench] app memory: starting the app, a {args.max_steps}-step run from the page, "
          f"sampling {args.seconds:.0f} s of streaming", flush=True)
    with open(log_path, "wb") as log:
        t0 = time.monotonic()
        app = subprocess.Popen([sys.executable, "launch.py", "--port", str(port), "--runs-dir", str(runs_dir)],
                               cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    PROCS.groups.append(app)
    manager = RunManager(runs_dir)
    wait_http(url, app, log_path)
    result: dict = {"url": url, "ready_s": time.monotonic() - t0}
    report["memory"] = result
    samples: list[dict] = []  # {t, rss_mb, procs, phase, state, step, page_step, cpu counters}

    def sample(phase: str, run_id: str | None, page) -> dict:
        rss, counted, cpu = app_usage(app.pid)
        row = {"t": time.time(), "rss_mb": rss / MB, "procs": counted, "cpu_s": cpu, "phase": phase,
               "browser_cpu_s": browser_cpu_s(app.pid), "bench_cpu_s": bench_cpu_s(), "busy_cpu_s": busy_cpu_s()}
        if run_id:
            view = manager.view(run_id)
            row.update(state=view.live_state, step=view.step)
            progress = page.locator(".run-progress")
            step = progress.first.get_attribute("data-step", timeout=2000) if progress.count() else None
            row["page_step"] = None if step is None else int(step)
        samples.append(row)
        return row

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page()
            page.set_default_timeout(30_000)
            page.goto(url, wait_until="domcontentloaded", timeout=60_000)
            page.locator("#start").wait_for(state="visible")
            page.locator("#max_steps input").fill(str(args.max_steps))
            page.locator("#max_steps input").press("Tab")
            for _ in range(int(5 / POLL_S)):  # the idle app with the page open, for reference
                sample("idle", None, page)
                page.wait_for_timeout(POLL_S * 1000)
            page.locator("#start").click()
            deadline = time.monotonic() + 60
            while not (made := run_folders(runs_dir)):
                if time.monotonic() > deadline:
                    message = page.locator("#train-message").inner_text()
                    raise BenchError(f"clicking Start made no run in 60 s; the page says: {message!r}")
                page.wait_for_timeout(200)
            run_id = made[0]
            PROCS.runs.append((manager, run_id))
            spec_steps = manager.view(run_id).spec.get("max_steps")
            if spec_steps != args.max_steps:
                raise BenchError(f"the app started run {run_id} with max_steps {spec_steps}, "
                                 f"not {args.max_steps}: the form was not filled")
            first_step_at = None
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while True:
                row = sample("starting" if first_step_at is None else "streaming", run_id, page)
                if first_step_at is None and row["step"] > 0:
                    first_step_at = time.monotonic()
                    row["phase"] = "streaming"
                if row["state"] in FINAL_STATES:
                    break
                if first_step_at is not None and time.monotonic() - first_step_at >= args.seconds:
                    break
                if time.monotonic() > deadline:
                    raise BenchError(f"run {run_id} in the app: no streaming window within {RUN_TIMEOUT_S} s")
                page.wait_for_timeout(POLL_S * 1000)
            result["run_state_at_stop"] = row["state"]
            page.locator("#stop").click()
            deadline = time.monotonic() + 60
            while manager.view(run_id).live_state not in FINAL_STATES:
                if time.monotonic() > deadline:
                    raise BenchError(f"run {run_id} not stopped 60 s after clicking Stop")
                page.wait_for_timeout(POLL_S * 1000)
            page.wait_for_timeout(1500)  # let the app finish answering the click
            result["stop_message"] = page.locator("#train-message").inner_text()
            result["run_final_state"] = manager.view(run_id).live_state
            result["run_processes_left"] = [p.pid for p in run_processes(run_id)]
            sample("after-stop", None, page)
        finally:
            browser.close()
    PROCS.stop_group(app, first=signal.SIGINT, grace_s=15)  # Ctrl-C, then SIGTERM/SIGKILL if needed
    result["app_exit_code"] = app.returncode

    streaming = [s for s in samples if s["phase"] == "streaming"]
    if not streaming:
        raise BenchError("no memory sample was taken while the run streamed")
    first, last = streaming[0], streaming[-1]
    window_s = last["t"] - first["t"]
    rss = [s["rss_mb"] for s in streaming]
    page_steps = [s["page_step"] for s in streaming if s.get("page_step") is not None]
    result.update({
        "run_id": run_id, "max_steps": args.max_steps,
        "streaming_samples": len(streaming), "streaming_seconds": window_s,
        "app_cpu_cores_while_streaming": rate(first["cpu_s"], last["cpu_s"], window_s),
        "browser_cpu_cores_while_streaming": rate(first["browser_cpu_s"], last["browser_cpu_s"], window_s),
        "bench_cpu_cores_while_streaming": rate(first["bench_cpu_s"], last["bench_cpu_s"], window_s),
        "machine_busy_cores_while_streaming": rate(first["busy_cpu_s"], last["busy_cpu_s"], window_s),
        "run_steps_per_s_while_streaming": rate(first["step"], last["step"], window_s),
        "peak_rss_mb": max(rss), "median_rss_mb": statistics.median(rss),
        "idle_median_rss_mb": statistics.median(s["rss_mb"] for s in samples if s["phase"] == "idle"),
        "peak_rss_mb_whole_session": max(s["rss_mb"] for s in samples),
        "run_steps_during_window": [first["step"], last["step"]],
        "page_steps_during_window": [page_steps[0], page_steps[-1]] if page_steps else None,
        "samples": samples,
    })
    if not page_steps or page_steps[-1] <= page_steps[0]:
        raise BenchError(f"the page did not stream the run (steps shown: {page_steps[:3]}...{page_steps[-3:]})")


def print_report(report: dict) -> None:
    memory = report.get("memory")
    if not memory or "peak_rss_mb" not in memory:
        return
    print(f"\napp RSS while streaming ({memory['streaming_samples']} samples over "
          f"{memory['streaming_seconds']:.0f} s, run steps {memory['run_steps_during_window'][0]}->"
          f"{memory['run_steps_during_window'][1]}, page showed steps {memory['page_steps_during_window']}): "
          f"peak {memory['peak_rss_mb']:.0f} MB, median {memory['median_rss_mb']:.0f} MB "
          f"(target < {TARGET_RSS_MB} MB) {ok(memory['peak_rss_mb'] < TARGET_RSS_MB)}")
    print(f"  idle with the page open {memory['idle_median_rss_mb']:.0f} MB; while streaming the app used "
          f"{memory['app_cpu_cores_while_streaming']:.2f} cores (browser {memory['browser_cpu_cores_while_streaming']:.2f}, "
          f"bench {memory['bench_cpu_cores_while_streaming']:.2f}, whole machine "
          f"{memory['machine_busy_cores_while_streaming']:.2f}) and the run made "
          f"{memory['run_steps_per_s_while_streaming']:.1f} steps/s; after Stop the run is "
          f"{memory['run_final_state']}, its processes left: {memory['run_processes_left'] or 'none'}")


def main() -> int:
    parser = argparse.ArgumentParser(description="The web app's memory while a run streams to an open page.")
    parser.add_argument("--seconds", type=float, default=60, help="seconds of streaming to sample (default 60)")
    parser.add_argument("--max-steps", type=int, default=3000, help="max_steps of the app's run (default 3000)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (runs, logs)")
    return run_bench("app_memory", parser.parse_args(), measure, print_report)


if __name__ == "__main__":
    sys.exit(main())
