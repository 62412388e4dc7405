"""The CLI and the web app start without torch, Transformers, TRL, datasets or PEFT: those load
in the processes that need them (the run's worker, the forecast's and the checks' children). A
check that can be answered from what is remembered on disk (data/remembered.py) imports none of
them either, so a plan or a Start asked again costs the studio's own start only.

Each process is a real one started with `python -X importtime`, whose report lists every module
it imported.
"""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO, RECIPES, launch_py, run_folders
from studio_core.data.builtin import ensure_tiny_model
from studio_core.machine.procs import kill_run_processes

HEAVY = {"torch", "transformers", "trl", "datasets", "peft", "accelerate"}


def heavy_imports(*args: str) -> set[str]:
    done = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
            if line.startswith("import time:")} & HEAVY


def test_plan_and_train_asked_again_import_no_heavy_library(tmp_path):
    ensure_tiny_model()  # its tokenizer here: the data scan's tokenizer pass runs (and is kept)
    recipe = str(RECIPES / "tiny-sft.yaml")
    common = ["--runs-dir", str(tmp_path), "--backend", "cpu"]
    first = launch_py("plan", recipe, *common, "--no-forecast")  # may import Transformers: nothing kept yet
    assert first.returncode == 0, first.stderr
    assert heavy_imports("launch.py", "plan", recipe, *common, "--no-forecast") == set()
    try:
        assert heavy_imports("launch.py", "train", recipe, *common, "--set", "max_steps=1", "--detach") == set()
    finally:
        for run in run_folders(tmp_path):
            kill_run_processes(run.name)
    assert len(run_folders(tmp_path)) == 1  # it did start the run


def test_the_web_app_is_built_without_a_heavy_library(tmp_path):
    code = ("from app.main import build_app; from studio_core.machine.hardware import cpu_hardware; "
            f"build_app({str(tmp_path)!r}, cpu_hardware())")
    assert heavy_imports("-c", code) == set()
