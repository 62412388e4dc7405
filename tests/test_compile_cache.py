"""The persistent compile cache: its folders, the plan's environment, what clearing does.

What a real torch.compile leaves in it, and its reuse by the next process, is checked by
the doctor's compiled step (tests/test_doctor.py), which compiles twice in new processes
pointed at the cache by the same environment a run gets. The NEFF cache needs Trainium;
here its folder, environment and layout (NEFF files two shard folders down, and the kernel
path's one folder down) are checked.
"""

import json
from pathlib import Path

import pytest

from conftest import launch_py
from studio_core.machine.compile_cache import (CacheInUse, clear, compile_cache_dir, compile_cache_env,
                                       compile_cache_root, summary)
from studio_core.rundir.events import FINAL_STATES
from studio_core.machine.hardware import cpu_hardware, instance_hardware
from studio_core.recipe.spec import RunSpec

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny-sft.yaml"


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
    with pytest.raises(ValueError, match="neuron, cuda, cpu"):
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
    """The planner, given the root as RunManager gives it (compile_cache_root(), read when a run is
    planned), points every run of a backend at the same folders. (RunManager.plan adds the spec's
    checks, TRL's among them: seconds, and nothing to do with the cache.)"""
    from studio_core.training.plan import plan

    monkeypatch.setenv("STUDIO_COMPILE_CACHE", str(tmp_path / "cc"))
    first = plan(RunSpec.load(TINY), hardware, compile_cache=compile_cache_root())
    second = plan(RunSpec.load(TINY).with_overrides(["learning_rate=0.01"]), hardware,
                  compile_cache=compile_cache_root())
    for key, folder in expected.items():
        assert first.env[key] == second.env[key] == str(tmp_path / "cc" / folder)
        assert any(k == key for k, _, _ in first.applied), f"{key} is listed with its reason"
    if hardware.backend == "cpu":
        assert "TORCH_NEURONX_NEFF_CACHE_DIR" not in first.env


@pytest.mark.fast
def test_neffs_are_counted_as_files_at_any_depth(tmp_path):
    """TorchNeuron's layouts: <dir>/ab/cd/<key>.neff (its persistent cache) and <dir>/<hash>/<hash>.neff
    (its kernel path), with other files beside them."""
    neff = compile_cache_dir("neuron", tmp_path) / "neff"
    for key in ("ab12ff", "ab34ee", "cd56aa"):
        (neff / key[:2] / key[2:4]).mkdir(parents=True, exist_ok=True)
        (neff / key[:2] / key[2:4] / f"{key}.neff").write_bytes(b"\0" * 100)
    (neff / "ab" / "12" / "ab12ff.lock").write_text("")
    (neff / "5e5e5e5e").mkdir()
    (neff / "5e5e5e5e" / "5e5e5e5e.neff").write_bytes(b"\0" * 100)
    cache = summary(compile_cache_dir("neuron", tmp_path))
    assert cache.entries == {"NEFFs": 4} and "NEFFs: 4" in cache.describe()  # not 3 top-level folders


@pytest.mark.fast
def test_a_missing_cache_is_reported_as_not_created(tmp_path):
    cache = summary(tmp_path / "nothing")
    assert not cache.exists and cache.size_bytes == 0 and cache.entries == {}
    assert "not created yet" in cache.describe()


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
