"""Issue 29, the run folder and the commands that take a run: one rule for a damaged spec.yaml
(every command through main(), and the engine's own readers), an events file that lost its
beginning, a run given as the path of its folder, export's --out, the plan's warnings before a
train starts, and the exported card's answer example run with plain transformers.

    .venv/bin/python -m pytest -q tests/test_hardening_runs.py
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import RECIPES, run_folders
from test_cli_errors import cli, no_app  # noqa: F401 (no_app: a fixture)
from studio_core.serve.chat import ChatError, resolve
from studio_core.rundir.checkpoints import RESUME_ENV
from studio_core.evaluate.evaluation import EvalRequest, check_request
from studio_core.export.export import OUTPUT_INFO, REPO_LINE, ExportError, export_run
from studio_core.machine.hardware import cpu_hardware
from studio_core.rundir import events, folder
from studio_core.runs.manager import RunManager, RunNotFound
from studio_core.recipe.spec import RunSpec, load_spec

RUN = "20250101-000000-finished-run-abc123"
DAMAGES = {  # what a damaged spec.yaml holds -> what the message says is wrong with it
    "not-utf8": (b"model_name_or_path: \xff\xfe\n", "cannot be read (not UTF-8 text: byte 20 is 0xff)"),
    "a-list": (b"- max_steps: 5\n- learning_rate: 1.0e-4\n", "holds no recipe (a mapping of settings) but list"),
    "cut-short": (None, "cannot be read (cut short"),  # the real spec.yaml, its second half gone
    "not-yaml": (b"studio: {trainer: sft\nmodel_name_or_path: [\n", "cannot be read (not YAML: "),
    "empty": (b"", "cannot be read (it is empty)"),
}


def make_run(runs_dir: Path, run_id: str = RUN, launch: dict | None = None) -> Path:
    """A finished run folder with a saved model's record (no model: nothing here loads one)."""
    run_dir = runs_dir / run_id
    (run_dir / folder.OUTPUT).mkdir(parents=True)
    RunSpec.load(RECIPES / "tiny-sft.yaml").save(run_dir / folder.SPEC)
    events.append(run_dir / folder.EVENTS, events.status("starting"))
    events.append(run_dir / folder.EVENTS, events.status("finished", exit_code=0))
    if launch is not None:
        folder.write_json(run_dir / folder.LAUNCH, launch)
    folder.write_json(run_dir / folder.OUTPUT / OUTPUT_INFO, {"kind": "full", "trainer": "sft", "base_model":
                                                              "builtin:tiny-qwen3", "task": "text-generation"})
    return run_dir


