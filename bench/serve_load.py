"""Serving under load, side by side: the studio's server one request at a time, the studio's
batched server, and `transformers serve` (Transformers' own OpenAI-compatible server, with its
continuous batching), on the same tiny model, at 1, 4 and 16 concurrent clients.

Run from the repository root (about 4 minutes on 2 idle CPU cores):

    .venv/bin/python bench/serve_load.py
    .venv/bin/python bench/serve_load.py --clients 1,4,16 --requests 4 --rounds 5

It prints a table and writes every figure to bench/results/serve_load-<time>.json.

The model: the tiny SFT run (recipes/tiny-sft.yaml, trained here first). Each server runs whole
on the machine's last CPU (every process of it pinned there, one torch thread), and the clients
on the other CPUs, so no server is helped by another core and none competes with the load:
- "one at a time": `launch.py serve RUN --max-batch 1` (a chat process, static cache, prompt
  buckets, requests answered in arrival order, one at a time: the server before batching);
- "batched": `launch.py serve RUN` (up to 16 requests decoded together at fixed shapes);
- "transformers": `transformers serve <the run's model folder> --continuous-batching` (paged
  attention, shapes not bounded), with the chat template's arguments the studio renders with
  (`--chat-template-kwargs '{"enable_thinking": false}'` for the tiny Qwen3: without it, it
  renders another prompt and writes Qwen3's empty think block, 4 more tokens an answer).
(The studio's two servers hold that CPU's lease each, so each has a copy of the runs folder with
leases of its own: STUDIO_LEASES_DIR=.leases.)
The load: N concurrent streamed requests at a time, each client asking --requests built-in
questions one after another (greedy, max_tokens 48), all starting together; the clients are
asyncio tasks of one httpx client in the bench's process, reading the server-sent events as
OpenAI's client does. (Not the `openai` client itself: 16 of its threads took a whole CPU of
their own at about 1,100 tokens/s, so they, not the servers, set the figure; the tests use the
real `openai` client against the same servers.) Per server and N: requests/s, tokens/s (the
answers' tokens, counted afterwards with the model's tokenizer in the answer's text without its
leading and trailing whitespace, so the same answer counts the same whichever server wrote it:
`transformers serve` streams a "\n\n" before each),
latency p50/p95 (request sent -> last piece), and the server's CPU time per request. Per round
the servers go in turn, their order rotated each round; the first round warms every server up
(shapes, caches) and is reported apart; the summary is the median (and spread) of the later
rounds.

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
import shutil
import time
import urllib.request
from pathlib import Path

from common import PROCS, REPO, BenchError, Noise, run_bench, run_until_final, tree_cpu_s, wait_quiet  # sets sys.path
from studio_core.data.builtin import BUILTIN_DATASETS, ensure_tiny_model
from studio_core.machine.hardware import cpu_hardware
from studio_core.runs.manager import RunManager
from studio_core.serve.chat import template_kwargs
from studio_core.recipe.spec import RunSpec

QUIET_WAIT_S, QUIET_CORES = 60, 0.3
KEY = "bench-key-0123456789"
MAX_TOKENS = 48
QUESTIONS = [json.loads(line)["messages"][0]["content"]
             for line in Path(BUILTIN_DATASETS["builtin:qa"]).read_text().splitlines()]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_client(http, url: str, model: str, client: int, requests: int) -> list[dict]:
    """One client's requests, one after another: each streamed, its text and timings."""
    timings = []
    for r in range(requests):
        body = {"model": model, "messages": [{"role": "user", "content": QUESTIONS[(client + r) % len(QUESTIONS)]}],
                "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        sent, first, text = time.perf_counter(), None, ""
        async with http.stream("POST", f"{url}/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {KEY}"}) as response:
            if response.status_code != 200:
                raise BenchError(f"{url}: {response.status_code} {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices")
                piece = choices[0]["delta"].get("content") if choices else None
                if piece:
                    first = first or time.perf_counter()
                    text += piece
        done = time.perf_counter()
        timings.append({"latency_s": done - sent, "ttft_s": (first or done) - sent, "text": text})
    return timings


def load(url: str, model: str, clients: int, requests: int) -> tuple[list[dict], float]:
    """`clients` clients at once -> their requests' timings, and the wall time of the whole."""
    import asyncio

    import httpx

    async def all_clients():
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            start = time.perf_counter()
            got = await asyncio.gather(*(one_client(http, url, model, c, requests) for c in range(clients)))
            return [t for timings in got for t in timings], time.perf_counter() - start

    return asyncio.run(all_clients())


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def on_one_cpu(cpu: int):
    """A child's first step: on this CPU alone."""
    return lambda: os.sched_setaffinity(0, [cpu])


