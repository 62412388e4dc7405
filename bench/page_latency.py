"""Event-to-page latency: how soon an open page shows an event a live run just wrote, and what the
app costs meanwhile with nothing changing.

Run from the repository root (about 8 minutes):

    .venv/bin/python bench/page_latency.py
    .venv/bin/python bench/page_latency.py --samples 30 --idle 20 --tabs train     # a quick check

It prints, per tab, the latency's p50, p95 and max and the app's idle CPU, and writes every sample
to bench/results/page_latency-<time>.json. Goal: p95 at most 1 s.

Method.
1. A live run, real but still: `RunManager.start` starts the tiny SFT recipe (max_steps 1,000,000)
   as the page's Start does -- its real supervisor, torchrun and worker. Once it has made a step the
   worker (the rank, the only writer of progress events) is frozen with SIGSTOP: it uses no CPU and
   writes nothing more, while its supervisor, which the page checks to call the run live
   (supervisor.json's pid and start time), keeps going and appends its hardware samples every 2 s
   as in any run. After the bench the rank gets SIGCONT and the run is stopped like any other.
2. `python launch.py --port <free> --runs-dir <tmp>` starts the app; headless Chromium (Debian's
   /usr/bin/chromium, driven by Playwright) opens it. The Train tab follows the live run by itself;
   for the Runs tab the run is opened in "Open run".
3. Idle: the app's CPU (its process tree, psutil) over --idle seconds (default 60) with that run
   open and only the supervisor's hardware samples coming, and the page's requests to the queue.
4. Latency, --samples times (default 100) per tab: after a random pause (0.2-1.2 s, so appends fall
   at every phase of the page's timer) the bench appends one `progress` event with the next step
   through studio_core.rundir.events, as the worker does, and waits for the tab's progress bar
   (`.run-progress`, its data-step) to show that step.
   The time is taken in the page, not by the bench polling it (a poll would add its own interval and
   CPU): a MutationObserver notes `performance.timeOrigin + performance.now()` when the new step
   lands in the DOM, and again at the next animation frame (when it is drawn). The page's clock is
   mapped to the bench's `time.time()` by reading it between two time.time() calls (the tightest of
   7 reads, before and after the samples, the tighter of the two used; the bracket's width is the
   error, and the two reads' difference the drift: both are reported).
   Latency = the frame's time - the time just before the append.
Noise: the cores other processes used (machine busy time less the app, the browser, the run and the
bench) in each window; a window is quiet when that is under --quiet-cores (default 0.5).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import PROCS, REPO, BenchError, busy_cpu_s, ok, run_bench, wait_quiet  # also sets up sys.path
from app_memory import CHROMIUM, CHROMIUM_ARGS, free_port, wait_http
from runs_tab_cpu import child_env, tree_cpu_s
import psutil
from studio_core.data.builtin import ensure_tiny_model
from studio_core.machine.hardware import cpu_hardware
from studio_core.machine.procs import run_processes
from studio_core.rundir import events
from studio_core.rundir.folder import EVENTS
from studio_core.runs.manager import RunManager
from studio_core.recipe.spec import RunSpec
from studio_core.recipe.validate import validated

RECIPE = REPO / "recipes" / "tiny-sft.yaml"
MAX_STEPS = 1_000_000
RUN_TIMEOUT_S, PAGE_TIMEOUT_S, SHOW_TIMEOUT_S = 300, 90, 30
GAP_S = (0.2, 1.2)
GOAL_P95_S = 1.0
TAB_NAMES = {"train": "Train", "runs": "Runs"}

# Notes when each step first shows in the tab's progress bar: in the DOM, then at the next frame.
OBSERVE_JS = """sel => {
  window.__shown = {};
  const now = () => performance.timeOrigin + performance.now();
  const note = () => {
    const bar = document.querySelector(sel);
    const step = bar && bar.getAttribute('data-step');
    if (step === null || step in window.__shown) return;
    const seen = window.__shown[step] = {dom: now()};
    requestAnimationFrame(() => { seen.frame = now(); });
  };
  new MutationObserver(note).observe(document.body, {subtree: true, childList: true, attributes: true});
  note();
}"""


# --- the live run -----------------------------------------------------------------------------
def start_still_run(manager: RunManager) -> tuple[str, list[psutil.Process], int]:
    """A real run, its rank frozen after its first step: (run id, the frozen ranks, its step)."""
    spec = validated(RunSpec.load(RECIPE).with_overrides([f"max_steps={MAX_STEPS}"]))
    view = manager.start(spec, cpu_hardware())
    PROCS.runs.append((manager, view.id))
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while manager.view(view.id).step < 1:
        if time.monotonic() > deadline or not manager.view(view.id).active:
            raise BenchError(f"run {view.id} made no step in {RUN_TIMEOUT_S} s "
                             f"({manager.view(view.id).live_state})")
        time.sleep(0.2)
    ranks = [p for p in run_processes(view.id) if "studio_core.training.worker" in " ".join(p.cmdline())]
    if not ranks:
        raise BenchError(f"run {view.id}: no worker process found to freeze")
    for rank in ranks:
        rank.send_signal(signal.SIGSTOP)
    time.sleep(1)  # an event the rank was writing lands before the step is read
    return view.id, ranks, manager.view(view.id).step


def thaw(ranks: list[psutil.Process]) -> None:
    """SIGCONT, so that the run's stop (SIGTERM through torchrun) reaches its ranks."""
    for rank in ranks:
        try:
            rank.send_signal(signal.SIGCONT)
        except psutil.NoSuchProcess:
            continue  # ended already