def damage(run_dir: Path, kind: str) -> None:
    spec = run_dir / folder.SPEC
    text, _ = DAMAGES[kind]
    spec.write_bytes(spec.read_bytes()[: len(spec.read_bytes()) // 2] if text is None else text)


# --- item 1: a damaged spec.yaml, one message everywhere --------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("kind", sorted(DAMAGES))
def test_every_command_names_a_damaged_spec_yaml(kind, tmp_path, no_app, capsys):
    runs = tmp_path / "runs"
    run_dir = make_run(runs)
    damage(run_dir, kind)
    says = f"spec.yaml of run {RUN} {DAMAGES[kind][1]}"
    for line in (["eval", RUN], ["export", RUN, "--out", str(tmp_path / "out")],
                 ["chat", RUN, "--prompt", "hi", "--backend", "cpu"], ["serve", RUN, "--backend", "cpu"],
                 ["train", "--resume", RUN, "--backend", "cpu"]):
        code, out, err = cli([*line, "--runs-dir", str(runs)], capsys)
        assert "Traceback" not in out + err and code == 2, (line, code, out, err)
        assert says in err, (line, err)
    assert not (tmp_path / "out").exists() and not (run_dir / "eval").exists()
    code, out, err = cli(["runs", "--runs-dir", str(runs)], capsys)
    assert code == 0 and f"damaged: spec.yaml {DAMAGES[kind][1]}" in out, out
    code, out, err = cli(["stop", RUN, "--runs-dir", str(runs)], capsys)  # stopping needs no settings
    assert code == 0 and f"Run {RUN}: finished" in out, err


@pytest.mark.fast
def test_the_engine_reads_a_damaged_spec_by_the_same_rule(tmp_path):
    runs = tmp_path / "runs"
    run_dir = make_run(runs)
    damage(run_dir, "not-utf8")
    view = RunManager(runs).view(RUN)
    assert view.spec_problem == DAMAGES["not-utf8"][1]
    with pytest.raises(folder.DamagedRun, match=r"spec.yaml of run .* cannot be read \(not UTF-8 text"):
        load_spec(run_dir)
    _, problems = check_request(EvalRequest(RUN), runs)  # the Evaluate tab's check
    assert any(f"spec.yaml of run {RUN} cannot be read (not UTF-8" in p for p in problems), problems
    with pytest.raises(ExportError, match=f"spec.yaml of run {RUN} cannot be read"):  # the Export tab's
        export_run(run_dir, tmp_path / "out")
    with pytest.raises(ChatError, match=f"spec.yaml of run {RUN} cannot be read"):  # the Chat tab's and serve's
        resolve(RUN, runs)


# --- item 2: events.jsonl lost while the run went on -------------------------------------
@pytest.mark.fast
def test_an_events_file_that_lost_its_beginning_is_damage_and_the_start_time_stays(tmp_path, capsys):
    runs = tmp_path / "runs"
    created = time.time() - 3600
    run_dir = make_run(runs, launch={"created": created, "backend": "local", "cores": [0]})
    (run_dir / folder.EVENTS).unlink()  # deleted mid-run; the run's processes write on into a new file
    events.append(run_dir / folder.EVENTS, events.log("a line the supervisor wrote after"))
    events.append(run_dir / folder.EVENTS, events.status("finished", exit_code=0))
    view = RunManager(runs).view(RUN)
    assert any("deleted or replaced while the run was going" in p for p in view.damage()), view.damage()
    assert view.first_start == pytest.approx(created)  # not the first surviving event's time
    assert view.wall_seconds() >= 3600 - 5
    code, out, _ = cli(["runs", "--runs-dir", str(runs)], capsys)
    assert "damaged: events.jsonl was deleted or replaced" in out, out
    assert time.strftime("%Y-%m-%d %H:%M", time.localtime(created)) in out, out

    (run_dir / folder.EVENTS).unlink()  # and missing altogether
    view = RunManager(runs).view(RUN)
    assert any("events.jsonl is missing" in p for p in view.damage())
    assert view.first_start == pytest.approx(created)


@pytest.mark.fast
def test_a_run_file_that_cannot_be_read_is_damage_not_a_traceback(tmp_path, capsys):
    """One folder.read_json reads every JSON file of a run, and vLLM's plan the models' configs: a
    file that cannot be read (here a folder where launch.json should be) reads as none."""
    runs = tmp_path / "runs"
    (make_run(runs) / folder.LAUNCH).mkdir()
    assert "launch.json cannot be read: how it was launched is unknown" in RunManager(runs).view(RUN).damage()
    code, out, err = cli(["runs", "--runs-dir", str(runs)], capsys)
    assert code == 0 and "damaged: launch.json cannot be read" in out and "Traceback" not in out + err, err


@pytest.mark.fast
def test_a_whole_events_file_is_no_damage(tmp_path):
    runs = tmp_path / "runs"
    make_run(runs, launch={"created": time.time(), "backend": "local", "cores": [0]})
    assert RunManager(runs).view(RUN).damage() == []


@pytest.mark.fast
def test_a_resumed_run_names_the_checkpoint_it_loads(tmp_path):
    runs = tmp_path / "runs"
    checkpoint = runs / RUN / "output" / "checkpoint-20"
    make_run(runs, launch={"created": time.time(), "env": {RESUME_ENV: str(checkpoint)}})
    from cli.train import checkpoint_step

    view = RunManager(runs).view(RUN)
    assert view.resumed_from() == str(checkpoint)
    assert checkpoint_step(view.resumed_from(), 30) == 20


# --- item 4: a run given as the path of its folder --------------------------------------
@pytest.mark.fast
def test_a_run_folder_path_inside_the_runs_folder_is_its_run(tmp_path, monkeypatch, capsys):
    runs = tmp_path / "runs"
    make_run(runs)
    monkeypatch.chdir(tmp_path)
    for given in (f"runs/{RUN}", f"./runs/{RUN}/", str(runs / RUN), f"runs/../runs/{RUN}"):
        code, out, err = cli(["stop", given, "--runs-dir", str(runs)], capsys)
        assert code == 0 and f"Run {RUN}: finished" in out, (given, err)
        code, out, err = cli(["export", given, "--out", "", "--runs-dir", str(runs)], capsys)
        assert code == 2 and "--out is empty: give a folder" in err, (given, err)  # got past the run id
        code, out, err = cli(["train", "--resume", given, "--backend", "cpu", "--runs-dir", str(runs)], capsys)
        assert code == 2 and "saved no checkpoint" in err, (given, err)
    assert RunManager(runs).view(f"runs/{RUN}").id == RUN  # the app's way in too


@pytest.mark.fast
def test_a_run_outside_the_runs_folder_and_links_leading_out_are_refused(tmp_path, capsys):
    runs, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    make_run(runs)
    outside = make_run(elsewhere, "20250101-000000-other-run-def456")
    (runs / "escape").symlink_to(outside)  # a link in the runs folder to a run outside it
    for given in (str(outside), str(runs / "escape"), "escape", f"{runs}/../elsewhere/{outside.name}"):
        code, out, err = cli(["stop", given, "--runs-dir", str(runs)], capsys)
        assert code == 2 and "Traceback" not in err and "`launch.py runs` lists the runs" in err, (given, err)
        with pytest.raises(RunNotFound):
            RunManager(runs).view(given)


# --- item 5: export's --out ------------------------------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("out, says", [("", "--out is empty: give a folder"),
                                       ("{run}/eval", "the export would be deleted with the run"),
                                       ("{run}", "the export would be deleted with the run"),
                                       ("{run}/output/x", "the export would be deleted with the run")])
