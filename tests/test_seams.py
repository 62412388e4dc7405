"""What each seam promises, without training: the registry drives the data checks, the chat
and the card; the one fold of the events gives a resumed run's model card only the path that
led to its model; a run's backend is chosen by the spec and recorded in its plan.

Run folders here are written by hand, file by file as the studio writes them (spec.yaml,
launch.json, events.jsonl, output/studio_output.json), so no model is trained."""

import json
import os
from pathlib import Path

import pytest

from studio_core.runs import history
from studio_core.recipe import trainers
from studio_core.serve.chat import ChatError, ChatProcess
from studio_core.recipe.data_check import detect, fit_problems, suggest_fix
from studio_core.export.export import _card_text, run_summary
from studio_core.machine.hardware import cpu_hardware
from studio_core.training.plan import plan
from studio_core.rundir import events
from studio_core.runs.manager import RunManager
from studio_core.recipe.spec import RunSpec, SpecError

pytestmark = pytest.mark.fast  # starts no run, torchrun, browser or app: in `pytest -m fast`

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
USER = {"role": "user", "content": "What colour is the studio mascot?"}
GOOD = {"role": "assistant", "content": "Teal."}
BAD = {"role": "assistant", "content": "Orange."}


def run_folder(runs_dir: Path, name: str, recipe: str, timeline: list[dict], task: str | None = None) -> Path:
    """A run folder as the studio leaves it, with these events and (given a task) a saved model."""
    folder = runs_dir / name
    (folder / "output").mkdir(parents=True)
    RunSpec.load(RECIPES / recipe).save(folder / "spec.yaml")
    (folder / "launch.json").write_text(json.dumps({"backend": "local", "hardware": cpu_hardware().to_dict(),
                                                    "cores": [0], "applied": []}))
    for event in timeline:
        events.append(folder / "events.jsonl", event)
    if task:
        spec = RunSpec.load(folder / "spec.yaml")
        (folder / "output" / "studio_output.json").write_text(json.dumps({
            "kind": "full", "trainer": spec.trainer, "task": task, "base_model": spec.model_name_or_path,
            "base_model_path": "/nowhere"}))
    return folder


