"""The persistent compile cache: its folders, the plan's environment, and what a real
torch.compile leaves in it.

Inductor's caches are checked for real: a tiny `torch.compile` (inductor backend, CPU)
runs in a child process pointed at the cache by the same environment a run gets, and a
second identical process must hit the FX graph cache. The NEFF cache needs Trainium;
here only its folder and environment are checked.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from studio_core.compile_cache import (CacheInUse, clear, compile_cache_dir, compile_cache_env,
                                       compile_cache_root, summary)
from studio_core.runs.events import FINAL_STATES
from studio_core.hardware import cpu_hardware, instance_hardware
from studio_core.runs.manager import RunManager
from studio_core.spec import RunSpec

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny-sft.yaml"
COMPILE_TIMEOUT_S = 180  # a hang guard: the first compile takes ~20 s on 2 cores, the second ~6 s

TINY_COMPILE = """
import json, torch
from torch._dynamo.utils import counters
f = torch.compile(lambda x: (x.sin() * 2 + 1).relu().sum(), backend="inductor")
f(torch.randn(8))
print(json.dumps({name: dict(counters[name]) for name in ("inductor", "aot_autograd")}))
"""


def compile_once(root: Path) -> dict:
    env = {**os.environ, **compile_cache_env("cpu", root)}
    done = subprocess.run([sys.executable, "-c", TINY_COMPILE], env=env, capture_output=True, text=True,
                          timeout=COMPILE_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A compile cache root after two identical processes compiled the same function."""
    root = tmp_path_factory.mktemp("compile-cache")
    first, second = compile_once(root), compile_once(root)
    return root, first, second


def launch_py(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "launch.py"), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False, env={**os.environ, **env})


