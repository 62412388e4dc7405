"""Precompile (studio_core/training/precompile.py): the run's batch shapes compiled before step 1 in
parallel jobs, so the run finds them in the compile cache; what cannot be precompiled is said
before launch.

A whole precompiled run (its jobs compile each shape into an empty cache, the run then finds every
graph there) is the smoke test's precompile step, checked in tests/test_smoke.py: one cold compile
of the tiny model's shapes for both, the slowest part of either on 2 CPU cores."""

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from studio_core.machine.hardware import cpu_hardware
from studio_core.training.plan import plan
from studio_core.training.precompile import job_environment
from studio_core.machine.procs import run_processes
from studio_core.rundir.events import read as read_events
from studio_core.recipe.spec import RunSpec
from studio_core.recipe.validate import validate

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "tiny-sft.yaml"
COMPILED = ["torch_compile=true", "studio.precompile=true"]


def spec(*overrides: str) -> RunSpec:
    return RunSpec.load(RECIPE).with_overrides(list(overrides))


@pytest.mark.fast
@pytest.mark.parametrize("overrides, expected", [
    (["studio.precompile=true"], "nothing compiles without torch_compile: true"),
    ([*COMPILED, "studio.nproc=2"], "one-process runs only (this one has 2)"),
    ([*COMPILED, "studio.run_on=slurm"], "local runs only"),
])
def test_what_cannot_be_precompiled_is_refused_before_launch(overrides, expected):
    planned = plan(spec(*overrides), cpu_hardware(), cores=[0])
    assert any(expected in error for error in planned.errors), planned.errors


@pytest.mark.fast
def test_grpo_is_not_precompiled_as_its_shapes_come_from_generation():
    grpo = RunSpec.load(ROOT / "recipes" / "tiny-grpo.yaml").with_overrides(COMPILED)
    (error,) = [e for e in plan(grpo, cpu_hardware(), cores=[0]).errors if "precompile" in e]
    assert "GRPO runs are not precompiled" in error


@pytest.mark.fast
def test_the_planner_picks_the_jobs_and_says_why_and_the_spec_keeps_them():
    planned = plan(spec(*COMPILED), cpu_hardware(), cores=[0])
    assert planned.errors == []
    (why,) = [reason for key, value, reason in planned.applied if key == "studio.precompile_jobs"]
    assert "one precompile job per core" in why
    assert planned.spec.precompile_jobs == min(8, cpu_hardware().cores)
    again = RunSpec.from_dict(json.loads(json.dumps(planned.spec.to_dict())))
    assert (again.precompile, again.precompile_jobs) == (True, planned.spec.precompile_jobs)
    chosen = plan(spec(*COMPILED, "studio.precompile_jobs=3"), cpu_hardware(), cores=[0])
    assert chosen.spec.precompile_jobs == 3 and not [k for k, _, _ in chosen.applied if k == "studio.precompile_jobs"]


@pytest.mark.fast
@pytest.mark.parametrize("jobs", [0, 65, "two", True])
def test_a_bad_number_of_jobs_says_what_to_write(jobs):
    problems = validate(spec(*COMPILED, f"studio.precompile_jobs={json.dumps(jobs)}"))
    assert any(p.startswith("studio.precompile_jobs: a whole number from 1 to 64") for p in problems), problems


@pytest.mark.fast
def test_jobs_without_precompile_is_a_clear_cli_error(tmp_path):
    done = subprocess.run([sys.executable, "launch.py", "plan", str(RECIPE), "--jobs", "2", "--runs-dir",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--jobs goes with --precompile" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.fast
def test_a_job_runs_alone_on_its_own_core_as_torchrun_would_start_one_rank():
    run_env = {"STUDIO_NEURON_CORES": "0-3", "TORCH_NEURONX_NEFF_CACHE_DIR": "/cache/neff"}
    env = job_environment("neuron", run_env, 5, 40123)
    assert env["NEURON_RT_VISIBLE_CORES"] == "5" and "STUDIO_NEURON_CORES" not in env
    assert env["TORCH_NEURONX_NEFF_CACHE_DIR"] == "/cache/neff"  # the run's own cache
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("0", "1", "40123")


def events_of(view, *types):
    return [e for e in read_events(view.dir / "events.jsonl") if e["type"] in types]


def test_a_stop_during_precompile_ends_the_jobs_and_the_run(manager, tmp_path, monkeypatch):
    monkeypatch.setenv("STUDIO_COMPILE_CACHE", str(tmp_path / "compile-cache"))
    view = manager.start(spec(*COMPILED, "studio.precompile_jobs=2", "max_steps=50"), cpu_hardware())
    deadline = time.monotonic() + 300
    while not events_of(view, "precompile_start"):  # the jobs are running
        assert time.monotonic() < deadline and manager.view(view.id).live_state == "starting"
        time.sleep(0.5)
    jobs = [p for p in run_processes(view.id) if "studio_core.training.precompile_worker" in " ".join(p.cmdline())]
    assert jobs

    view = manager.stop(view.id)
    assert view.state == "stopped" and view.step == 0
    psutil.wait_procs(jobs, timeout=30)
    assert run_processes(view.id) == []
    assert not events_of(view, "progress")  # it never trained


@pytest.mark.fast
@pytest.mark.parametrize("overrides", [[], [*COMPILED], [*COMPILED, "studio.precompile_jobs=3"]])
def test_precompile_goes_through_the_train_form_unchanged(overrides):
    from app.train_form import form_values, spec_from_form

    given = spec(*overrides)
    back = spec_from_form(form_values(given))
    assert (back.precompile, back.precompile_jobs) == (given.precompile, given.precompile_jobs)


@pytest.mark.fast
def test_the_walk_finds_each_shape_once_in_order_and_ends_on_an_empty_loader():
    from types import SimpleNamespace

    import torch
    from torch.utils.data import DataLoader

    from studio_core.training.precompile import first_batch_of_each_shape

    def trainer(batches, max_steps):  # what the walk reads of a Trainer: its args and train loader
        args = SimpleNamespace(max_steps=max_steps, gradient_accumulation_steps=1, num_train_epochs=1)
        return SimpleNamespace(args=args, get_train_dataloader=lambda: batches)

    lengths = [37, 34, 37, 33, 34]
    batches = DataLoader([{"input_ids": torch.zeros(4, n, dtype=torch.long)} for n in lengths], batch_size=None)
    found = first_batch_of_each_shape(trainer(batches, max_steps=12))  # more steps than batches: passes again
    assert [list(b["input_ids"].shape) for b in found] == [[4, 37], [4, 34], [4, 33]]
    empty = DataLoader([], batch_size=4, drop_last=True)  # fewer rows than one batch under drop_last
    assert first_batch_of_each_shape(trainer(empty, max_steps=5)) == []
