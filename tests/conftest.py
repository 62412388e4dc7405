"""Shared test setup: offline, and one studio cache for the whole session.

The cache holds the built-in tiny model and TRL's field schema, both made on first use;
sharing it keeps each test from rebuilding them, while keeping the user's own cache
(~/.cache/trn-studio) out of the tests.
"""

import os
import tempfile

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ.setdefault("STUDIO_CACHE_DIR", tempfile.mkdtemp(prefix="studio-test-cache-"))
# datasets' own cache of the JSONL files the tests load, away from the user's
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="studio-test-datasets-"))


def run_folders(runs_dir):
    """The run folders in a runs folder, without the studio's own state (.leases/)."""
    return [p for p in runs_dir.iterdir() if not p.name.startswith(".")]


@pytest.fixture
def manager(tmp_path):
    """A run manager over a fresh runs folder; no trainer outlives the test."""
    from studio_core.procs import kill_run_processes
    from studio_core.runs import RunManager

    runs = RunManager(tmp_path / "runs")
    yield runs
    for path in run_folders(runs.runs_dir):
        kill_run_processes(path.name)