# --- CPU: the app, the run, the rest of this bench's processes, the machine ------------------------
def cpu_now(app_pid: int, run_id: str) -> dict:
    run_s = 0.0
    for proc in run_processes(run_id):
        try:
            times = proc.cpu_times()
            run_s += times.user + times.system
        except psutil.NoSuchProcess:
            continue  # ended between listing and reading
    return {"t": time.monotonic(), "app": tree_cpu_s(app_pid)[0], "ours": tree_cpu_s(os.getpid())[0],
            "run": run_s, "busy": busy_cpu_s()}


def cpu_rates(start: dict, end: dict, quiet_cores: float) -> dict:
    """Cores used over the window: the app; the browser and bench (our processes less the app and
    run; the run was started by this bench); the run; others (the machine less all of ours)."""
    window = end["t"] - start["t"]
    app, run, ours = (end[k] - start[k] for k in ("app", "run", "ours"))
    others = ((end["busy"] - start["busy"]) - ours) / window
    return {"window_s": window, "app_cores": app / window, "browser_and_bench_cores": (ours - app - run) / window,
            "run_cores": run / window, "others_cores": others, "quiet": others < quiet_cores}


# --- the page -----------------------------------------------------------------------------------
def clock_offset(page) -> dict:
    """The page's clock (ms) less time.time() (ms), from the tightest of 7 bracketed reads."""
    best = None
    for _ in range(7):
        before = time.time()
        page_ms = page.evaluate("performance.timeOrigin + performance.now()")
        after = time.time()
        if best is None or after - before < best["bracket_s"]:
            best = {"offset_ms": page_ms - (before + after) / 2 * 1000, "bracket_s": after - before}
    return best


def count_request(request, requests: dict) -> None:
    if "/queue/join" not in request.url and "/run/predict" not in request.url:
        return  # not an event (a queued one joins the queue; one without the queue is posted at once)
    requests["queue"] += 1
    fn = f"fn {(request.post_data_json or {}).get('fn_index')}"
    requests[fn] = requests.get(fn, 0) + 1