# --- the registry drives the data checks ----------------------------------------------------
def test_unpaired_feedback_fits_kto_and_dpo_names_kto():
    unpaired = detect([{"prompt": [USER], "completion": [GOOD], "label": True}])
    assert unpaired.type == "unpaired_preference"
    assert fit_problems(unpaired, "kto") == []
    (refusal,) = fit_problems(unpaired, "dpo")
    assert "train it with KTO, which takes unpaired preference data" in refusal
    pairs = detect([{"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}])
    assert fit_problems(pairs, "kto") == fit_problems(pairs, "reward") == []  # KTO unpairs pairs itself
    # a label column under another usual name is found and renamed for KTO
    rows = [{"prompt": "q", "completion": "a", "thumbs_up": False}]
    assert suggest_fix(rows, "kto") == {"column_map": {"thumbs_up": "label"}}


def test_every_trainer_says_what_data_it_needs_in_its_own_name():
    for key, trainer in trainers.TRAINERS.items():
        (problem,) = fit_problems(detect([{"something": "else"}]), key)
        assert problem.startswith(f"dataset: {trainer.name} needs {trainer.data_help}")


# --- the registry drives chat and the card: a reward model scores texts -----------------------
def test_a_reward_model_is_exported_but_not_offered_for_chat(tmp_path):
    manager = RunManager(tmp_path / "runs")
    done = [events.status("starting"), events.status("finished", exit_code=0)]
    run_folder(manager.runs_dir, "20261130-000001-sft-aaaaaa", "tiny-sft.yaml", done, "text-generation")
    run_folder(manager.runs_dir, "20261130-000002-reward-bbbbbb", "tiny-reward.yaml", done, "text-classification")
    assert history.runs_with_a_model(manager) == ["20261130-000002-reward-bbbbbb", "20261130-000001-sft-aaaaaa"]
    assert history.runs_with_a_model(manager, chats=True) == ["20261130-000001-sft-aaaaaa"]
    with pytest.raises(ChatError, match="trained a reward model: it gives a text a score"):
        ChatProcess.start("20261130-000002-reward-bbbbbb", manager.runs_dir, cpu_hardware())


# --- the fold: a resumed run's card shows the path to its model --------------------------------
def test_the_card_of_a_resumed_run_plots_only_the_path_that_led_to_the_model(tmp_path):
    timeline = [events.status("starting"), events.status("running", world_size=1, max_steps=6)]
    for step in range(1, 6):  # the first attempt: steps 1-5, a checkpoint at 3, then it was stopped
        timeline.append(events.metrics(step, None, {"loss": 10.0 - step}))
    timeline += [events.status("stopped", exit_code=0), events.resume(3, "output/checkpoint-3"),
                 events.status("starting"), events.status("running", world_size=1, max_steps=6)]
    for step in range(4, 7):
        timeline.append(events.metrics(step, None, {"loss": 1.0 / step}))
    timeline += [events.metrics(6, 1.0, {"train_loss": 0.4}), events.status("finished", exit_code=0)]
    folder = run_folder(tmp_path / "runs", "20261130-000003-sft-cccccc", "tiny-sft.yaml", timeline, "text-generation")

    summary = run_summary(folder)
    assert summary["losses"] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 0.25), (5, 0.2), (6, 1 / 6)]
    assert summary["last_loss"] == 1 / 6 and summary["final"]["train_loss"] == 0.4
    text = _card_text(summary, "full", {"base_model": "builtin:tiny-qwen3", "base_model_path": "/x"}, "loss.png")
    assert "resumed 1 time(s) from a checkpoint" in text["layout"]


def test_a_reward_models_card_says_what_it_is(tmp_path):
    done = [events.status("starting"), events.status("finished", exit_code=0)]
    folder = run_folder(tmp_path / "runs", "20261130-000004-reward-dddddd", "tiny-reward.yaml", done,
                        "text-classification")
    text = _card_text(run_summary(folder), "full", {"base_model": "builtin:tiny-qwen3", "base_model_path": "/x"},
                      None)
    assert text["what"].startswith("A reward model: it reads a text") and "does not generate text" in text["what"]
    assert "AutoModelForSequenceClassification" in text["loader"] and text["trainer"] == "reward modeling"


# --- the backend seam ---------------------------------------------------------------------
def test_the_plan_says_where_the_run_executes_and_an_unknown_place_is_refused(tmp_path):
    launch = plan(RunSpec.load(RECIPES / "tiny-sft.yaml"), cpu_hardware())
    assert launch.backend == "local" and launch.describe().startswith("Command (runs on this machine):")
    assert launch.argv[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    with pytest.raises(SpecError, match="studio.run_on: 'moon' is not a place runs can execute here; choose local"):
        RunManager(tmp_path / "runs").plan(RunSpec.load(RECIPES / "tiny-sft.yaml").with_overrides(
            ["studio.run_on=moon"]), cpu_hardware())


# --- the studio's children keep the user's PYTHONPATH ----------------------------------------
def test_a_childs_pythonpath_puts_the_repository_first_and_keeps_the_users(monkeypatch, tmp_path):
    from studio_core.machine import children

    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'mine'}:{tmp_path / 'also-mine'}")
    env = children.environment({"PYTHONPATH": str(children.REPO_ROOT), "OMP_NUM_THREADS": "1"})
    assert env["PYTHONPATH"].split(":") == [str(children.REPO_ROOT), str(tmp_path / "mine"),
                                            str(tmp_path / "also-mine")]
    assert env["OMP_NUM_THREADS"] == "1" and env["HOME"] == os.environ["HOME"]
    done = children.run("studio_core.machine.cores", env={}, capture_output=True, text=True, cwd=tmp_path)  # from anywhere
    assert done.returncode == 0, done.stderr


# --- an idle app costs next to nothing --------------------------------------------------------
def test_the_apps_queue_polls_at_an_idle_pace_gradio_still_reads(tmp_path):
    import inspect

    from app.main import PROGRESS_IDLE_S, QUEUE_IDLE_S, build_app, queued

    demo = queued(build_app(tmp_path / "runs", cpu_hardware()))
    queue = demo._queue
    assert (queue.sleep_when_free, queue.progress_update_sleep_when_free) == (QUEUE_IDLE_S, PROGRESS_IDLE_S)
    # a Gradio that no longer reads these would bring back its 1 ms idle loop: say so here
    assert "self.sleep_when_free" in inspect.getsource(type(queue).start_processing)
    assert "self.progress_update_sleep_when_free" in inspect.getsource(type(queue).start_progress_updates)