# --- where the cache is -----------------------------------------------------------------
@pytest.mark.fast
def test_one_folder_per_backend_under_the_studio_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("STUDIO_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("STUDIO_CACHE_DIR", str(tmp_path))
    assert compile_cache_root() == tmp_path / "compile-cache"
    assert compile_cache_dir("neuron") == tmp_path / "compile-cache" / "neuron"
    assert compile_cache_env("neuron", "/c") == {"TORCHINDUCTOR_CACHE_DIR": "/c/neuron/inductor",
                                                 "TORCH_NEURONX_NEFF_CACHE_DIR": "/c/neuron/neff"}
    assert compile_cache_env("cpu", "/c") == {"TORCHINDUCTOR_CACHE_DIR": "/c/cpu/inductor"}
    with pytest.raises(ValueError, match="cpu, cuda, neuron"):
        compile_cache_dir("tpu")


@pytest.mark.fast
def test_studio_compile_cache_overrides_the_root(monkeypatch, tmp_path):
    monkeypatch.setenv("STUDIO_COMPILE_CACHE", str(tmp_path / "shared"))
    assert compile_cache_dir("cuda") == tmp_path / "shared" / "cuda"
    assert compile_cache_dir("cuda", root="/elsewhere") == Path("/elsewhere/cuda")


@pytest.mark.fast
@pytest.mark.parametrize("hardware, expected", [
    (cpu_hardware(), {"TORCHINDUCTOR_CACHE_DIR": "cpu/inductor"}),
    (instance_hardware("trn2.3xlarge"), {"TORCHINDUCTOR_CACHE_DIR": "neuron/inductor",
                                         "TORCH_NEURONX_NEFF_CACHE_DIR": "neuron/neff"}),
], ids=["cpu", "trn2.3xlarge"])
def test_runs_on_one_backend_share_the_configured_cache(monkeypatch, tmp_path, hardware, expected):
    monkeypatch.setenv("STUDIO_COMPILE_CACHE", str(tmp_path / "cc"))
    manager = RunManager(tmp_path / "runs")
    first = manager.plan(RunSpec.load(TINY), hardware)
    second = manager.plan(RunSpec.load(TINY).with_overrides(["learning_rate=0.01"]), hardware)
    for key, folder in expected.items():
        assert first.env[key] == second.env[key] == str(tmp_path / "cc" / folder)
        assert any(k == key for k, _, _ in first.applied), f"{key} is listed with its reason"
    if hardware.backend == "cpu":
        assert "TORCH_NEURONX_NEFF_CACHE_DIR" not in first.env


# --- what a real compile leaves, and its reuse ------------------------------------------
def test_a_real_inductor_compile_is_counted_and_hit_by_the_next_process(compiled):
    root, first, second = compiled
    assert first["inductor"].get("fxgraph_cache_miss") == 1 and "fxgraph_cache_hit" not in first["inductor"]
    # Dynamo traces again in the new process; Inductor's compiled graph comes from the cache
    assert second["inductor"].get("fxgraph_cache_hit") == 1 and "fxgraph_cache_miss" not in second["inductor"]
    assert second["aot_autograd"].get("autograd_cache_hit") == 1
    cache = summary(compile_cache_dir("cpu", root))
    assert cache.exists and cache.path == root / "cpu"
    assert cache.entries == {"Inductor FX graphs": 1, "AOTAutograd entries": 1}
    assert cache.size_bytes > 10_000  # the entries and the compiled C++ they load
    assert time.time() - 600 < cache.newest <= time.time()
    assert "Inductor FX graphs: 1" in cache.describe()


@pytest.mark.fast
def test_a_missing_cache_is_reported_as_not_created(tmp_path):
    cache = summary(tmp_path / "nothing")
    assert not cache.exists and cache.size_bytes == 0 and cache.entries == {}
    assert "not created yet" in cache.describe()


def test_clear_empties_the_folder_and_cli_shows_it(compiled, tmp_path):
    root = tmp_path / "cc"
    shutil.copytree(compiled[0] / "cpu", root / "cpu")  # real cache files, without compiling again
    env = {"STUDIO_COMPILE_CACHE": str(root)}
    shown = launch_py("cache", "--backend", "cpu", "--runs-dir", str(tmp_path / "runs"), env=env)
    assert shown.returncode == 0, shown.stderr
    assert str(root / "cpu") in shown.stdout and "Inductor FX graphs: 1, AOTAutograd entries: 1" in shown.stdout

    cleared = launch_py("cache", "--backend", "cpu", "--clear", "--runs-dir", str(tmp_path / "runs"), env=env)
    assert cleared.returncode == 0, cleared.stderr
    assert "Cleared" in cleared.stdout and "no entries" in cleared.stdout
    assert (root / "cpu").is_dir() and list((root / "cpu").iterdir()) == []
    assert summary(root / "cpu").size_bytes == 0


def test_clear_is_refused_while_a_run_is_active(manager, monkeypatch, tmp_path):
    root = tmp_path / "cc"
    monkeypatch.setenv("STUDIO_COMPILE_CACHE", str(root))
    folder = compile_cache_dir("cpu")
    (folder / "inductor").mkdir(parents=True)
    (folder / "inductor" / "kept").write_text("x")
    spec = RunSpec.load(TINY).with_overrides(["max_steps=3000", "logging_steps=50"])
    view = manager.start(spec, cpu_hardware())
    launch = json.loads((view.dir / "launch.json").read_text())
    assert launch["env"]["TORCHINDUCTOR_CACHE_DIR"] == str(folder / "inductor")  # the run uses it
    assert manager.view(view.id).live_state not in FINAL_STATES

    with pytest.raises(CacheInUse, match=view.id):
        clear(folder, manager.active_runs())
    refused = launch_py("cache", "--backend", "cpu", "--clear", "--runs-dir", str(manager.runs_dir),
                        env={"STUDIO_COMPILE_CACHE": str(root)})
    assert refused.returncode == 2 and view.id in refused.stderr and "Stop them" in refused.stderr
    assert (folder / "inductor" / "kept").exists()

    assert manager.stop(view.id).live_state == "stopped"
    assert clear(folder, manager.active_runs()).entries == {}
    assert list(folder.iterdir()) == []
