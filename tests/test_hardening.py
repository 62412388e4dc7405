"""What an attacker or a careless recipe tried, refused or contained: secrets kept out of run
folders and cards, a user's reward code run only on an explicit action (and without the Hub
token), run ids that are paths, a damaged run folder among sound ones.

The process faults (a killed supervisor, a deleted events file) are in test_runs.py, with
real runs; a page served before a login is in test_serve.py; the CLI's bad arguments in
test_cli_errors.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cli.main import main as cli_main
from studio_core.serve.chat import ChatError, resolve
from studio_core.export.export import _card_text
from studio_core.machine.hardware import cpu_hardware
from studio_core.recipe.rewards import check_rewards
from studio_core.runs.manager import RunManager, RunNotFound
from studio_core.recipe.spec import RunSpec, SpecError
from studio_core.recipe.validate import check_args

REPO = Path(__file__).resolve().parent.parent
GRPO = RunSpec.load(REPO / "recipes" / "tiny-grpo.yaml")
TOKEN = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
MARKER_REWARD = """
import os
from pathlib import Path
Path(os.environ["MARKER"]).write_text(os.environ.get("HF_TOKEN", "no token"))  # runs when imported

def my_reward(completions, **kwargs):
    return [1.0 for _ in completions]
"""


# --- secrets -------------------------------------------------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("key, value", [("hub_token", TOKEN), ("hub_token", "anything"), ("hub_model_id", TOKEN),
                                        ("model_init_kwargs", {"token": TOKEN})])
def test_a_secret_in_a_recipe_or_the_form_is_refused_with_the_ways_to_pass_one(key, value, tmp_path):
    (problem,) = check_args("sft", {key: value})
    assert problem.startswith(f"{key}: a secret does not belong in a recipe")
    assert "hf auth login" in problem and "HF_TOKEN" in problem and TOKEN not in problem
    manager = RunManager(tmp_path / "runs")
    spec = RunSpec.load(REPO / "recipes" / "tiny-sft.yaml").with_overrides([f"{key}={json.dumps(value)}"])
    for act in (manager.plan, manager.start):
        with pytest.raises(SpecError, match="a secret does not belong"):
            act(spec, cpu_hardware())
    assert list(manager.runs_dir.iterdir()) == []  # refused before anything is made


@pytest.mark.fast
def test_a_secret_in_an_old_run_folder_never_reaches_its_card():
    spec = RunSpec.load(REPO / "recipes" / "tiny-sft.yaml").with_overrides(["max_steps=7"])
    spec.args |= {"hub_token": TOKEN, "hub_model_id": f"me/model-{TOKEN}"}  # as a folder made before the check
    summary = {"spec": spec, "hardware": {"backend": "cpu"}, "cores": [0], "losses": [], "final": {},
               "last_loss": None, "compiles": 0, "compile_seconds": 0, "shapes": 0, "attempts": 1}
    card = _card_text(summary, "full", {"base_model": "builtin:tiny-qwen3", "base_model_path": "/m"}, None)
    assert TOKEN not in json.dumps(card) and "hub_token" not in card["settings"]
    assert "`max_steps` | `7`" in card["settings"]  # the other settings are all there


# --- a user's reward code runs only on an explicit action ----------------------------------
def grpo_with_marker_reward(tmp_path) -> tuple[RunSpec, Path]:
    (tmp_path / "marker_reward.py").write_text(MARKER_REWARD)
    return GRPO.with_overrides([f"studio.rewards=[{{file: {tmp_path / 'marker_reward.py'}, function: my_reward}}]"]), \
        tmp_path / "marker"


@pytest.mark.fast
def test_a_plan_or_a_preview_reads_a_reward_file_and_never_runs_it(tmp_path, monkeypatch):
    spec, marker = grpo_with_marker_reward(tmp_path)
    monkeypatch.setenv("MARKER", str(marker))
    launch = RunManager(tmp_path / "runs").plan(spec, cpu_hardware())  # Preview's and `launch.py plan`'s path
    assert launch.errors == [] and not marker.exists()
    broken = spec.with_overrides([f"studio.rewards=[{{file: {tmp_path / 'marker_reward.py'}, function: nope}}]"])
    with pytest.raises(SpecError, match="marker_reward.py has no 'nope'; it defines: my_reward"):
        RunManager(tmp_path / "runs").plan(broken, cpu_hardware())
    (tmp_path / "bad.py").write_text("def my_reward(:\n")
    problems = check_rewards([{"file": str(tmp_path / "bad.py"), "function": "my_reward"}], None, user_code=False)
    assert len(problems) == 1 and "bad.py line 1 is not valid Python" in problems[0]
    assert not marker.exists()


@pytest.mark.fast
def test_a_reward_file_that_is_not_python_says_so(tmp_path):
    (tmp_path / "rewards.txt").write_text("def my_reward(completions, **kwargs): return [1.0]\n")
    entry = [{"file": str(tmp_path / "rewards.txt"), "function": "my_reward"}]
    for user_code in (False, True):
        (problem,) = check_rewards(entry, None, user_code=user_code)
        assert "is not a Python file (it must end in .py)" in problem


def test_check_rewards_and_start_run_the_file_without_the_hub_token(tmp_path, monkeypatch):
    spec, marker = grpo_with_marker_reward(tmp_path)
    monkeypatch.setenv("MARKER", str(marker))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    RunManager(tmp_path / "runs").check(spec, run_user_code=True)  # "Check reward functions", and Start
    assert marker.read_text() == "no token"  # it ran, in a child that was not given the token


@pytest.mark.fast
def test_launch_py_plan_runs_nothing_of_a_reward_file(tmp_path, monkeypatch, capsys):
    spec, marker = grpo_with_marker_reward(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    spec.save(recipe)
    monkeypatch.setenv("MARKER", str(marker))
    code = cli_main(["plan", str(recipe), "--runs-dir", str(tmp_path / "runs"), "--backend", "cpu", "--no-forecast"])
    shown = capsys.readouterr()
    assert code == 0, shown.err
    assert "Settings the studio applied" in shown.out and not marker.exists()


# --- run ids are names, never paths ----------------------------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("run_id", ["../other/RUN", "/abs/RUN", "..", ".", "", "a/b", ".leases"])
def test_a_run_id_that_is_a_path_is_refused_naming_the_runs_folder(tmp_path, run_id):
    (tmp_path / "other" / "RUN").mkdir(parents=True)
    (tmp_path / "other" / "RUN" / "spec.yaml").write_text("model_name_or_path: x\n")  # a run folder outside
    manager = RunManager(tmp_path / "runs")
    for act in (manager.view, manager.stop, lambda r: manager.resume(r, cpu_hardware())):
        with pytest.raises(RunNotFound) as refused:
            act(run_id)
        assert str(manager.runs_dir) in refused.value.args[0]


@pytest.mark.fast
def test_chat_does_not_take_a_run_folder_outside_the_runs_folder_for_a_run(tmp_path):
    outside = tmp_path / "other" / "RUN"
    outside.mkdir(parents=True)
    (outside / "spec.yaml").write_text("model_name_or_path: x\n")
    with pytest.raises(ChatError, match="is a run folder, not a run id of .*--runs-dir"):
        resolve(str(outside), tmp_path / "runs")
    (tmp_path / "runs").mkdir()
    with pytest.raises(ChatError, match=f"give its id RUN with its runs folder \\(--runs-dir {outside.parent}\\)"):
        resolve("../other/RUN", tmp_path / "runs")


# --- one damaged run folder among sound ones ---------------------------------------------------
def test_a_damaged_run_folder_lists_as_damaged_and_the_others_as_ever(sft_runs, tmp_path, capsys):
    from app.runs_tab import run_info, runs_table  # the Runs tab's (imports Gradio)

    manager = sft_runs.copy_to(tmp_path / "runs", "full")
    sound = sft_runs.ids["full"]
    for name, damage in (("bad-spec", "spec"), ("bad-events", "events")):
        shutil.copytree(manager.runs_dir / sound, manager.runs_dir / name)
        if damage == "spec":
            (manager.runs_dir / name / "spec.yaml").write_text("studio: [x\n")
        else:
            with open(manager.runs_dir / name / "events.jsonl", "a") as events:
                events.write('\n{"type":"progress","step":4}\nnot json\n')
    views = {view.id: view for view in RunManager(manager.runs_dir).list()}
    assert set(views) == {sound, "bad-spec", "bad-events"}
    assert views[sound].damage() == [] and views[sound].live_state == "finished"
    (spec_problem,) = views["bad-spec"].damage()
    assert spec_problem.startswith("spec.yaml cannot be read (") and "settings are unknown" in spec_problem
    (events_problem,) = views["bad-events"].damage()
    assert events_problem.startswith("2 line(s) of events.jsonl are no event")
    assert views["bad-events"].live_state == "finished" and views["bad-events"].step == 300
    table = runs_table(list(views.values()))  # what the Runs tab shows: every run, one row each
    assert sorted(table["run"]) == sorted(views)
    assert "**Damaged:** spec.yaml cannot be read" in run_info(manager, "bad-spec")  # the opened run says so
    assert "Damaged" not in run_info(manager, sound)
    with pytest.raises(SpecError, match="run bad-spec cannot be resumed: its spec.yaml cannot be read"):
        manager.resume("bad-spec", cpu_hardware())
    with pytest.raises(SpecError, match="saved no checkpoint"):  # the sound one is refused for its own reason
        manager.resume(sound, cpu_hardware())
    assert cli_main(["runs", "--runs-dir", str(manager.runs_dir)]) == 0  # `launch.py runs`
    listed = capsys.readouterr().out
    assert "damaged: spec.yaml cannot be read" in listed and "damaged: 2 line(s)" in listed and sound in listed


# --- conversations a chat template would not render as meant ----------------------------------
@pytest.mark.fast
def test_records_out_of_order_train_with_a_warning_in_the_plan_and_bad_roles_are_refused(tmp_path):
    good = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    first = {"messages": [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Hi?"}]}
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [good, good, first, good, good, good]) + "\n")
    spec = RunSpec.load(REPO / "recipes" / "tiny-sft.yaml").with_overrides([f"dataset_name={data}"])
    launch = RunManager(tmp_path / "runs").plan(spec, cpu_hardware())
    assert launch.errors == [] and any("line 3" in w for w in launch.warnings), launch.warnings
    assert "line 3" in launch.describe()
    bot = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "bot", "content": "Hello."}]}
    data.write_text("\n".join(json.dumps(r) for r in [good, good, bot, good, good, good]) + "\n")
    with pytest.raises(SpecError, match="line 3: .*`bot`"):
        RunManager(tmp_path / "runs").plan(spec, cpu_hardware())
