"""Serving under load, side by side: the studio's server one request at a time, the studio's
batched server, and `transformers serve` (Transformers' own OpenAI-compatible server, with its
continuous batching), on the same tiny model, at 1, 4 and 16 concurrent clients.

Run from the repository root (about 4 minutes on 2 idle CPU cores):

    .venv/bin/python bench/serve_load.py
    .venv/bin/python bench/serve_load.py --clients 1,4,16 --requests 4 --rounds 5

It prints a table and writes every figure to bench/results/serve_load-<time>.json.

The model: the tiny SFT run (recipes/tiny-sft.yaml, trained here first). The servers, each on one
CPU core of its own with one torch thread (so none is helped by the other core):
- "one at a time": `launch.py serve RUN --max-batch 1` (a chat process, static cache, prompt
  buckets, requests answered in arrival order, one at a time: the server before batching);
- "batched": `launch.py serve RUN` (up to 8 requests decoded together at fixed shapes);
- "transformers": `transformers serve <the run's model folder> --continuous-batching` (paged
  attention, shapes not bounded), pinned to one CPU with taskset's equivalent (sched_setaffinity).
The load: N threads of the real `openai` client, each asking --requests built-in questions one
after another (greedy, max_tokens 48, streamed); all start together. Per server and N: requests/s,
tokens/s (the answers' tokens, counted with the model's tokenizer, the same for every server),
latency p50/p95 (request sent -> last piece). Per round the servers go in turn, their order
rotated each round; the first round warms every server up (shapes, caches) and is reported
apart; the summary is the median (and spread) of the later rounds.

Noise: before each server's turn the bench waits (up to 60 s) for 2 s in which other processes
use under 0.3 cores and records the cores they used during the turn (`others`, * over 0.3).
"""

from __future__ import annotations

import argparse
import json
import os
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
MAX_TOKENS = 48
QUESTIONS = [json.loads(line)["messages"][0]["content"]
             for line in Path(BUILTIN_DATASETS["builtin:qa"]).read_text().splitlines()]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def one_client(url: str, model: str, client: int, requests: int, tokenizer) -> list[dict]:
    import openai

    api = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=600)
    timings = []
    for r in range(requests):
        sent = time.perf_counter()
        first, text = None, ""
        for chunk in api.chat.completions.create(
                model=model, messages=[{"role": "user", "content": QUESTIONS[(client + r) % len(QUESTIONS)]}],
                max_tokens=MAX_TOKENS, temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text += chunk.choices[0].delta.content
        done = time.perf_counter()
        timings.append({"latency_s": done - sent, "ttft_s": (first or done) - sent,
                        "tokens": len(tokenizer(text, add_special_tokens=False)["input_ids"])})
    return timings


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def on_one_cpu(cpu: int):
    """A child's first step: on this CPU alone."""
    return lambda: os.sched_setaffinity(0, [cpu])


def start_servers(work: Path, run_id: str, runs_dir: Path, model_dir: Path, clients: int) -> dict:
    """{name: (url, model name)}: the three servers, up and answering."""
    cpus = sorted(os.sched_getaffinity(0))
    servers = {}
    for name, batch in (("one at a time", "1"), ("batched", "8")):
        port = free_port()
        server = subprocess.Popen([sys.executable, "launch.py", "serve", run_id, "--port", str(port), "--runs-dir",
                                   str(runs_dir), "--api-key-file", str(work / "key"), "--max-queue", str(clients),
                                   "--max-batch", batch], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True)
        PROCS.groups.append(server)
        line = server.stdout.readline()
        if not line.startswith("Serving "):
            raise BenchError(f"launch.py serve did not start: {line}{server.stderr.read()[-2000:]}")
        servers[name] = (f"http://127.0.0.1:{port}/v1", run_id)
    port = free_port()
    log = open(work / "transformers-serve.log", "w")
    server = subprocess.Popen([str(Path(sys.executable).parent / "transformers"), "serve", str(model_dir),
                               "--continuous-batching", "--host", "127.0.0.1", "--port", str(port)], cwd=work,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
                              preexec_fn=on_one_cpu(cpus[-1]))
    PROCS.groups.append(server)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 120
    while True:  # it loads the model at the first request
        try:
            urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=5)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                said = (work / "transformers-serve.log").read_text()[-2000:]
                raise BenchError(f"transformers serve did not start: {said}")
            time.sleep(1)
    servers["transformers"] = (url, str(model_dir))
    return servers


