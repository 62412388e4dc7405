"""Where the test suite's CPU goes: runs pytest (the README's test command, or the test files given)
and samples every process on the machine twice a second, then prints the CPU seconds each kind of
process used (training workers, forked runs, torchrun, the studio's children, Chromium, Ray, the
compiler, ...) and each test file's processes, and how busy the machine was.

    .venv/bin/python bench/suite_cpu.py [tests/test_queue.py ...]

A process is counted from its first sample to its last: one that lives less than half a second
may be missed, and the last half second of each is lost (a few percent). Processes that were
running before the bench are counted from its start. A process's test file is the one in its
PYTEST_CURRENT_TEST when first seen (runs forked from the zygote take their run's environment a
moment after, so most are seen with the zygote's, which has none). Needs a quiet machine: every
process is counted, the bench's own sampling apart. Writes bench/results/suite_cpu-<time>.json,
with the number of processes of each kind each test file started (which files start the config
check's children, say).
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, RESULTS_DIR, busy_cpu_s  # noqa: E402

SAMPLE_S = 0.5
KINDS = [  # (kind, pattern in the command line), first match wins
    ("forked run or zygote", r"studio_core\.training\.zygote"),
    ("training worker", r"studio_core\.training\.worker"),
    ("TRL config check", r"studio-config-check"),  # `python -c CODE`, whose comments name torchrun
    ("TRL schema read", r"import dataclasses, enum, json, sys, types, typing"),
    ("torchrun", r"torch\.distributed\.run|torchrun"),
    ("studio child", r"-m studio_core\.\w+\.\w+"),
    ("app (launch.py --port)", r"launch\.py --port"),
    ("launch.py command", r"launch\.py"),
    ("vLLM", r"\.venv-vllm"),
    ("pytest worker", r"exec\(eval\(sys\.stdin"),
    ("pytest", r"pytest"),
    ("Chromium", r"chrom|headless_shell"),
    ("Ray", r"ray|raylet|gcs_server"),
    ("Slurm", r"slurm|munge"),
    ("compiler", r"cc1plus|collect2|/ld\b|g\+\+|\bas\b"),
]


def kind(cmdline: list[str]) -> str:
    line = " ".join(cmdline)
    for name, pattern in KINDS:
        if re.search(pattern, line):
            found = re.search(r"-m (studio_core\.\w+\.\w+)", line) if name == "studio child" else None
            return f"{name}: {found[1]}" if found else name
    return "other"


def sample(seen: dict, started: float) -> None:
    """Every process's CPU so far into `seen` (by pid and start time)."""
    for proc in psutil.process_iter(["pid", "name", "create_time", "cpu_times"]):
        key, times = (proc.info["pid"], proc.info["create_time"]), proc.info["cpu_times"]
        if proc.info["pid"] == os.getpid() or times is None:
            continue
        cpu = times.user + times.system
        if key not in seen:
            try:
                cmdline = proc.cmdline()
                test = proc.environ().get("PYTEST_CURRENT_TEST", "")
            except psutil.Error:  # gone, or not ours to read
                cmdline, test = [proc.info["name"] or "?"], ""
            seen[key] = {"kind": kind(cmdline), "test_file": test.split("::")[0],
                         "cpu_at_start": cpu if key[1] < started else 0.0}
        seen[key]["cpu"] = cpu


def main(files: list[str]) -> int:
    seen: dict = {}
    busy: list[float] = []
    done = threading.Event()
    started = time.time()

    def sampler() -> None:
        last, last_at = busy_cpu_s(), time.monotonic()
        while not done.wait(SAMPLE_S):
            sample(seen, started)
            now, now_at = busy_cpu_s(), time.monotonic()
            busy.append((now - last) / ((now_at - last_at) * psutil.cpu_count()))
            last, last_at = now, now_at

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    argv = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider", *files]
    code = subprocess.run(argv, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"},
                          check=False).returncode
    wall = time.time() - started
    done.set()
    thread.join()
    if not seen:
        print("no process was sampled (the sampler failed: see its error above)", file=sys.stderr)
        return 1
    by_kind, by_file, count = collections.Counter(), collections.Counter(), collections.Counter()
    by_kind_and_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for proc in seen.values():
        used = proc["cpu"] - proc["cpu_at_start"]
        by_kind[proc["kind"]] += used
        count[proc["kind"]] += 1
        test_file = proc["test_file"] or "(none in its environment)"
        if not proc["kind"].startswith("pytest"):
            by_file[test_file] += used
        by_kind_and_file[proc["kind"]][test_file] += 1
    total = sum(by_kind.values())
    print(f"\npytest exit code {code}; {wall:.0f} s wall; {total:.0f} CPU-s in {len(seen)} processes; "
          f"machine busy {sum(busy) / max(len(busy), 1):.0%} of the time (of {psutil.cpu_count()} CPUs)")
    print("\nCPU-s  processes  kind")
    for name, used in by_kind.most_common():
        print(f"{used:7.1f} {count[name]:6d}  {name}")
    print("\nCPU-s  test file (its processes, the pytest workers' own CPU apart)")
    for name, used in by_file.most_common(25):
        print(f"{used:7.1f}  {name}")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"suite_cpu-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"files": files, "exit_code": code, "wall_s": wall, "busy": busy,
                               "by_kind": dict(by_kind), "processes": dict(count), "by_file": dict(by_file),
                               "processes_by_kind_and_file": {kind: dict(files) for kind, files in
                                                              by_kind_and_file.items()}}, indent=1))
    print(f"\nwritten: {out}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
