"""The web app's CPU and memory, idle, with the Runs tab open on a long run history (200 finished runs).

Run from the repository root (about 20 minutes for the default 5 rounds of 2 sides):

    .venv/bin/python bench/runs_tab_cpu.py --runs 20 --window 15 --rounds 1     # a quick check
    .venv/bin/python bench/runs_tab_cpu.py --compare /path/to/an/older/checkout  # before vs after
    .venv/bin/python bench/runs_tab_cpu.py --repo /path/to/a/checkout            # that checkout alone

It prints a table of rounds and, per side, the median and spread (min-max) of the app's CPU and RSS, and
writes every figure to bench/results/runs_tab_cpu-<time>.json. Target: an idle page with 200 runs
in its history costs near nothing.

The checkout measured (--repo, default the one this script lives in; --compare OLD_REPO adds a
second side) is used only through what every version has: its CLI and the page in a browser, so the
same script measures old and new code. For each side, once:
1. A runs folder with --runs finished runs (default 200): `python <repo>/launch.py train
   <repo>/recipes/tiny-sft.yaml --set max_steps=20 --set save_steps=10 --set save_strategy=steps
   --runs-dir <template>` trains one tiny run with two checkpoints (the recipe's save_strategy
   "no" would keep save_steps from saving any); its folder is then copied --runs - 1 times
   (shutil.copytree) under new run ids of the same form, YYYYmmdd-HHMMSS-<name>-<6 hex>, each an
   hour before the one after it, with the run id, the run folder's path and the events' times
   changed to match, so the runs sort and show as distinct runs. Each side's runs are trained by
   its own code (the folder format may change between versions); nothing writes to the folder
   afterwards, so every round reuses it.
Then --rounds rounds (default 5); with --compare the sides alternate (round 1: new, old; round 2:
old, new; ...). A measurement: `python launch.py --port <free> --runs-dir <runs>` is started from
the side's checkout (its own session); a headless Chromium (Debian's /usr/bin/chromium, driven by
Playwright) opens the page and clicks the Runs tab; once the table lists every run (its grid's
aria-rowcount, read again at the end) the page settles (--settle, default 10 s). Then the CPU
seconds (user + system, psutil) of the app process and its descendants -- reaped children
included -- are read at the start and end of a --window of wall time (default 60 s): CPU =
their difference / the window, as a fraction of one core. The app's memory is its RSS with its
descendants' (app_memory.app_usage), read once a second in the window: median and peak, in MB
(2**20 bytes). Also recorded: the page's event requests during the window (the timers' ticks,
queued or not, showing the page really polls), the browser's CPU, the cores
the rest of the machine used (machine busy time minus the app, browser and bench) and the load
average before and after, and errors in the app's log. The app is stopped (SIGINT to its process
group, then SIGKILL to what is left) and the browser closed after every measurement, however it
ended.

Noise: other processes on the machine slow the app but hardly change the CPU seconds it needs;
the `others` column and the load average say how busy the machine was. The machine is called quiet
when others used under --quiet-cores (default 0.5) in every window.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import PROCS, REPO, BenchError, busy_cpu_s, ok, tail, run_bench  # also sets up sys.path
from app_memory import CHROMIUM, CHROMIUM_ARGS, app_usage, browser_cpu_s, free_port, wait_http
import psutil
from studio_core.machine.procs import kill_run_processes

RUN_ID = re.compile(r"^(\d{8}-\d{6})-(.+)-([0-9a-f]{6})$")
ID_TIME = "%Y%m%d-%H%M%S"
TRAIN_SETS = ["max_steps=20", "save_steps=10", "save_strategy=steps"]
TRAIN_TIMEOUT_S, PAGE_TIMEOUT_S = 600, 60
TEXT_SUFFIXES = {".json", ".jsonl", ".yaml", ".yml", ".log", ".txt", ".md"}
ERROR_LINE = re.compile(r"Traceback|Error|Exception")


# --- the checkouts --------------------------------------------------------------------------
def git_info(repo: Path) -> dict:
    """The checkout's commit and whether it has uncommitted changes (None outside git)."""
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return {"commit": None, "dirty": None}
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True)
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


def checked_repo(path: str) -> Path:
    repo = Path(path).resolve()
    for needed in ("launch.py", "recipes/tiny-sft.yaml"):
        if not (repo / needed).is_file():
            raise BenchError(f"{repo} is not a checkout of the studio: it has no {needed}")
    return repo