def measure(work: Path, args, report: dict) -> None:
    from transformers import AutoTokenizer

    ensure_tiny_model()
    manager = RunManager(work / "runs")
    view, state, _ = run_until_final(manager, RunSpec.load(REPO / "recipes" / "tiny-sft.yaml"), cpu_hardware(), 600)
    if state != "finished":
        raise BenchError(f"the tiny SFT run ended {state}: {view.error_text}")
    (work / "key").write_text(KEY)
    model_dir = view.dir / "output"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    counts = [int(n) for n in args.clients.split(",")]
    servers = start_servers(work, view.id, manager.runs_dir, model_dir, max(counts))
    report["settings"] = {"clients": counts, "requests_per_client": args.requests, "rounds": args.rounds,
                          "max_tokens": MAX_TOKENS, "run": view.id, "servers": list(servers)}
    rounds = report["rounds"] = []
    for round_ in range(args.rounds):
        order = list(servers)[round_ % len(servers):] + list(servers)[:round_ % len(servers)]
        found = {}
        for name in order:
            url, model = servers[name]
            for clients in counts:
                gate = wait_quiet(QUIET_WAIT_S, QUIET_CORES)
                noise = Noise(mine=tuple(p.pid for p in PROCS.groups))
                start = time.perf_counter()
                with ThreadPoolExecutor(max_workers=clients) as pool:
                    timings = [t for got in pool.map(lambda c: one_client(url, model, c, args.requests, tokenizer),
                                                     range(clients)) for t in got]
                wall = time.perf_counter() - start
                latency = [t["latency_s"] for t in timings]
                found[f"{name}|{clients}"] = {
                    "requests": len(timings), "wall_s": wall, "requests_per_s": len(timings) / wall,
                    "tokens_per_s": sum(t["tokens"] for t in timings) / wall,
                    "latency_p50_s": percentile(latency, 0.5), "latency_p95_s": percentile(latency, 0.95),
                    "others": noise.others_cores(), "quiet_gate": gate}
                print(f"[bench] round {round_ + 1} {name:13} {clients:>2} clients: "
                      f"{found[f'{name}|{clients}']['tokens_per_s']:7.1f} tokens/s", flush=True)
        rounds.append(found)
    later = rounds[1:] or rounds
    report["summary"] = {key: {m: [r[key][m] for r in later] for m in ("requests_per_s", "tokens_per_s",
                                                                       "latency_p50_s", "latency_p95_s")}
                         for key in later[0]}


def print_report(report: dict) -> None:
    summary = report.get("summary")
    if not summary:
        return
    s = report["settings"]
    print(f"\n{s['requests_per_client']} streamed requests per client (max_tokens {s['max_tokens']}), median of "
          f"rounds 2..{s['rounds']} (spread min-max):")
    print(f"{'server':14} {'clients':>7} {'req/s':>16} {'tokens/s':>22} {'lat p50':>9} {'lat p95':>9}")
    for key, m in summary.items():
        name, clients = key.split("|")
        med = {k: statistics.median(v) for k, v in m.items()}
        print(f"{name:14} {clients:>7} {med['requests_per_s']:6.2f} ({min(m['requests_per_s']):.2f}-"
              f"{max(m['requests_per_s']):.2f}) {med['tokens_per_s']:8.1f} ({min(m['tokens_per_s']):.1f}-"
              f"{max(m['tokens_per_s']):.1f}) {med['latency_p50_s']:8.2f}s {med['latency_p95_s']:8.2f}s")
    noisy = sum(r[k]["others"] > QUIET_CORES for r in report["rounds"] for k in r)
    print(f"turns with other processes over {QUIET_CORES} cores: {noisy}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,4,16", help="concurrent clients, each count in turn")
    parser.add_argument("--requests", type=int, default=4, help="requests per client and turn")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the run and logs")
    return run_bench("serve_load", parser.parse_args(), measure, print_report)


if __name__ == "__main__":
    raise SystemExit(main())
