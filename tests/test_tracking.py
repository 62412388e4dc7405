"""Experiment tracking in the run folder: TensorBoard and Trackio (TRL's report_to).

The tracked run is the session's history_runs "sft-b" (conftest: the tiny model, 20 steps, a
loss every 5, report_to [tensorboard, trackio]), copied into a folder of each test's own: no
training of this file's own. Each tracker's files are read back by its own reader, from where
the run page says to open them: TensorBoard's EventAccumulator on the `--logdir` of the page's
command, Trackio's own command line (`trackio get metric --json`) with its TRACKIO_DIR.
"""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from studio_core.runs import history
from studio_core.machine.hardware import cpu_hardware
from studio_core.training.plan import plan
from studio_core.recipe.spec import RunSpec

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
TRACKIO = Path(sys.executable).with_name("trackio")  # the studio environment's own command
SERIES = ("loss", "learning_rate", "grad_norm")  # what every SFT log line has (TRL's names)


@pytest.fixture
def tracked(history_runs, tmp_path):
    """sft-b copied into this test's runs folder: (manager, its view)."""
    manager = history_runs.copy_to(tmp_path / "runs", "sft-b")
    return manager, manager.view(history_runs.ids["sft-b"])


def hint_commands(view) -> dict[str, list[str]]:
    """The commands of the run page's tracking lines, {tracker: argv}, as a user copies them."""
    lines = history.tracking_hint(view).split("  \n")
    return {line.split(":")[0]: shlex.split(line.split("`")[1]) for line in lines}


def logged(view, name: str) -> list[tuple[int, float]]:
    """(step, value) of one metric, from the run's own metrics events."""
    return [(m["step"], m[name]) for m in view.metrics if name in m]


def trackio_json(trackio_dir: str, *args: str) -> dict:
    env = {**os.environ, "TRACKIO_DIR": trackio_dir, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([str(TRACKIO), *args, "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_tensorboard_events_in_the_run_folder_hold_the_run_metrics(tracked):
    _, view = tracked
    command = hint_commands(view)["TensorBoard"]
    assert command[:2] == ["tensorboard", "--logdir"]
    logdir = Path(command[2])
    assert logdir == view.dir / "tensorboard" and list(logdir.glob("events.out.tfevents.*"))
    assert not (view.dir / "output" / "runs").exists()  # not beside the saved model
    events = EventAccumulator(str(logdir))
    events.Reload()
    for name in SERIES:
        expected = logged(view, name)
        assert len(expected) == 5  # steps 1, 5, 10, 15, 20
        # TensorBoard keeps a scalar as a float32
        assert [(e.step, e.value) for e in events.Scalars(f"train/{name}")] == \
            [(step, float(np.float32(value))) for step, value in expected]


def test_trackio_in_the_run_folder_holds_the_run_metrics(tracked):
    _, view = tracked
    command = hint_commands(view)["Trackio"]
    assert command[0].startswith("TRACKIO_DIR=") and command[1:3] == ["trackio", "show"]
    trackio_dir = command[0].removeprefix("TRACKIO_DIR=")
    project = command[command.index("--project") + 1]
    assert Path(trackio_dir) == view.dir / "trackio" and project == view.id == view.spec["project"]
    assert trackio_json(trackio_dir, "list", "runs", "--project", project)["runs"] == ["tiny-sft-b"]  # TRL's run_name

    def series(metric: str) -> dict[int, float]:  # Trackio's own step (one per log call) -> value
        out = trackio_json(trackio_dir, "get", "metric", "--project", project, "--run", "tiny-sft-b",
                           "--metric", metric)
        return {point["step"]: point["value"] for point in out["values"]}

    global_step = series("train/global_step")  # transformers logs the trainer's step beside each line
    for name in SERIES:
        values = series(f"train/{name}")
        assert [(global_step[i], values[i]) for i in sorted(values)] == logged(view, name)


def test_deleting_the_run_deletes_its_tracking_and_a_clone_plans_it_again(tracked):
    manager, view = tracked
    clone = history.clone_spec(manager, view.id)
    assert clone.args["report_to"] == ["tensorboard", "trackio"] and "project" not in clone.args  # planned again
    tracking = sum(p.stat().st_size for name in ("tensorboard", "trackio") for p in (view.dir / name).rglob("*")
                   if p.is_file())
    size = view.size()
    assert size > tracking > 0 and history.delete_run(manager, view.id) == size  # counted, then freed
    assert not view.dir.exists() and manager.list() == []


@pytest.mark.fast
@pytest.mark.parametrize("report_to, tensorboard, trackio", [
    ("[tensorboard, trackio]", True, True), ("all", True, True), ("tensorboard", True, False),
    ("[trackio]", False, True), ("none", False, False), (None, False, False)])
def test_the_plan_puts_the_trackers_in_the_run_folder(tmp_path, report_to, tensorboard, trackio):
    spec = RunSpec.load(RECIPES / "tiny-sft.yaml")
    if report_to is not None:
        spec = spec.with_overrides([f"report_to={report_to}"])
    launch = plan(spec, cpu_hardware(), cores=[0], run_dir=tmp_path / "r", run_id="r-1")
    applied = {key: value for key, value, _ in launch.applied}
    assert launch.env.get("TENSORBOARD_LOGGING_DIR") == (str(tmp_path / "r" / "tensorboard") if tensorboard else None)
    assert launch.env.get("TRACKIO_DIR") == (str(tmp_path / "r" / "trackio") if trackio else None)
    assert launch.spec.args.get("project") == applied.get("project") == ("r-1" if trackio else None)
    # no Space on the Hub, even with push_to_hub (transformers' Trackio callback syncs one then)
    assert launch.spec.args.get("trackio_static_space_id", None) is (False if trackio else None)
    assert ("TRACKIO_DIR" in applied) == trackio and ("TENSORBOARD_LOGGING_DIR" in applied) == tensorboard


@pytest.mark.fast
def test_a_recipe_project_is_kept(tmp_path):
    spec = RunSpec.load(RECIPES / "tiny-sft.yaml").with_overrides(["report_to=trackio", "project=mine"])
    launch = plan(spec, cpu_hardware(), cores=[0], run_dir=tmp_path / "r", run_id="r-1")
    assert launch.spec.args["project"] == "mine" and "project" not in [key for key, *_ in launch.applied]