def requests_since(counted: dict, requests: dict) -> dict:
    return {"queue_requests": requests["queue"] - counted["queue"],
            "queue_requests_by_event": {k: n - counted.get(k, 0) for k, n in requests.items()
                                        if k != "queue" and n > counted.get(k, 0)}}


def open_tab(page, tab: str, run_id: str, step: int) -> str:
    """Show the tab with the run in it; the selector of the tab's progress bar."""
    selector = f"#tab-{tab} .run-progress"
    page.get_by_role("tab", name=TAB_NAMES[tab]).click()
    if tab == "runs":
        page.locator("#open-run input").first.click()
        page.get_by_role("option", name=run_id, exact=True).click()
    page.locator(f"{selector}[data-step='{step}']").wait_for(timeout=PAGE_TIMEOUT_S * 1000)
    return selector


def measure_tab(page, tab: str, app_pid: int, run_dir: Path, step: int, args, requests: dict) -> dict:
    run_id = run_dir.name
    selector = open_tab(page, tab, run_id, step)
    page.wait_for_timeout(5000)  # settle: the first redraws after opening
    result: dict = {"tab": tab}
    start, counted = cpu_now(app_pid, run_id), dict(requests)
    page.wait_for_timeout(args.idle * 1000)
    result["idle"] = {**cpu_rates(start, cpu_now(app_pid, run_id), args.quiet_cores),
                      **requests_since(counted, requests)}
    result["idle"]["queue_requests_per_s"] = result["idle"]["queue_requests"] / result["idle"]["window_s"]

    page.evaluate(OBSERVE_JS, selector)
    offset_before = clock_offset(page)
    path = run_dir / EVENTS
    samples = []
    start, counted = cpu_now(app_pid, run_id), dict(requests)
    for _ in range(args.samples):
        time.sleep(random.uniform(*GAP_S))
        step += 1
        t0 = time.time()
        events.append(path, events.progress(step, MAX_STEPS, None, step_s=0.02, compile_s=0.0, tokens=100))
        page.wait_for_function("s => window.__shown[s] && window.__shown[s].frame", arg=str(step),
                               polling=100, timeout=SHOW_TIMEOUT_S * 1000)
        shown = page.evaluate("s => window.__shown[s]", str(step))
        samples.append({"step": step, "appended": t0, "dom_ms": shown["dom"], "frame_ms": shown["frame"]})
    result["while_sampling"] = {**cpu_rates(start, cpu_now(app_pid, run_id), args.quiet_cores),
                                **requests_since(counted, requests)}
    offset_after = clock_offset(page)
    offset_ms = min(offset_before, offset_after, key=lambda o: o["bracket_s"])["offset_ms"]  # the tighter read
    for s in samples:
        s["latency_s"] = (s["frame_ms"] - offset_ms) / 1000 - s["appended"]
        s["dom_latency_s"] = (s["dom_ms"] - offset_ms) / 1000 - s["appended"]
    result.update(clock={"before": offset_before, "after": offset_after,
                         "drift_ms": offset_after["offset_ms"] - offset_before["offset_ms"]},
                  latency=summary([s["latency_s"] for s in samples]),
                  dom_latency=summary([s["dom_latency_s"] for s in samples]), samples=samples)
    result["goal_met"] = result["latency"]["p95_s"] <= GOAL_P95_S
    return result


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"samples": len(ordered), "p50_s": statistics.median(ordered),
            "p95_s": statistics.quantiles(ordered, n=100, method="inclusive")[94],
            "max_s": ordered[-1], "min_s": ordered[0], "mean_s": statistics.fmean(ordered)}