def start_servers(work: Path, run_dir: Path, model_dir: Path, clients: int, cpu: int, rendering: dict) -> dict:
    """{name: (url, model name, process)}: the three servers, up and answering, each whole on `cpu`;
    `rendering`: the chat template's arguments the studio renders prompts with, given to
    `transformers serve` too (so both write the same answers from the same prompts)."""
    servers = {}
    for name, batch in (("one at a time", "1"), ("batched", "16")):
        # both servers hold the lease of the one CPU: each a runs folder, and leases, of its own
        # (a relative STUDIO_LEASES_DIR keeps the leases in each runs folder, not machine-wide)
        runs = work / f"runs-{batch}"
        shutil.copytree(run_dir, runs / run_dir.name)
        port = free_port()
        server = subprocess.Popen([sys.executable, "launch.py", "serve", run_dir.name, "--port", str(port),
                                   "--runs-dir", str(runs), "--api-key-file", str(work / "key"),
                                   "--max-queue", str(clients), "--max-batch", batch, "--engine", "studio"], cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                  preexec_fn=on_one_cpu(cpu), env={**os.environ, "STUDIO_LEASES_DIR": ".leases"})
        PROCS.groups.append(server)
        line = server.stdout.readline()
        if not line.startswith("Serving "):
            raise BenchError(f"launch.py serve did not start: {line}{server.stderr.read()[-2000:]}")
        servers[name] = (f"http://127.0.0.1:{port}/v1", run_dir.name, server)
    port = free_port()
    log = open(work / "transformers-serve.log", "w")
    server = subprocess.Popen([str(Path(sys.executable).parent / "transformers"), "serve", str(model_dir),
                               "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
                               *(["--chat-template-kwargs", json.dumps(rendering)] if rendering else [])], cwd=work,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
                              preexec_fn=on_one_cpu(cpu))
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
    servers["transformers"] = (url, str(model_dir), server)
    return servers


def measure(work: Path, args, report: dict) -> None:
    from transformers import AutoTokenizer

    ensure_tiny_model()
    manager = RunManager(work / "runs")
    view, state, _ = run_until_final(manager, RunSpec.load(REPO / "recipes" / "tiny-sft.yaml"), cpu_hardware(), 600)
    if state != "finished":
        raise BenchError(f"the tiny SFT run ended {state}: {view.error_text}")
    (work / "key").write_text(KEY)
    (work / "key").chmod(0o600)
    model_dir = view.dir / "output"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    counts = [int(n) for n in args.clients.split(",")]
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise BenchError("this bench needs 2 CPUs: one for the server measured, the others for its clients")
    servers = start_servers(work, view.dir, model_dir, max(counts), cpus[-1], template_kwargs(tokenizer))
    os.sched_setaffinity(0, cpus[:-1])  # the clients: never on the servers' CPU
    report["settings"] = {"clients": counts, "requests_per_client": args.requests, "rounds": args.rounds,
                          "max_tokens": MAX_TOKENS, "run": view.id, "servers": list(servers),
                          "server_cpu": cpus[-1], "client_cpus": cpus[:-1]}
    rounds = report["rounds"] = []
    for round_ in range(args.rounds):
        order = list(servers)[round_ % len(servers):] + list(servers)[:round_ % len(servers)]
        found = {}
        for name in order:
            url, model, server = servers[name]
            for clients in counts:
                gate = wait_quiet(QUIET_WAIT_S, QUIET_CORES)
                noise = Noise(mine=tuple(p.pid for p in PROCS.groups))
                cpu_before = tree_cpu_s(server.pid)
                timings, wall = load(url, model, clients, args.requests)
                server_cpu = tree_cpu_s(server.pid) - cpu_before
                tokens = sum(len(tokenizer(t["text"].strip(), add_special_tokens=False)["input_ids"]) for t in timings)
                latency = [t["latency_s"] for t in timings]
                found[f"{name}|{clients}"] = {
                    "requests": len(timings), "wall_s": wall, "requests_per_s": len(timings) / wall,
                    "tokens": tokens, "tokens_per_s": tokens / wall,
                    "latency_p50_s": percentile(latency, 0.5), "latency_p95_s": percentile(latency, 0.95),
                    "server_cpu_ms_per_request": 1000 * server_cpu / len(timings),
                    "others": noise.others_cores(), "quiet_gate": gate}
                print(f"[bench] round {round_ + 1} {name:13} {clients:>2} clients: "
                      f"{found[f'{name}|{clients}']['tokens_per_s']:7.1f} tokens/s", flush=True)
        rounds.append(found)
    later = rounds[1:] or rounds
    report["summary"] = {key: {m: [r[key][m] for r in later] for m in (
        "requests_per_s", "tokens_per_s", "latency_p50_s", "latency_p95_s", "server_cpu_ms_per_request")}
                         for key in later[0]}


def print_report(report: dict) -> None:
    summary = report.get("summary")
    if not summary:
        return
    s = report["settings"]
    print(f"\n{s['requests_per_client']} streamed requests per client (max_tokens {s['max_tokens']}), median of "
          f"rounds 2..{s['rounds']} (spread min-max):")
    print(f"{'server':14} {'clients':>7} {'req/s':>16} {'tokens/s':>22} {'lat p50':>9} {'lat p95':>9} "
          f"{'CPU ms/req':>10}")
    for key, m in summary.items():
        name, clients = key.split("|")
        med = {k: statistics.median(v) for k, v in m.items()}
        print(f"{name:14} {clients:>7} {med['requests_per_s']:6.2f} ({min(m['requests_per_s']):.2f}-"
              f"{max(m['requests_per_s']):.2f}) {med['tokens_per_s']:8.1f} ({min(m['tokens_per_s']):.1f}-"
              f"{max(m['tokens_per_s']):.1f}) {med['latency_p50_s']:8.2f}s {med['latency_p95_s']:8.2f}s "
              f"{med['server_cpu_ms_per_request']:10.1f}")
    noisy = sum(r[k]["others"] > QUIET_CORES for r in report["rounds"] for k in r)
    print(f"turns with other processes over {QUIET_CORES} cores: {noisy}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,4,16", help="concurrent clients, each count in turn")
    parser.add_argument("--requests", type=int, default=8, help="requests per client and turn")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the run and logs")
    return run_bench("serve_load", parser.parse_args(), measure, print_report)


if __name__ == "__main__":
    raise SystemExit(main())
