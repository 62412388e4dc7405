"""`launch.py doctor` on this machine, for real: every check runs (the 2-process collective
under torchrun with gloo, the compiled step twice against the compile cache, the Hub
through a loopback stand-in, the instance type through a stand-in for EC2's metadata
service). The checks that cannot fail here are made to fail on purpose, one by one.

The doctor's compiled step is also this suite's real check of Inductor's compile cache:
what it leaves there, and `launch.py cache` showing and clearing it. It uses the session's
compile cache, as the page's Doctor test does: whichever runs first compiles (both, if at
the same moment), and in each the second process must take both graphs from the cache.
"""

from __future__ import annotations

import re
import shutil

import pytest

from conftest import launch_py
from hub_standin import HubStandIn
from imds_standin import ImdsStandIn
from studio_core.doctor import doctor
from studio_core.machine import leases
from studio_core.serve import vllm_env
from studio_core.machine.compile_cache import compile_cache_dir, summary
from studio_core.machine.hardware import TORCH_XLA_PROBLEM, Hardware, instance_type

NAMES = ["backend", "versions", "torch_xla", "devices", "collective", "compile", "cache", "monitor",
         "runs folder", "hub", "vllm"]


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """One `launch.py doctor` on this machine."""
    root = tmp_path_factory.mktemp("doctor")
    with HubStandIn() as hub, ImdsStandIn("c7i.large") as imds:
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "AWS_EC2_METADATA_SERVICE_ENDPOINT": imds.url}
        done = launch_py("doctor", "--runs-dir", str(root / "runs"), env=env, timeout=600)
        requests = [(r.method, r.path) for r in hub.requests], list(imds.requests)
    return done, root, requests


def test_every_check_runs_and_passes_on_this_machine(checked):
    done, root, (hub_requests, imds_requests) = checked
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {line[6:18].strip(): line for line in done.stdout.splitlines() if line[:4] in ("PASS", "FAIL")}
    assert list(lines) == NAMES and all(line.startswith("PASS") for line in lines.values()), done.stdout
    assert "all checks passed" in done.stdout and "Traceback" not in done.stdout + done.stderr
    assert "cpu: CPU only" in lines["backend"] and "trl 1.16.0" in lines["versions"]
    assert "c7i.large" in lines["devices"]  # from the metadata service, with its IMDSv2 token
    # vLLM's own environment is optional: said either way (.ci/run makes it, so CI sees it on the CPU)
    assert ("on cpu" if vllm_env.configured_python()[0] else "not set up (optional") in lines["vllm"]
    assert imds_requests == [("PUT", "/latest/api/token"), ("GET", "/latest/meta-data/instance-type")]
    assert "rank 0 on cpu, rank 1 on cpu, sum 3.0" in lines["collective"]
    # forward and backward graphs, compiled (unless another doctor of this session did) then reused
    first = re.search(r"first process (\d) graph\(s\) compiled, (\d) from the cache; second process 0 compiled, 2 "
                      r"from the cache", lines["compile"])
    assert first and int(first[1]) + int(first[2]) == 2, lines["compile"]
    assert str(compile_cache_dir("cpu")) in lines["cache"] and str(root / "runs") in lines["runs folder"]
    assert hub_requests and "answers" in lines["hub"]


def test_the_compiled_step_leaves_its_graphs_in_the_cache_which_cli_shows_and_clears(checked, tmp_path):
    cache = summary(compile_cache_dir("cpu"))
    # 2 graphs and 1 AOTAutograd entry; a doctor compiling at the same moment (the page's) may add copies
    assert cache.entries["Inductor FX graphs"] >= 2 and cache.entries["AOTAutograd entries"] >= 1, cache.entries
    assert cache.size_bytes > 10_000  # the entries and the compiled C++ they load
    copy = tmp_path / "cc"
    shutil.copytree(compile_cache_dir("cpu"), copy / "cpu")  # real cache files, without compiling again
    env = {"STUDIO_COMPILE_CACHE": str(copy)}
    shown = launch_py("cache", "--backend", "cpu", "--runs-dir", str(tmp_path / "runs"), env=env)
    assert shown.returncode == 0, shown.stderr
    assert str(copy / "cpu") in shown.stdout and summary(copy / "cpu").describe() in shown.stdout
    cleared = launch_py("cache", "--backend", "cpu", "--clear", "--runs-dir", str(tmp_path / "runs"), env=env)
    assert cleared.returncode == 0, cleared.stderr
    assert "Cleared" in cleared.stdout and "no entries" in cleared.stdout
    assert (copy / "cpu").is_dir() and list((copy / "cpu").iterdir()) == []


