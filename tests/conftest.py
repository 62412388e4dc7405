"""Shared test setup: offline, and one studio cache for the whole session.

The cache holds the built-in tiny model and TRL's field schema, both made on first use;
sharing it keeps each test from rebuilding them, while keeping the user's own cache
(~/.cache/trn-studio) out of the tests.
"""

import os
import tempfile

import pytest

from studio_core.hardware import CPU_CORES_ENV

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ.setdefault("STUDIO_CACHE_DIR", tempfile.mkdtemp(prefix="studio-test-cache-"))
# datasets' own cache of the JSONL files the tests load, away from the user's
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="studio-test-datasets-"))
# Every test has a runs folder of its own, so "next free" starts each run on core 0: with two
# pytest-xdist workers, the second one's cores start on another CPU (STUDIO_CPU_CORES), so
# their runs do not share one CPU while the other idles.
_CPUS, _WORKER = sorted(os.sched_getaffinity(0)), os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and len(_CPUS) > 1 and CPU_CORES_ENV not in os.environ:
    _FIRST = int(_WORKER[2:]) % len(_CPUS)
    os.environ[CPU_CORES_ENV] = ",".join(map(str, _CPUS[_FIRST:] + _CPUS[:_FIRST]))


def run_folders(runs_dir):
    """The run folders in a runs folder, without the studio's own state (.leases/)."""
    return [p for p in runs_dir.iterdir() if not p.name.startswith(".")]


@pytest.fixture
def manager(tmp_path):
    """A run manager over a fresh runs folder; no trainer outlives the test."""
    from studio_core.procs import kill_run_processes
    from studio_core.runs.manager import RunManager

    runs = RunManager(tmp_path / "runs")
    yield runs
    for path in run_folders(runs.runs_dir):
        kill_run_processes(path.name)


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory):
    """A full SFT run and a LoRA SFT run of the tiny model on the built-in question and answer
    set (recipes/tiny-sft.yaml, recipes/tiny-sft-lora.yaml), finished: (manager, {"full", "lora"})."""
    from pathlib import Path

    from studio_core.hardware import cpu_hardware
    from studio_core.runs.manager import RunManager
    from studio_core.spec import RunSpec

    recipes = Path(__file__).resolve().parent.parent / "recipes"
    manager = RunManager(tmp_path_factory.mktemp("trained") / "runs")
    ids = {kind: manager.start(RunSpec.load(recipes / recipe), cpu_hardware()).id
           for kind, recipe in (("full", "tiny-sft.yaml"), ("lora", "tiny-sft-lora.yaml"))}
    for run_id in ids.values():
        view = manager.wait(run_id)
        assert view.live_state == "finished", view.error_text
    return manager, ids