def measure(work: Path, args, report: dict) -> None:
    from playwright.sync_api import sync_playwright

    ensure_tiny_model()
    report["quiet_wait"] = wait_quiet(args.wait_quiet, args.quiet_cores)  # others' tests, on a shared machine
    runs_dir = work / "runs"
    manager = RunManager(runs_dir)
    print("[bench] page latency: starting a run and freezing its rank after its first step", flush=True)
    run_id, ranks, step = start_still_run(manager)
    report.update(run_id=run_id, frozen_at_step=step,
                  machine={"cpus": os.cpu_count(), "load_at_start": os.getloadavg()})
    try:
        port, log_path = free_port(), work / "app.log"
        url = f"http://127.0.0.1:{port}/"
        with open(log_path, "wb") as log:
            app = subprocess.Popen([sys.executable, "launch.py", "--port", str(port), "--runs-dir", str(runs_dir)],
                                   cwd=REPO, env=child_env(), stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        PROCS.groups.append(app)
        wait_http(url, app, log_path)
        report["tabs"] = []
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1100})
                page.set_default_timeout(PAGE_TIMEOUT_S * 1000)
                requests: dict = {"queue": 0}  # the page's queue requests: every one, and by event (fn_index)
                page.on("request", lambda request: count_request(request, requests))
                page.goto(url, wait_until="domcontentloaded")
                for tab in args.tabs.split(","):
                    print(f"[bench]   {tab} tab: {args.idle:.0f} s idle, then {args.samples} events", flush=True)
                    row = measure_tab(page, tab, app.pid, runs_dir / run_id, step, args, requests)
                    step += args.samples
                    report["tabs"].append(row)
                    print(f"[bench]   {format_row(row)}", flush=True)
            finally:
                browser.close()
        report["machine"]["load_at_end"] = os.getloadavg()
    finally:
        thaw(ranks)


def format_row(row: dict) -> str:
    lat, idle, busy = row["latency"], row["idle"], row["while_sampling"]
    return (f"{row['tab']}: latency p50 {lat['p50_s']:.3f} s, p95 {lat['p95_s']:.3f} s, max {lat['max_s']:.3f} s "
            f"({lat['samples']} samples; goal p95 <= {GOAL_P95_S} s {ok(row['goal_met'])}); app CPU idle "
            f"{idle['app_cores']:.3f} cores ({idle['queue_requests_per_s']:.1f} queue requests/s), "
            f"while sampling {busy['app_cores']:.3f}; others {idle['others_cores']:.2f} / "
            f"{busy['others_cores']:.2f} cores ({'quiet' if idle['quiet'] and busy['quiet'] else 'NOT quiet'})")


def print_report(report: dict) -> None:
    for row in report.get("tabs") or []:
        dom = row["dom_latency"]
        print(format_row(row))
        print(f"  in the DOM (before the frame): p50 {dom['p50_s']:.3f} s, p95 {dom['p95_s']:.3f} s, max "
              f"{dom['max_s']:.3f} s; clock bracket {row['clock']['before']['bracket_s'] * 1000:.1f} / "
              f"{row['clock']['after']['bracket_s'] * 1000:.1f} ms, drift {row['clock']['drift_ms']:.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description="How soon an open page shows a live run's new event.")
    parser.add_argument("--samples", type=int, default=100, help="events appended per tab (default 100)")
    parser.add_argument("--idle", type=float, default=60, help="seconds of idle CPU measured per tab (default 60)")
    parser.add_argument("--tabs", default="train,runs", help="tabs to measure, in order (default train,runs)")
    parser.add_argument("--quiet-cores", type=float, default=0.5,
                        help="others' cores under which a window counts as quiet (default 0.5)")
    parser.add_argument("--wait-quiet", type=float, default=120,
                        help="seconds to wait at most for a quiet 2 s before starting (default 120)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (run, app log)")
    args = parser.parse_args()
    if args.samples < 2 or args.idle <= 0 or not set(args.tabs.split(",")) <= set(TAB_NAMES):
        parser.error(f"--samples at least 2, --idle positive, --tabs of {', '.join(TAB_NAMES)}")
    signal.signal(signal.SIGINT, signal.default_int_handler)  # see runs_tab_cpu.main
    return run_bench("page_latency", args, measure, print_report)


if __name__ == "__main__":
    sys.exit(main())