def test_export_out_is_a_folder_outside_the_run(out, says, tmp_path, capsys):
    runs = tmp_path / "runs"
    run_dir = make_run(runs)
    code, _, err = cli(["export", RUN, "--out", out.format(run=run_dir), "--runs-dir", str(runs)], capsys)
    assert code == 2 and says in err and "Traceback" not in err, err
    assert not (run_dir / "eval").exists()


# --- item 3: the plan's warnings before a train starts ----------------------------------
def test_train_prints_the_plans_warnings_before_the_run_starts(tmp_path):
    data = tmp_path / "odd.jsonl"
    rows = [json.loads(line) for line in (RECIPES.parent / "studio_core" / "data" / "samples" / "qa.jsonl").read_text().splitlines()]
    rows[0] = {"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hello?"},
                            {"role": "assistant", "content": "Hello."}]}
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    runs = tmp_path / "runs"
    done = subprocess.run([sys.executable, "launch.py", "train", str(RECIPES / "tiny-sft.yaml"), "--set",
                           f"dataset_name={data}", "--set", "max_steps=2", "--backend", "cpu", "--detach",
                           "--runs-dir", str(runs)], cwd=RECIPES.parent, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 0, done.stdout
    warning = re.search(r"warning: (dataset: \S*odd\.jsonl: .*`user` turns.*)", done.stdout)
    started = re.search(r"Run (\S+) started", done.stdout)
    assert warning and started and warning.start() < started.start(), done.stdout  # before it starts
    manager = RunManager(runs)
    assert warning.group(1) in manager.view(started.group(1)).launch()["warnings"]
    run_id = started.group(1)
    manager.wait(run_id)


# --- item 6: the card's answer example --------------------------------------------------
def test_the_cards_example_answers_with_plain_transformers_and_no_think_block(trained_runs, tmp_path):
    manager, ids = trained_runs
    out = tmp_path / "export"
    export_run(manager.runs_dir / ids["full"], out, hardware=cpu_hardware())
    card = (out / "README.md").read_text()
    assert "enable_thinking" in card
    code = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    assert REPO_LINE in code
    code = code.replace(REPO_LINE, f"repo_id = {str(out)!r}")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # plain transformers, no studio code
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr
    answer = done.stdout.strip()
    assert answer and "<think>" not in answer and "</think>" not in answer, done.stdout
    assert run_folders(manager.runs_dir)