def child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "STUDIO_RUNS_DIR")}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    return env


# --- step 1: the runs folder ------------------------------------------------------------------
def train_template(repo: Path, template: Path, log_path: Path) -> Path:
    """Train one tiny run with checkpoints into `template` with the checkout's CLI; its folder."""
    argv = [sys.executable, str(repo / "launch.py"), "train", str(repo / "recipes" / "tiny-sft.yaml")]
    for item in TRAIN_SETS:
        argv += ["--set", item]
    argv += ["--runs-dir", str(template)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=repo, env=child_env(), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    PROCS.groups.append(proc)
    try:
        proc.wait(timeout=TRAIN_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        raise BenchError(f"training the template run took over {TRAIN_TIMEOUT_S} s:\n{tail(log_path)}") from error
    finally:
        PROCS.stop_group(proc)  # the CLI and anything of its group still there
        PROCS.groups.remove(proc)
        for run in (template.iterdir() if template.is_dir() else []):
            if RUN_ID.match(run.name):
                left = kill_run_processes(run.name)  # a run's processes, should any outlive the CLI
                if left:
                    raise BenchError(f"run {run.name}: processes survived SIGKILL: {[p.pid for p in left]}")
    runs = [p for p in template.iterdir() if RUN_ID.match(p.name)] if template.is_dir() else []
    if proc.returncode != 0 or len(runs) != 1:
        raise BenchError(f"`launch.py train` exited with {proc.returncode} and made {len(runs)} runs "
                         f"(wanted 1):\n{tail(log_path)}")
    checkpoints = sorted(p.name for p in (runs[0] / "output").glob("checkpoint-*"))
    if not checkpoints:
        raise BenchError(f"the template run {runs[0]} saved no checkpoint:\n{tail(log_path)}")
    return runs[0]


def copy_run(source: Path, runs_dir: Path, run_id: str, shift_s: float) -> Path:
    """Copy a run folder under a new id, `shift_s` seconds earlier: the id and folder path in its
    text files and the times of its events are changed to match, and so are its files' times."""
    dest = runs_dir / run_id
    shutil.copytree(source, dest)
    for path in dest.rglob("*"):
        if not path.is_file() or path.suffix not in TEXT_SUFFIXES:
            continue
        text = path.read_text(errors="surrogateescape")
        new = text.replace(str(source), str(dest)).replace(source.name, run_id)
        if path.name == "events.jsonl" and shift_s:
            lines = []
            for line in new.splitlines():
                event = json.loads(line) if line.strip() else None
                if isinstance(event, dict) and isinstance(event.get("time"), (int, float)):
                    event["time"] -= shift_s
                    line = json.dumps(event)
                lines.append(line)
            new = "\n".join(lines) + "\n"
        if new != text:
            path.write_text(new, errors="surrogateescape")
    # bottom-up, so setting a file's times does not touch its folder's afterwards
    for path in sorted(dest.rglob("*"), key=lambda p: len(p.parts), reverse=True) + [dest]:
        original = source / path.relative_to(dest)
        stat = original.lstat()
        os.utime(path, ns=(stat.st_atime_ns - int(shift_s * 1e9), stat.st_mtime_ns - int(shift_s * 1e9)),
                 follow_symlinks=False)
    return dest


def make_runs_folder(repo: Path, side_dir: Path, count: int) -> dict:
    """`count` finished runs in side_dir/runs: the trained template run and count - 1 copies."""
    t0 = time.monotonic()
    template = train_template(repo, side_dir / "template", side_dir / "train.log")
    trained_s = time.monotonic() - t0
    stamp, name, _ = RUN_ID.match(template.name).groups()
    start = time.mktime(time.strptime(stamp, ID_TIME))
    runs_dir = side_dir / "runs"
    runs_dir.mkdir()
    copy_run(template, runs_dir, template.name, 0)
    ids = {template.name}
    for k in range(1, count):
        while (run_id := f"{time.strftime(ID_TIME, time.localtime(start - k * 3600))}-{name}-"
                         f"{secrets.token_hex(3)}") in ids:
            continue
        ids.add(run_id)
        copy_run(template, runs_dir, run_id, k * 3600)
    made = sorted(p.name for p in runs_dir.iterdir() if RUN_ID.match(p.name))
    size = sum(f.stat().st_size for f in runs_dir.rglob("*") if f.is_file())
    return {"runs_dir": str(runs_dir), "template_run": template.name, "runs": len(made),
            "checkpoints_per_run": len(list((template / "output").glob("checkpoint-*"))),
            "files_per_run": sum(1 for f in template.rglob("*") if f.is_file()),
            "runs_dir_mb": size / 2 ** 20, "train_s": trained_s, "setup_s": time.monotonic() - t0,
            "oldest": made[0], "newest": made[-1]}


# --- steps 2 and 3: one measurement ----------------------------------------------------------
def tree_cpu_s(pid: int) -> tuple[float, int]:
    """CPU seconds (user + system) of a process and its live descendants, with the children each
    has reaped; and how many processes that is."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess as error:
        raise BenchError(f"the app (pid {pid}) is gone") from error
    total, counted = 0.0, 0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue  # ended between listing and reading; its parent's children_* has it once reaped
        total += times.user + times.system + times.children_user + times.children_system
        counted += 1
    return total, counted


def own_cpu_s() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system


def table_rows(page) -> int | None:
    """Rows the Runs table says it has: its grid's aria-rowcount less the header row (the grid is
    virtual: only the rows in view are in the page)."""
    grid = page.locator("#runs-table [role=grid]")
    if not grid.count():
        return None
    count = grid.first.get_attribute("aria-rowcount")
    return None if count is None else int(count) - 1


def log_errors(log_path: Path) -> list[str]:
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    return [line for line in lines if ERROR_LINE.search(line)]


def measure_once(pw, side: str, repo: Path, runs_dir: Path, expected: int, args, log_path: Path) -> dict:
    """Start the app, open the Runs tab, settle, and read the app's CPU over the window."""
    row: dict = {"side": side, "load_before_start": os.getloadavg()}
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    with open(log_path, "wb") as log:
        app = subprocess.Popen([sys.executable, "launch.py", "--port", str(port), "--runs-dir", str(runs_dir)],
                               cwd=repo, env=child_env(), stdin=subprocess.DEVNULL, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    PROCS.groups.append(app)
    browser = None
    try:
        t0 = time.monotonic()
        wait_http(url, app, log_path)
        row["ready_s"] = time.monotonic() - t0
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page()
        page.set_default_timeout(30_000)
        requests = {"queue": 0, "failed": 0}  # the page's requests to the app's queue: the timers' ticks

        def on_request(request) -> None:
            if "/queue/join" in request.url or "/run/predict" in request.url:  # queued or not
                requests["queue"] += 1

        def on_failed(request) -> None:
            requests["failed"] += 1

        page.on("request", on_request)
        page.on("requestfailed", on_failed)
        page.goto(url, wait_until="domcontentloaded", timeout=PAGE_TIMEOUT_S * 1000)
        tab = page.get_by_role("tab", name="Runs")
        tab.wait_for(state="visible", timeout=PAGE_TIMEOUT_S * 1000)
        tab.click()
        t_click = time.monotonic()
        while (rows := table_rows(page)) != expected and time.monotonic() - t_click < PAGE_TIMEOUT_S:
            page.wait_for_timeout(250)
        row["rows_after_click"] = rows
        row["rows_shown_s"] = time.monotonic() - t_click
        row["runs_tab_selected"] = tab.get_attribute("aria-selected") == "true"
        page.wait_for_timeout(args.settle * 1000)

        start = {"t": time.monotonic(), "app": tree_cpu_s(app.pid), "browser": browser_cpu_s(app.pid),
                 "bench": own_cpu_s(), "busy": busy_cpu_s(), "queue": requests["queue"],
                 "failed": requests["failed"], "load": os.getloadavg()}
        rss = []  # the app's memory (with its children, as app_memory counts it), once a second
        while time.monotonic() - start["t"] < args.window:
            rss.append(app_usage(app.pid)[0] / 2 ** 20)
            page.wait_for_timeout(min(1000, max(0, args.window - (time.monotonic() - start["t"])) * 1000))
        end = {"t": time.monotonic(), "app": tree_cpu_s(app.pid), "browser": browser_cpu_s(app.pid),
               "bench": own_cpu_s(), "busy": busy_cpu_s(), "queue": requests["queue"],
               "failed": requests["failed"], "load": os.getloadavg()}
        window = end["t"] - start["t"]
        app_s = end["app"][0] - start["app"][0]
        browser_s = end["browser"] - start["browser"]
        bench_s = end["bench"] - start["bench"]
        row.update({
            "window_s": window, "app_cpu_s": app_s, "app_cpu": app_s / window,
            "app_processes": [start["app"][1], end["app"][1]],
            "app_rss_mb": statistics.median(rss), "app_rss_peak_mb": max(rss), "rss_samples": len(rss),
            "browser_cpu": browser_s / window, "bench_cpu": bench_s / window,
            "machine_busy_cores": (end["busy"] - start["busy"]) / window,
            "others_cores": ((end["busy"] - start["busy"]) - app_s - browser_s - bench_s) / window,
            "queue_requests": end["queue"] - start["queue"], "failed_requests": end["failed"] - start["failed"],
            "load_start": start["load"], "load_end": end["load"], "rows_at_end": table_rows(page),
        })
        row["errors_in_log"] = log_errors(log_path)  # before the stop, whose Ctrl-C may log its own
    finally:
        try:
            if browser is not None:
                browser.close()
        finally:
            PROCS.stop_group(app, first=signal.SIGINT, grace_s=15)  # Ctrl-C, then SIGKILL if needed
            PROCS.groups.remove(app)
    row["app_exit_code"] = app.returncode
    row["rows_ok"] = row["rows_after_click"] == expected and row["rows_at_end"] == expected
    return row


# --- step 4: the rounds ---------------------------------------------------------------------
def measure(work: Path, args, report: dict) -> None:
    from playwright.sync_api import sync_playwright

    sides = {"new": checked_repo(args.repo)}
    if args.compare:
        sides["old"] = checked_repo(args.compare)
    report["sides"] = {side: {"repo": str(repo), **git_info(repo)} for side, repo in sides.items()}
    report["machine"] = {"cpus": os.cpu_count(), "load_at_start": os.getloadavg()}
    for side, repo in sides.items():
        print(f"[bench] {side} ({repo}): training the template run, copying it to {args.runs} runs", flush=True)
        (work / side).mkdir()
        report["sides"][side].update(make_runs_folder(repo, work / side, args.runs))
        info = report["sides"][side]
        print(f"[bench]   {info['runs']} runs, {info['runs_dir_mb']:.0f} MB, {info['checkpoints_per_run']} "
              f"checkpoints and {info['files_per_run']} files each ({info['setup_s']:.0f} s)", flush=True)
    rounds: list[dict] = []
    report["rounds"] = rounds
    with sync_playwright() as pw:
        for i in range(args.rounds):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]
            for side in order:
                log_path = work / side / f"app-round{i + 1}.log"
                row = measure_once(pw, side, sides[side], Path(report["sides"][side]["runs_dir"]),
                                   args.runs, args, log_path)
                row.update(round=i + 1, log=str(log_path))
                rounds.append(row)
                print(f"[bench] round {i + 1} {side}: {format_row(row)}", flush=True)
    report["summary"] = summarize(rounds, list(sides), args)
    report["machine"]["load_at_end"] = os.getloadavg()
    if not all(r["rows_ok"] for r in rounds):
        raise BenchError("the Runs tab did not list every run in some round (see rows_after_click, rows_at_end)")


def summarize(rounds: list[dict], sides: list[str], args) -> dict:
    summary = {}
    for side in sides:
        cpu = [r["app_cpu"] for r in rounds if r["side"] == side]
        others = [r["others_cores"] for r in rounds if r["side"] == side]
        rss = [r["app_rss_mb"] for r in rounds if r["side"] == side]
        summary[side] = {"app_cpu_median": statistics.median(cpu), "app_cpu_min": min(cpu), "app_cpu_max": max(cpu),
                         "app_rss_mb_median": statistics.median(rss), "app_rss_mb_min": min(rss),
                         "app_rss_mb_max": max(rss),
                         "app_rss_peak_mb": max(r["app_rss_peak_mb"] for r in rounds if r["side"] == side),
                         "app_cpu_rounds": cpu, "others_cores_median": statistics.median(others),
                         "load_start": [r["load_start"][0] for r in rounds if r["side"] == side],
                         "load_end": [r["load_end"][0] for r in rounds if r["side"] == side]}
    if "old" in summary and summary["old"]["app_cpu_median"] > 0:
        summary["new_over_old"] = summary["new"]["app_cpu_median"] / summary["old"]["app_cpu_median"]
    summary["quiet"] = all(r["others_cores"] < args.quiet_cores for r in rounds)
    return summary


def format_row(row: dict) -> str:
    return (f"app {row['app_cpu']:.3f} cores ({row['app_cpu_s']:.1f} CPU s in {row['window_s']:.0f} s), "
            f"rows {row['rows_after_click']}/{row['rows_at_end']} {ok(row['rows_ok'])}, "
            f"{row['queue_requests']} queue requests, browser {row['browser_cpu']:.2f}, "
            f"others {row['others_cores']:.2f}, load {row['load_start'][0]:.2f}->{row['load_end'][0]:.2f}, "
            f"{len(row['errors_in_log'])} error lines in the log")


def print_report(report: dict) -> None:
    rounds = report.get("rounds") or []
    if not rounds:
        return
    print(f"\n{'round':>5} {'side':>4} {'app CPU':>8} {'CPU s':>6} {'RSS MB':>6} {'window':>6} {'rows':>9} "
          f"{'ticks':>5} {'browser':>7} {'others':>6} {'load 1m':>11} errors")
    for r in rounds:
        if "app_cpu" not in r:
            continue
        print(f"{r['round']:>5} {r['side']:>4} {r['app_cpu']:>8.3f} {r['app_cpu_s']:>6.1f} {r['app_rss_mb']:>6.0f} "
              f"{r['window_s']:>6.0f} "
              f"{str(r['rows_after_click']) + '/' + str(r['rows_at_end']):>9} {r['queue_requests']:>5} "
              f"{r['browser_cpu']:>7.2f} {r['others_cores']:>6.2f} "
              f"{r['load_start'][0]:>5.2f}->{r['load_end'][0]:<5.2f} {len(r['errors_in_log'])}")
    summary = report.get("summary")
    if not summary:
        return
    for side, info in report["sides"].items():
        s = summary[side]
        commit = (info.get("commit") or "?")[:7] + (" (+changes)" if info.get("dirty") else "")
        print(f"{side} {info['repo']} @ {commit}: app CPU median {s['app_cpu_median']:.3f} of a core, "
              f"spread {s['app_cpu_min']:.3f}-{s['app_cpu_max']:.3f} over {len(s['app_cpu_rounds'])} rounds "
              f"of {report['args']['window']:.0f} s with {info['runs']} runs; app RSS median "
              f"{s['app_rss_mb_median']:.0f} MB (rounds {s['app_rss_mb_min']:.0f}-{s['app_rss_mb_max']:.0f}, peak {s['app_rss_peak_mb']:.0f})")
    if "new_over_old" in summary:
        print(f"new / old (medians): {summary['new_over_old']:.2f}")
    machine = report["machine"]
    print(f"machine: {machine['cpus']} CPUs; load average (1, 5, 15 min) at the start "
          f"{', '.join(f'{x:.2f}' for x in machine['load_at_start'])}, at the end "
          f"{', '.join(f'{x:.2f}' for x in machine.get('load_at_end', ()))}; "
          f"{'quiet' if summary['quiet'] else 'NOT quiet'}: other processes used "
          f"{min(r['others_cores'] for r in rounds if 'others_cores' in r):.2f}-"
          f"{max(r['others_cores'] for r in rounds if 'others_cores' in r):.2f} cores in the windows "
          f"(quiet: under {report['args']['quiet_cores']} in every one)")


def main() -> int:
    parser = argparse.ArgumentParser(description="The web app's CPU and memory, idle, with the Runs tab open "
                                                 "on a long run history.")
    parser.add_argument("--repo", default=str(REPO), help=f"the checkout to measure (default {REPO})")
    parser.add_argument("--compare", metavar="OLD_REPO", help="a second checkout, measured alternately ('old')")
    parser.add_argument("--runs", type=int, default=200, help="finished runs in the runs folder (default 200)")
    parser.add_argument("--window", type=float, default=60, help="seconds of CPU measured per round (default 60)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; each side once per round (default 5)")
    parser.add_argument("--settle", type=float, default=10, help="seconds after the table lists the runs (default 10)")
    parser.add_argument("--quiet-cores", type=float, default=0.5,
                        help="others' cores under which a window counts as quiet (default 0.5)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (runs folders, app logs)")
    args = parser.parse_args()
    if args.runs < 1 or args.rounds < 1 or args.window <= 0:
        parser.error("--runs and --rounds must be at least 1 and --window positive")
    # Started in the background of a non-interactive shell, this process ignores SIGINT, and so
    # would the apps it starts (an ignored signal is inherited): with a handler of our own here,
    # they get the default one again, and stop on the Ctrl-C the measurement sends them.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return run_bench("runs_tab_cpu", args, measure, print_report)


if __name__ == "__main__":
    sys.exit(main())
