"""`launch.py doctor --smoke` (studio_core/doctor/smoke.py), the first-run kit, for real on this CPU
machine: the built-in tiny model through the studio's own jobs (precompile and a run that must
hit the cache, a compiled SFT run, a DPO run, a 2-process run, a chat, the batched server with a
request joining, an evaluation, a vision-language run answering an image; TP=2 skipped on the CPU), then one report file. A busy machine fails each step with who holds the cores; the report never carries a
token or a variable named like a secret.

The smoke's precompile step is also this suite's real check of precompile (studio_core/training/
precompile.py) end to end: its jobs compile the run's shapes into an empty compile cache and the
run finds every graph there (tests/test_precompile.py checks the rest of precompile).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from studio_core.machine import leases
from studio_core.doctor import smoke
from studio_core.machine.hardware import Hardware, cpu_hardware
from studio_core.rundir.events import read as read_events
from studio_core.rundir.folder import EVENTS, LOG
from studio_core.runs.manager import RunManager

REPO = Path(__file__).resolve().parent.parent
FAKE_TOKEN = "hf_" + "Zq3" * 12  # shaped as a Hub token, never a real one
DEVICE_ENV = {"NEURON_RT_LOG_LEVEL": "INFO", "FI_EFA_USE_DEVICE_RDMA": "1", "TORCH_NEURONX_LOG_LEVEL": "1"}
SCALAR_KERNELS = {"TORCHINDUCTOR_VEC_ISA_OK": "0"}  # torch/_inductor/config.py reads it: no vectorized C++ kernels


def smoke_cli(runs_dir: Path, env: dict | None = None, timeout: float = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "launch.py"), "doctor", "--smoke", "--runs-dir", str(runs_dir)],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, **(env or {})})


def report_of(done: subprocess.CompletedProcess) -> tuple[Path, dict]:
    found = re.search(r"^Report \(attach it to a bug report\): (\S+)$", done.stdout, re.M)
    assert found, done.stdout + done.stderr
    path = Path(found[1])
    return path, json.loads(path.read_text())


def events_of(view, *types):
    return [e for e in read_events(view.dir / "events.jsonl") if e["type"] in types]


def test_the_smoke_test_runs_every_step_on_this_machine_and_writes_one_report(tmp_path):
    runs_dir = tmp_path / "runs"
    # an empty compile cache: the precompile jobs must compile, not find the session's graphs. Inductor
    # writes scalar C++ kernels (no vector ISA): what this test checks is the studio's jobs, not the
    # kernels' speed, and g++ then takes about a quarter less time over them (the smoke's 2 shapes, cold,
    # on 2 cores: 99 s against 122 s for this test alone on a quiet machine)
    env = {**DEVICE_ENV, **SCALAR_KERNELS, "HF_TOKEN": FAKE_TOKEN,
           "STUDIO_COMPILE_CACHE": str(tmp_path / "compile-cache")}
    done = smoke_cli(runs_dir, env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all smoke steps passed" in done.stdout and "Traceback" not in done.stdout + done.stderr
    path, report = report_of(done)
    assert path.parent.parent == runs_dir / "smoke" and path.with_suffix(".md").is_file()
    assert report["passed"] is True and report["hardware"]["backend"] == "cpu"
    steps = {step["name"]: step for step in report["steps"]}
    assert list(steps) == list(smoke.STEPS)
    for step in steps.values():
        assert step["ok"] is True and step["error"] == "" and step["seconds"] >= 0, step
        mark = "SKIP" if step["skipped"] else "PASS"
        assert step["found"] and f"{mark}  {step['name']}" in done.stdout
        assert step["proves"] == smoke.PROVES[step["name"]] and step["limit_s"]  # in the report, each step
    assert [name for name, step in steps.items() if step["skipped"]] == ["tp2"]  # TP needs a device
    assert "accelerate runs no TP on the CPU" in steps["tp2"]["found"]
    # the precompile jobs compiled the 2 shapes, and the run after them found every graph in the cache
    jobs = steps["precompile"]["details"]["jobs"]
    assert sorted(job["shape"] for job in jobs) == [[4, 34], [4, 38]] and {job["job"] for job in jobs} == {0, 1}
    assert steps["precompile"]["details"]["run_cache"] and set(steps["precompile"]["details"]["run_cache"]) == {"hit"}
    assert "5 steps" in steps["sft"]["found"] and "on 2 processes" in steps["two_ranks"]["found"]
    assert 1 <= steps["chat"]["details"]["new_tokens"] <= 3  # from the sft step's model
    assert len(set(steps["chat"]["details"]["answers"])) == 3  # each prompt continued otherwise: a mix-up shows
    assert steps["chat"]["details"]["target"] == steps["eval"]["details"]["target"] == steps["sft"]["details"]["run"]
    assert "2 steps" in steps["vlm"]["found"] and 1 <= steps["vlm"]["details"]["new_tokens"] <= 3  # about an image
    # DPO trained; on the CPU nothing compiles op by op
    assert "2 steps" in steps["dpo"]["found"] and steps["dpo"]["details"]["eager_compiles"] == 0
    # the batched server: the third question joined the first two's batch, and each answer is chat's
    serve = steps["serve"]["details"]
    assert serve["target"] == steps["chat"]["details"]["target"] and serve["engine"]["mode"] == "eager"
    assert serve["order"].index("third ended") < serve["order"].index("first ended")
    assert serve["answers"][:2] == steps["chat"]["details"]["answers"][:2]
    assert steps["chat"]["details"]["answers"][2].startswith(serve["answers"][2]) and serve["answers"][2]
    assert [4, 1] in serve["shapes"]  # three rows decoded together: a batch of 4
    # the memory table (a row per run), the CPU fallbacks named in the runs' logs, no artifacts here
    assert [row["step"] for row in report["memory"]] == ["precompile", "sft", "dpo", "two_ranks", "vlm"]
    assert all(row["estimated_bytes"] and row["peak_bytes"] for row in report["memory"]), report["memory"]
    assert report["cpu_fallbacks"]["total"] == 0 and set(report["cpu_fallbacks"]["counts"]) == {
        "precompile", "sft", "dpo", "two_ranks", "vlm"}
    assert report["artifacts"]["kept"] is False and "not a Neuron machine" in report["artifacts"]["why"]
    assert steps["eval"]["details"]["rows"] == 4 and set(steps["eval"]["details"]["eval_loss"]) == {"tuned", "base"}
    # versions, the device environment (no token), the compile cache before and after
    assert report["versions"]["trl"] == "1.16.0" and report["versions"]["torch-neuronx"] is None
    assert report["versions"]["python"].count(".") == 2
    assert {k: report["env"][k] for k in DEVICE_ENV} == DEVICE_ENV and "HF_TOKEN" not in report["env"]
    assert report["env"]["TORCHINDUCTOR_VEC_ISA_OK"] == "0"  # Inductor's settings are in the report too
    assert FAKE_TOKEN not in path.read_text() + path.with_suffix(".md").read_text()
    before, after = report["compile_cache"]["before"], report["compile_cache"]["after"]
    assert after["Inductor FX graphs"] > before.get("Inductor FX graphs", 0) and after["NEFFs"] == 0
    # the smoke's runs took their cores through the runs folder's leases, and stay out of its list
    smoke_runs = path.parent / "runs"
    assert (smoke_runs / ".leases").resolve() == (runs_dir / ".leases").resolve()
    assert RunManager(runs_dir).list() == [] and len(RunManager(smoke_runs).list()) == 5
    markdown = path.with_suffix(".md").read_text()
    assert "PASSED" in markdown and "## Device memory per core" in markdown and "| tp2 | skipped |" in markdown
    # the precompiled run: each job compiled one of the shapes the run then met (a cache miss), and the
    # run, begun after the last job, found every graph in the cache
    view = RunManager(smoke_runs).view(steps["precompile"]["details"]["run"])
    (start,) = events_of(view, "precompile_start")
    jobs, (end,) = events_of(view, "precompiled"), events_of(view, "precompile_end")
    run_shapes = sorted(e["shape"] for e in events_of(view, "shape"))
    assert sorted(start["shapes"]) == sorted(e["shape"] for e in jobs) == run_shapes == [[4, 34], [4, 38]]
    assert "failed" not in end and all(e["cache"] == "miss" for e in jobs)
    cached = [e for e in events_of(view, "compile_end") if "cache" in e]
    assert cached and all(e["cache"] == "hit" for e in cached), cached
    assert all(e["time"] > max(job["time"] for job in jobs) for e in events_of(view, "compile_end"))
    assert view.precompile["total"] == 2 and len(view.precompile["done"]) == 2


def test_a_busy_machine_fails_each_step_saying_who_holds_the_cores(tmp_path):
    runs_dir = tmp_path / "runs"
    hardware = cpu_hardware()
    holder = "20261201-000000-busy-1a2b3c"
    with leases.acquire(runs_dir, "cpu", list(range(hardware.cores)), holder=holder, kind="run"):
        done = smoke_cli(runs_dir, timeout=600)
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    _, report = report_of(done)
    steps = {step["name"]: step for step in report["steps"]}
    assert steps["probe"]["ok"] and holder in steps["probe"]["found"]  # it says so first
    for name in ("precompile", "sft", "dpo", "two_ranks", "chat", "serve", "eval", "vlm"):
        assert steps[name]["ok"] is False and holder in steps[name]["error"], steps[name]
    assert report["passed"] is False and "8 smoke step(s) failed" in done.stdout
    assert not list((Path(report["folder"]) / "runs").glob("*-smoke-*"))  # nothing was started


@pytest.mark.fast
def test_the_report_keeps_the_device_settings_and_leaves_out_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "my-own-token-text")  # not hf_-shaped: found by its value
    environ = {**DEVICE_ENV, "NEURON_RT_VISIBLE_CORES": "0-3", "FI_PROVIDER": "efa", "STUDIO_COMPILE_CACHE": "/cc",
               "HF_TOKEN": "my-own-token-text", "HUGGING_FACE_HUB_TOKEN": FAKE_TOKEN, "NEURON_API_KEY": "api-key-text",
               "FI_EFA_PASSWORD": "efa-password-text", "STUDIO_SECRET": "studio-secret-text",
               "AWS_SECRET_ACCESS_KEY": "aws-secret-text", "PATH": "/usr/bin",
               "NEURON_PROFILE_URL": f"https://x/?t={FAKE_TOKEN}"}
    kept = smoke.safe_environment(environ)
    assert kept == {**DEVICE_ENV, "NEURON_RT_VISIBLE_CORES": "0-3", "FI_PROVIDER": "efa",
                    "STUDIO_COMPILE_CACHE": "/cc", "NEURON_PROFILE_URL": "https://x/?t=<hidden>"}
    test = smoke.Smoke(tmp_path / "runs", Hardware("cpu", 2, 2))
    test.folder.mkdir(parents=True)
    test.steps = [smoke.Step("probe", True, 1.0, "cpu"),
                  smoke.Step("sft", False, 2.0, error=f"pushed with my-own-token-text and {FAKE_TOKEN} | failed")]
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    path = smoke.write_report(test.report(0.0, 3.0), test.folder)
    written = path.read_text() + path.with_suffix(".md").read_text()
    # values long enough not to occur by chance in the report (a temporary folder's random name)
    for secret in ("my-own-token-text", FAKE_TOKEN, "api-key-text", "efa-password-text", "studio-secret-text",
                   "aws-secret-text"):
        assert secret not in written
    report = json.loads(path.read_text())
    assert report["passed"] is False and report["env"]["FI_PROVIDER"] == "efa"
    assert [s["name"] for s in report["steps"]] == ["probe", "sft"] and "<hidden>" in report["steps"][1]["error"]
    markdown = path.with_suffix(".md").read_text()
    assert markdown.startswith("# Studio smoke test: FAILED") and "| sft | **FAIL** | 2.0 |" in markdown
    assert "- NEURON_RT_VISIBLE_CORES=0-3" in markdown


@pytest.mark.fast
def test_a_run_that_keeps_writing_is_waited_for_past_the_quiet_limit(tmp_path):
    """The smoke's limit follows progress: a run writing an event every 0.2 s for 1.5 s is followed to
    its end with a quiet limit of 0.6 s; one that then goes quiet is given up after 0.6 s more."""
    events, stop = tmp_path / EVENTS, threading.Event()

    def writer():
        for _ in range(8):
            time.sleep(0.2)
            with events.open("a") as file:
                file.write('{"type": "compile_end"}\n')
        stop.set()

    threading.Thread(target=writer, daemon=True).start()
    began = time.monotonic()
    assert smoke.follow(tmp_path, stop.is_set, quiet_s=0.6, most_s=10, poll_s=0.05) is None
    assert time.monotonic() - began > 1.4  # longer than the quiet limit: restarted while the run wrote
    quiet = smoke.follow(tmp_path, lambda: False, quiet_s=0.6, most_s=10, poll_s=0.05)
    assert quiet == "wrote nothing (no event, no log line) for 0.6 s"


@pytest.mark.fast
def test_a_run_that_writes_but_never_ends_is_given_up_in_all(tmp_path):
    log = tmp_path / LOG

    def busy() -> bool:
        with log.open("a") as file:
            file.write("still compiling\n")
        return False

    assert smoke.follow(tmp_path, busy, quiet_s=0.3, most_s=0.8, poll_s=0.05) == \
        "had not ended after 0.8 s in all, though it kept writing"


@pytest.mark.fast
def test_the_report_says_each_steps_limit_in_progress_terms():
    assert smoke.time_limit("precompile", "cpu") == (
        "300 s without the run writing (an event: a compilation, a precompile job's end, a step; or a log line), "
        "the wait restarting at each; 2400 s in all")
    assert smoke.time_limit("eval", "neuron") == "1800 s without an evaluation event"
