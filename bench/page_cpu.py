"""The browser's and the app's CPU while a page follows a going run: this checkout against another
(say, a clone at an older commit), alternated.

    .venv/bin/python bench/page_cpu.py --other /tmp/old-clone [--rounds 5] [--seconds 30]

Each round, for each checkout in turn (this one first in odd rounds, the other first in even ones):
its app (`launch.py --port <free> --runs-dir <tmp>`) and a live run of recipes/tiny-sft.yaml
(max_steps 100000, `launch.py train --detach`), started from that checkout; once the run has
logged a step, headless Chromium (Debian's /usr/bin/chromium, through Playwright) opens the page,
whose Train tab follows the run by itself. Then the CPU of every Chromium process and of the app's
process tree over --seconds, and of the other processes on the machine (noise); the run is stopped.
Prints each side's median and spread, and writes bench/results/page_cpu-<time>.json. Needs
Playwright and /usr/bin/chromium, as the browser tests do.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

from common import PROCS, REPO, BenchError, Noise, run_bench, tree_cpu_s  # also sets up sys.path
from app_memory import CHROMIUM, CHROMIUM_ARGS, free_port, wait_http
from runs_tab_cpu import child_env
from studio_core.runs.manager import RunManager


def chromium_cpu_s() -> float:
    total = 0.0
    for proc in psutil.process_iter(["exe", "cpu_times"]):
        if proc.info["exe"] and "chromium" in proc.info["exe"] and proc.info["cpu_times"]:
            total += proc.info["cpu_times"].user + proc.info["cpu_times"].system
    return total


def start_app(checkout: Path, runs: Path) -> tuple[subprocess.Popen, str]:
    port, log_path = free_port(), runs.parent / f"{runs.name}-app.log"
    with open(log_path, "w") as log:
        app = subprocess.Popen([sys.executable, "launch.py", "--port", str(port), "--runs-dir", str(runs)],
                               cwd=checkout, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    PROCS.groups.append(app)
    url = f"http://127.0.0.1:{port}/"
    wait_http(url, app, log_path)
    return app, url


def start_run(checkout: Path, runs: Path) -> str:
    subprocess.run([sys.executable, "launch.py", "train", "recipes/tiny-sft.yaml", "--runs-dir", str(runs),
                    "--set", "max_steps=100000", "--detach"], cwd=checkout, env=child_env(), check=True,
                   capture_output=True)
    manager = RunManager(runs)
    (view,) = manager.list()
    PROCS.runs.append((manager, view.id))
    for _ in range(240):
        if manager.view(view.id).metrics:
            return view.id
        time.sleep(0.5)
    raise BenchError(f"run {view.id} of {checkout} logged no step in 2 minutes")


def one(browser, checkout: Path, work: Path, seconds: float) -> dict:
    runs = work / f"runs-{time.monotonic_ns()}"
    runs.mkdir()
    app, url = start_app(checkout, runs)
    run_id = start_run(checkout, runs)
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    page.goto(url, wait_until="domcontentloaded")
    page.locator("#start").wait_for()
    time.sleep(3)  # the page has found the run and drawn it
    chromium, server, noise = chromium_cpu_s(), tree_cpu_s(app.pid), Noise(mine=(app.pid,))
    time.sleep(seconds)
    row = {"chromium_cpu_s": chromium_cpu_s() - chromium, "app_cpu_s": tree_cpu_s(app.pid) - server,
           "others_cores": noise.others_cores()}  # others include Chromium and the run: see print_report
    page.close()
    RunManager(runs).stop(run_id)
    PROCS.stop_group(app)
    return row


def measure(work: Path, args, report: dict) -> None:
    from playwright.sync_api import sync_playwright

    sides = {"this": REPO, "other": Path(args.other).resolve()}
    report["checkouts"] = {name: str(path) for name, path in sides.items()}
    report["rows"] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for round_ in range(args.rounds):
            for name in (["this", "other"] if round_ % 2 == 0 else ["other", "this"]):
                row = {"round": round_, "side": name, **one(browser, sides[name], work, args.seconds)}
                report["rows"].append(row)
                print(row, flush=True)
        browser.close()
    report["summary"] = {
        name: {key: {"median": statistics.median(values), "min": min(values), "max": max(values)}
               for key in ("chromium_cpu_s", "app_cpu_s", "others_cores")
               for values in [[row[key] for row in report["rows"] if row["side"] == name]]}
        for name in sides}


def print_report(report: dict) -> None:
    print(f"\nCPU seconds over {report['args']['seconds']:g} s of a page following a going run "
          f"({report['args']['rounds']} rounds each, alternated): median (min-max)")
    for name, stats in report.get("summary", {}).items():
        print(f"  {name:5s} {report['checkouts'][name]}: " + "; ".join(
            f"{key} {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})" for key, s in stats.items()))
    print("others_cores: the machine's busy cores less the bench and the app; it includes Chromium and the run, "
          "so compare it between the sides, not with zero.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--other", required=True, help="another checkout of the studio to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    return run_bench("page_cpu", parser.parse_args(), measure, print_report)


if __name__ == "__main__":
    sys.exit(main())