# --- each check that passes here, made to fail ----------------------------------------------
@pytest.mark.fast
def test_an_unreachable_hub_fails_with_what_to_do_and_offline_is_said(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    offline = doctor.hub()
    assert offline.ok and "offline (HF_HUB_OFFLINE=1)" in offline.found
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with HubStandIn() as closed:
        endpoint = closed.url  # the port is closed once the stand-in has ended
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    unreachable = doctor.hub()
    assert not unreachable.ok and f"cannot reach {endpoint}" in unreachable.found
    assert "HF_HUB_OFFLINE=1" in unreachable.fix and "what to do:" in unreachable.line()


@pytest.mark.fast
def test_a_folder_that_cannot_be_written_fails(tmp_path):
    (tmp_path / "file").write_text("")
    check = doctor.folder_writable("runs folder", tmp_path / "file" / "runs", "choose another")
    assert not check.ok and str(tmp_path / "file" / "runs") in check.found and check.line().startswith("FAIL")


@pytest.mark.fast
def test_torch_xla_next_to_torch_neuronx_fails_with_the_fix(tmp_path, monkeypatch):
    from app.train_tab import hardware_text

    (tmp_path / "torch_xla").mkdir()
    (tmp_path / "torch_xla" / "__init__.py").write_text("")
    assert doctor.torch_xla("neuron").ok
    monkeypatch.syspath_prepend(str(tmp_path))
    check = doctor.torch_xla("neuron")
    assert not check.ok and check.fix == TORCH_XLA_PROBLEM and "pip uninstall torch-xla" in check.line()
    assert doctor.torch_xla("cpu").ok  # it matters only next to torch-neuronx
    troubled = Hardware("neuron", 4, cpu_count=8, chips=1, lnc=2, problems=(TORCH_XLA_PROBLEM,))
    backend = next(doctor.checks(tmp_path / "runs", troubled))  # the first check; the rest do not run
    assert not backend.ok and "clean TorchNeuron environment" in backend.fix
    shown = hardware_text(troubled)  # the Train tab's hardware line says it too, before any run
    assert TORCH_XLA_PROBLEM in shown and "Doctor tab" in shown and "Warning" not in hardware_text(Hardware("cpu", 2, 2))


@pytest.mark.fast
def test_device_checks_wait_for_free_cores_and_say_who_holds_them(tmp_path):
    gpus = Hardware("cuda", 2, cpu_count=2)
    with leases.acquire(tmp_path, "cuda", [0, 1], holder="20261201-000000-busy-1a2b3c", kind="run"):
        for check in (doctor.collective(tmp_path, gpus), doctor.compile_step(tmp_path, gpus)):
            assert not check.ok and "held" in check.found and "busy-1a2b3c" in check.found, check.found
    assert doctor.collective(tmp_path, Hardware("cuda", 1, cpu_count=2)).found.startswith("skipped: one cuda device")


@pytest.mark.fast
def test_the_smoke_test_refuses_a_runs_folder_it_cannot_write_before_it_starts(tmp_path):
    (tmp_path / "file").write_text("")
    done = launch_py("doctor", "--smoke", "--runs-dir", str(tmp_path / "file" / "runs"), env={})
    assert done.returncode == 2 and "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert f"runs folder {tmp_path / 'file' / 'runs'}" in done.stderr and "--runs-dir" in done.stderr
    assert "Smoke test" not in done.stdout  # refused before anything started


# --- the instance type, from EC2's instance metadata ----------------------------------------
@pytest.mark.fast
def test_the_instance_type_comes_from_the_metadata_service_with_its_token(monkeypatch):
    with ImdsStandIn("trn2.3xlarge") as imds:
        monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.url)
        assert instance_type() == "trn2.3xlarge"
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        assert instance_type() is None and len(imds.requests) == 2  # turned off: nothing asked
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED")
    assert instance_type() is None  # nothing answers there any more: unknown, not an error
    assert "instance type unknown" in Hardware("neuron", 4, cpu_count=8, chips=1, lnc=2).describe()
