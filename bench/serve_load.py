"""The OpenAI-compatible endpoint under load: requests/s, latency and time to first token.

Run from the repository root (2-3 minutes on 2 idle CPU cores):

    .venv/bin/python bench/serve_load.py
    .venv/bin/python bench/serve_load.py --clients 20 --requests 5 --rounds 5

It prints a table and writes every figure to bench/results/serve_load-<time>.json.

The model: the tiny SFT run (recipes/tiny-sft.yaml, trained here first) served by
`launch.py serve RUN` (a chat process on one CPU core, static cache, prompt buckets; requests
answered one at a time in arrival order). The load: --clients threads of the real `openai` client,
each asking --requests built-in questions one after another (greedy, max_tokens 48, streamed, so
the first piece's arrival is the time to first token); all clients start together. Per round:
requests/s (requests / the round's wall time), latency p50/p95/max (request sent -> last piece),
time to first token p50/p95 (request sent -> first piece: mostly the wait for the turn), and
the distinct input shapes the model saw (GET /v1/studio/stats). Rounds run one after another on
the same server; the first one warms the shapes up and is reported apart.

Noise: before each round the bench waits (up to 60 s) for 2 s in which other processes use under
0.3 cores and reports the cores they used during it (`others`, * over 0.3).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import PROCS, REPO, BenchError, Noise, run_bench, run_until_final, wait_quiet  # sets sys.path
from studio_core.data.builtin import BUILTIN_DATASETS, ensure_tiny_model
from studio_core.machine.hardware import cpu_hardware
from studio_core.runs.manager import RunManager
from studio_core.recipe.spec import RunSpec

QUIET_WAIT_S, QUIET_CORES = 60, 0.3
KEY = "bench-key-0123456789"
QUESTIONS = [json.loads(line)["messages"][0]["content"]
             for line in Path(BUILTIN_DATASETS["builtin:qa"]).read_text().splitlines()]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def one_client(url: str, model: str, client: int, requests: int) -> list[dict]:
    import openai

    api = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=600)
    timings = []
    for r in range(requests):
        sent = time.perf_counter()
        first, text = None, ""
        for chunk in api.chat.completions.create(
                model=model, messages=[{"role": "user", "content": QUESTIONS[(client + r) % len(QUESTIONS)]}],
                max_tokens=48, temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text += chunk.choices[0].delta.content
        done = time.perf_counter()
        timings.append({"latency_s": done - sent, "ttft_s": (first or done) - sent, "chars": len(text)})
    return timings


def measure(work: Path, args, report: dict) -> None:
    ensure_tiny_model()
    manager = RunManager(work / "runs")
    view, state, _ = run_until_final(manager, RunSpec.load(REPO / "recipes" / "tiny-sft.yaml"), cpu_hardware(), 600)
    if state != "finished":
        raise BenchError(f"the tiny SFT run ended {state}: {view.error_text}")
    (work / "key").write_text(KEY)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "launch.py", "serve", view.id, "--port", str(port), "--runs-dir",
                               str(manager.runs_dir), "--api-key-file", str(work / "key"), "--max-queue",
                               str(args.clients)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    PROCS.groups.append(server)
    line = server.stdout.readline()
    if not line.startswith("Serving "):
        raise BenchError(f"launch.py serve did not start: {line}{server.stderr.read()[-2000:]}")
    url = f"http://127.0.0.1:{port}/v1"
    report["settings"] = {"clients": args.clients, "requests_per_client": args.requests, "rounds": args.rounds,
                          "max_tokens": 48, "run": view.id}
    rounds = report["rounds"] = []
    for round_ in range(args.rounds):
        gate = wait_quiet(QUIET_WAIT_S, QUIET_CORES)  # the server idles meanwhile
        noise = Noise(mine=(server.pid,))
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=args.clients) as pool:
            timings = [t for got in pool.map(lambda c: one_client(url, view.id, c, args.requests), range(args.clients))
                       for t in got]
        wall = time.perf_counter() - start
        request = urllib.request.Request(url + "/studio/stats", headers={"Authorization": f"Bearer {KEY}"})
        stats = json.load(urllib.request.urlopen(request, timeout=30))
        latency, ttft = [t["latency_s"] for t in timings], [t["ttft_s"] for t in timings]
        rounds.append({"round": round_ + 1, "requests": len(timings), "wall_s": wall,
                       "requests_per_s": len(timings) / wall, "latency_p50_s": percentile(latency, 0.5),
                       "latency_p95_s": percentile(latency, 0.95), "latency_max_s": max(latency),
                       "ttft_p50_s": percentile(ttft, 0.5), "ttft_p95_s": percentile(ttft, 0.95),
                       "ttft_min_s": min(ttft), "shapes": stats["shapes"], "buckets": stats["buckets"],
                       "others": noise.others_cores(), "quiet_gate": gate})
        print(f"[bench] round {round_ + 1}: {rounds[-1]['requests_per_s']:.2f} requests/s", flush=True)
    later = rounds[1:] or rounds
    report["summary"] = {key: statistics.median(r[key] for r in later)
                         for key in ("requests_per_s", "latency_p50_s", "latency_p95_s", "ttft_p50_s", "ttft_p95_s",
                                     "ttft_min_s")}


def print_report(report: dict) -> None:
    rounds = report.get("rounds", [])
    if not rounds:
        return
    s = report["settings"]
    print(f"\n{s['clients']} clients x {s['requests_per_client']} streamed requests (max_tokens {s['max_tokens']}):")
    print(f"{'round':>5} {'req/s':>7} {'lat p50':>8} {'lat p95':>8} {'lat max':>8} {'ttft p50':>9} {'ttft p95':>9} "
          f"{'ttft min':>9} {'shapes':>6} {'others':>7}")
    for r in rounds:
        mark = "*" if r["others"] > QUIET_CORES else " "
        print(f"{r['round']:>5} {r['requests_per_s']:>7.2f} {r['latency_p50_s']:>7.2f}s {r['latency_p95_s']:>7.2f}s "
              f"{r['latency_max_s']:>7.2f}s {r['ttft_p50_s']:>8.2f}s {r['ttft_p95_s']:>8.2f}s {r['ttft_min_s']:>8.3f}s "
              f"{len(r['shapes']):>6} {r['others']:>6.2f}{mark}")
    m = report.get("summary")
    if m:
        print(f"\nmedian of rounds 2..: {m['requests_per_s']:.2f} requests/s, latency p50 {m['latency_p50_s']:.2f} s, "
              f"p95 {m['latency_p95_s']:.2f} s, time to first token p50 {m['ttft_p50_s']:.2f} s (the wait for the "
              f"turn), min {m['ttft_min_s']:.3f} s (no wait); shapes {len(rounds[-1]['shapes'])} "
              f"(buckets {len(rounds[-1]['buckets'])} + decode)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--requests", type=int, default=5, help="requests per client and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the run and logs")
    return run_bench("serve_load", parser.parse_args(), measure, print_report)


if __name__ == "__main__":
    raise SystemExit(main())
