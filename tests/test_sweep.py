"""Sweeps: a recipe over a grid of values, a run per combination, checked and planned before any
starts, then run through the queue; its table ranks the runs and says why a failed one failed,
which does not stop the others. `launch.py sweep` as a user runs it, real runs of the tiny model."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from conftest import launch_py, run_folders
from studio_core.machine.hardware import cpu_hardware
from studio_core.recipe.spec import RunSpec, SpecError
from studio_core.rundir import events
from studio_core.runs import queue, sweep, sweep_eval
from studio_core.runs.manager import RunManager
from test_runs import REPO, broken_model

TINY = str(REPO / "recipes" / "tiny-sft.yaml")


@pytest.mark.fast
def test_a_grid_is_every_combination_of_its_values_each_run_named_after_them():
    grid = sweep.parse_grid(["learning_rate=1e-4, 3e-4", "lora_r=8,16", "studio.nproc=1"])
    assert grid == {"learning_rate": ["1e-4", "3e-4"], "lora_r": ["8", "16"], "studio.nproc": ["1"]}
    runs = sweep.run_specs(RunSpec.load(TINY), grid)
    assert [sweep.label(params) for params, _ in runs][:2] == ["learning_rate=1e-4 lora_r=8 studio.nproc=1",
                                                               "learning_rate=1e-4 lora_r=16 studio.nproc=1"]
    assert len(runs) == 4 and len({spec.run_name for _, spec in runs}) == 4
    params, spec = runs[-1]
    assert (spec.args["learning_rate"], spec.args["lora_r"]) == (3e-4, 16)
    assert spec.run_name == "tiny-sft-learning_rate3e-4-lora_r16-nproc1"
    # a name made from a model id and long values keeps to run_name's characters and length, and differs
    named = sweep.run_specs(RunSpec.load(TINY).with_overrides(["run_name=null"]),
                            {"model_name_or_path": ["builtin:tiny-qwen3"], "learning_rate": ["0.000100000001", "2e-4"]})
    names = [spec.run_name for _, spec in named]
    assert names == ["sft-builtin-tiny-qwen3-model_name_or_pathbuiltintiny-qwen3-l-001",
                     "sft-builtin-tiny-qwen3-model_name_or_pathbuiltintiny-qwen3-l-002"]
    assert all(len(name) <= 64 and re.fullmatch(r"[A-Za-z0-9._-]+", name) for name in names) and len(set(names)) == 2


@pytest.mark.fast
@pytest.mark.parametrize("items, said", [
    ([], "at least one --grid"), (["learning_rate"], "write it as KEY=V1,V2"), (["=1,2"], "write it as KEY=V1,V2"),
    (["lora_r=8", "lora_r=16"], "--grid lora_r is given twice"), (["lora_r=,"], "write it as KEY=V1,V2")])
def test_a_malformed_grid_says_how_to_write_it(items, said):
    with pytest.raises(SpecError, match=said):
        sweep.parse_grid(items)


@pytest.mark.fast
@pytest.mark.parametrize("item, said", [
    ("learning_rate=1e-3,3e-3,1e-3", "--grid learning_rate: '1e-3' is given twice"),
    ("learning_rate=1e-3,0.001", "--grid learning_rate: '1e-3' and '0.001' are the same value"),
    ("lora_target_modules=[[q_proj, v_proj], [q_proj,v_proj]]",
     "--grid lora_target_modules: '[q_proj, v_proj]' and '[q_proj,v_proj]' are the same value")])
def test_a_value_given_twice_is_refused_naming_it_as_it_would_make_two_identical_runs(item, said):
    with pytest.raises(SpecError, match=re.escape(said)) as refused:
        sweep.parse_grid([item])
    assert "two identical runs; give it once" in str(refused.value)
    assert sweep.parse_grid(["lora_r=1,1.0,true"]) == {"lora_r": ["1", "1.0", "true"]}  # as YAML reads them: differ


@pytest.mark.fast
def test_values_that_hold_commas_are_given_as_a_yaml_list_each_run_getting_its_value():
    grid = sweep.parse_grid(["lora_target_modules=[[q_proj,v_proj], [q_proj, k_proj, v_proj]]",
                             'hub_model_id=["me/a,b", c]', "lora_r=8,16"])
    assert grid == {"lora_target_modules": ["[q_proj,v_proj]", "[q_proj, k_proj, v_proj]"],
                    "hub_model_id": ['"me/a,b"', "c"], "lora_r": ["8", "16"]}  # each value as written
    runs = sweep.run_specs(RunSpec.load(TINY), grid)
    assert len(runs) == 8
    assert sweep.label(runs[0][0]) == 'lora_target_modules=[q_proj,v_proj] hub_model_id="me/a,b" lora_r=8'
    assert [spec.args["lora_target_modules"] for _, spec in runs[::4]] == [["q_proj", "v_proj"],
                                                                          ["q_proj", "k_proj", "v_proj"]]
    assert [spec.args["hub_model_id"] for _, spec in runs[:4:2]] == ["me/a,b", "c"]
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", spec.run_name) for _, spec in runs)


@pytest.mark.fast
def test_the_train_tabs_grid_box_says_how_to_write_values_in_forms_the_grid_reads():
    """Issue 47: the box named only KEY=V1,V2; a value that holds commas was left to guess."""
    from app.sweep_panel import GRID_HELP, parse_lines

    examples = {"learning_rate=1e-4,3e-4": ["1e-4", "3e-4"],
                "lora_target_modules=[[q_proj, v_proj], [q_proj, k_proj, v_proj]]": ["[q_proj, v_proj]",
                                                                                     "[q_proj, k_proj, v_proj]"],
                'KEY=["a,b", c]': ['"a,b"', "c"]}
    for example, values in examples.items():
        assert example in GRID_HELP, GRID_HELP
        assert list(parse_lines(example).values()) == [values]
    assert "YAML (or JSON) list" in GRID_HELP and "One key a line" in GRID_HELP


@pytest.mark.fast
@pytest.mark.parametrize("item, said", [
    ("lora_target_modules=[[q_proj, v_proj], [q_proj", "--grid lora_target_modules='[[q_proj, v_proj], [q_proj' is "
                                                       "not a YAML list"),
    ("run_name=\"a,b\",c", "--grid run_name: value '\"a' is not valid YAML"),
    ("lora_r=[]", "--grid lora_r='[]': give a list of one value or more")])
def test_a_grid_value_that_is_not_yaml_is_said_under_grid_with_the_list_form(tmp_path, item, said):
    runs = tmp_path / "runs"
    done = launch_py("sweep", TINY, "--grid", item, "--runs-dir", str(runs))
    assert done.returncode == 2 and said in done.stderr and "--set" not in done.stderr, done.stderr
    assert "KEY=[V1, V2]" in done.stderr or '=[\"a,b\", c]' in done.stderr
    assert "Traceback" not in done.stderr and run_folders(runs) == []


def test_an_evaluation_that_cannot_be_done_is_refused_before_any_run_starts(tmp_path):
    runs = tmp_path / "runs"
    rewards = launch_py("sweep", TINY, "--grid", "learning_rate=1e-3,3e-3", "--eval", "--eval-metrics",
                        "rouge_l,mean_reward", "--runs-dir", str(runs))
    assert rewards.returncode == 2 and "Traceback" not in rewards.stderr, rewards.stderr
    assert "- every run: its evaluation: mean_reward scores answers with a run's reward functions" in rewards.stderr
    plain = tmp_path / "plain.jsonl"  # SFT trains on plain text; an evaluation needs prompts to answer
    plain.write_text("".join(json.dumps({"text": f"fact number {n} is {n * 7}"}) + "\n" for n in range(8)))
    no_prompts = launch_py("sweep", TINY, "--grid", "learning_rate=1e-3,3e-3", "--set", f"dataset_name={plain}",
                           "--eval", "--runs-dir", str(runs))
    assert no_prompts.returncode == 2 and "Traceback" not in no_prompts.stderr, no_prompts.stderr
    assert "- every run: its evaluation: the evaluation set has no prompts to answer (columns: text)" in \
        no_prompts.stderr
    assert "nothing was started" in no_prompts.stderr
    assert not runs.exists() or [p.name for p in run_folders(runs)] in ([], ["sweeps"])
    from app.sweep_panel import start_sweep  # the Train tab's Sweep section checks the same

    said = start_sweep(RunManager(runs), RunSpec.load(TINY).with_overrides([f"dataset_name={plain}"]),
                       "learning_rate=1e-3,3e-3", cpu_hardware(), evaluate=True)
    assert said.startswith("**Sweep not started:**") and "its evaluation: the evaluation set has no prompts" in said
    assert not runs.exists() or [p.name for p in run_folders(runs)] in ([], ["sweeps"])


def test_bad_values_refuse_the_whole_sweep_before_anything_starts(tmp_path):
    runs = tmp_path / "runs"
    done = launch_py("sweep", TINY, "--grid", "learning_rate=1e-3,abc", "--grid", "bogus_key=1", "--runs-dir",
                     str(runs))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "- every run: bogus_key: not a setting of TRL's SFTConfig" in done.stderr
    assert "- learning_rate=abc bogus_key=1: learning_rate: expected float" in done.stderr
    assert "nothing was started" in done.stderr and run_folders(runs) == []
    big = launch_py("sweep", TINY, "--grid", "learning_rate=" + ",".join(f"{n}e-4" for n in range(1, 18)),
                    "--runs-dir", str(runs))
    assert big.returncode == 2 and "the grid makes 17 runs, more than 16" in big.stderr and run_folders(runs) == []


@pytest.mark.fast
def test_runs_that_differ_only_in_optimizer_numbers_share_one_precompile():
    grid = sweep.parse_grid(["learning_rate=1e-4,3e-4", "lora_r=8,16", "warmup_ratio=0,0.1"])
    params = sweep.combinations(grid)
    leaders = sweep.precompile_leaders(params)
    # each lora_r's first run precompiles; its runs with other learning rates or warmups wait for it
    assert leaders == [None, 0, None, 2, 0, 0, 2, 2]
    assert all(params[leader]["lora_r"] == values["lora_r"] for values, leader in zip(params, leaders)
               if leader is not None)
    assert sweep.precompile_leaders(sweep.combinations({"max_length": ["64", "128"]})) == [None, None]


@pytest.mark.fast
def test_the_table_ranks_by_the_evaluations_when_every_finished_run_has_one():
    def row(state, loss, evaluation=None):
        return {"state": state, "loss": loss, "eval_loss": None, "evaluation": evaluation}

    rows = [row("finished", 1.0, {"eval_loss": 2.5, "rouge_l": 0.1}), row("finished", 2.0, {"eval_loss": 2.0}),
            row("failed", None)]
    name, value = sweep.ranking(rows)
    assert name == "the evaluation's eval_loss" and sorted(rows, key=value)[0]["loss"] == 2.0
    rows[1]["evaluation"] = {"rouge_l": 0.3}  # no eval_loss in one of them: the next metric, higher is better
    name, value = sweep.ranking(rows)
    assert name == "the evaluation's rouge_l" and sorted(rows, key=value)[0]["loss"] == 2.0
    rows[1]["evaluation"] = "waits to be evaluated"  # not all evaluated yet: the training loss
    assert sweep.ranked_by(rows) == "the last loss"
    assert sweep.scores_text({"eval_loss": 2.31234, "rouge_l": 0.2}) == "eval_loss 2.312 rouge_l 0.2"


FAKE_TOKEN = "hf_FAKEabcdefghijklmnopqrstuvwxyz0123"


@pytest.mark.fast
@pytest.mark.parametrize("key", ["run_name", "hub_model_id", "studio.slurm.account"])
def test_a_token_in_a_grid_value_is_refused_without_repeating_it_and_nothing_is_written(tmp_path, key):
    runs = tmp_path / "runs"
    done = launch_py("sweep", TINY, "--grid", f"{key}=a,{FAKE_TOKEN}", "--runs-dir", str(runs))
    assert done.returncode == 2 and f"--grid {key}: a secret does not belong in a recipe" in done.stderr
    assert FAKE_TOKEN not in done.stdout + done.stderr and "Traceback" not in done.stderr
    assert run_folders(runs) == [] or [p.name for p in run_folders(runs)] == ["sweeps"] and not any(
        (runs / "sweeps").iterdir())


@pytest.mark.fast
@pytest.mark.parametrize("runs_entries", ["[1, 2]", '[{"id": 7}]', '[{"id": "a", "params": "x"}]'])
def test_a_sweep_record_with_damaged_run_entries_is_named_not_a_traceback(tmp_path, runs_entries):
    runs = tmp_path / "runs"
    (runs / "sweeps").mkdir(parents=True)
    (runs / "sweeps" / "sweep-x.json").write_text(f'{{"grid": {{}}, "runs": {runs_entries}}}')
    shown = launch_py("sweep", "--show", "sweep-x", "--runs-dir", str(runs))
    assert shown.returncode == 2 and "its run 1 is not a run's id and values" in shown.stderr, shown.stderr
    assert "Traceback" not in shown.stderr


@pytest.mark.fast
@pytest.mark.parametrize("options, said", [
    (["--eval-limit", "5"], "--eval-limit and --eval-metrics go with --eval"),
    (["--eval", "--eval-metrics", "bleu"], "bleu"),
    (["--parallel", "2", "--ray", "http://127.0.0.1:9"], "--parallel: for sweeps on this machine or on Slurm"),
    (["--grid", "studio.run_on=local,slurm"], "sweep studio.run_on in separate sweeps"),
])
def test_sweep_options_that_cannot_be_used_are_refused_before_anything_starts(tmp_path, options, said):
    runs = tmp_path / "runs"
    done = launch_py("sweep", TINY, "--grid", "learning_rate=1e-3,3e-3", *options, "--runs-dir", str(runs))
    assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert run_folders(runs) == []


def test_a_sweep_at_most_one_at_once_evaluates_each_run_when_it_ends_and_ranks_by_it(tmp_path):
    runs = tmp_path / "runs"
    done = launch_py("sweep", TINY, "--grid", "learning_rate=1e-3,3e-3", "--set", "max_steps=4", "--parallel", "1",
                     "--eval", "--eval-limit", "3", "--runs-dir", str(runs), "--wait", timeout=600)
    assert done.returncode == 0, done.stderr
    (record,) = [path for path in (runs / "sweeps").glob("*.json") if not path.name.endswith(sweep_eval.EVALS)]
    manager = RunManager(runs)
    first, second = (manager.view(entry["id"]) for entry in json.loads(record.read_text())["runs"])
    began = next(e["time"] for e in events.read(second.dir / "events.jsonl") if e.get("state") == "starting")
    assert began >= first.spans[-1].end - 1  # one at a time: the second waited for the first to end
    # --wait waited for the evaluations too (the queue runner's, one at a time) and printed them
    assert len(re.findall(r"\n    evaluation: .*eval_loss \d", done.stdout)) == 2, done.stdout
    rows = sweep.table(manager, record.stem)
    assert all(isinstance(row["evaluation"], dict) for row in rows), rows
    assert sweep.ranked_by(rows) == "the evaluation's eval_loss"
    assert rows[0]["evaluation"]["eval_loss"] <= rows[1]["evaluation"]["eval_loss"]
    assert all(list((manager.runs_dir / row["id"] / "eval").glob("*/summary.json")) for row in rows)
    shown = launch_py("sweep", "--show", record.stem, "--runs-dir", str(runs))
    assert "best first by the evaluation's eval_loss" in shown.stdout
    assert re.search(r"\n    evaluation: .*eval_loss \d", shown.stdout), shown.stdout
    deadline = time.monotonic() + 30  # nothing left to do: the runner lets go of the queue and exits
    while (fd := queue.lock_queue(runs)) is None:
        assert time.monotonic() < deadline, "the queue runner did not exit"
        time.sleep(0.5)
    os.close(fd)


def test_runs_of_the_same_shapes_wait_for_the_one_precompile_of_the_first(tmp_path):
    runs = tmp_path / "runs"
    done = launch_py("sweep", TINY, "--grid", "learning_rate=1e-3,3e-3", "--set", "torch_compile=true",
                     "--precompile", "--jobs", "1", "--runs-dir", str(runs))
    assert done.returncode == 0, done.stderr
    (record,) = (runs / "sweeps").glob("*.json")
    first, second = json.loads(record.read_text())["runs"]
    assert "precompiled_by" not in first and second["precompiled_by"] == first["id"]
    manager = RunManager(runs)
    try:
        leader, follower = manager.view(first["id"]), manager.view(second["id"])
        assert leader.spec["studio"]["precompile"] is True and "precompile" not in follower.spec.get("studio", {})
        assert follower.live_state == "queued" and queue.hold_of(follower.dir) == {"after": leader.id}
        assert f"waits for run {leader.id} to precompile" in follower.where()  # while the leader precompiles
        shown = launch_py("sweep", "--show", record.stem, "--runs-dir", str(runs))
        assert f"shares the precompile of run {leader.id}" in shown.stdout
    finally:
        for run in (second, first):
            manager.stop(run["id"])
    assert manager.view(second["id"]).error_text == queue.CANCELLED


def test_a_sweep_runs_every_combination_and_ranks_them_a_failed_run_last(tmp_path):
    runs = tmp_path / "runs"
    broken = broken_model(tmp_path)
    done = launch_py("sweep", TINY, "--grid", "learning_rate=1e-3,3e-3", "--grid",
                     f"model_name_or_path=builtin:tiny-qwen3,{broken}", "--set", "max_steps=10", "--set",
                     "studio.eval_fraction=0.25", "--runs-dir", str(runs), "--wait", timeout=600)
    assert done.returncode == 1, done.stderr  # one of them failed: the sweep went on with the others
    table = done.stdout[done.stdout.index("best first by the last eval_loss"):].splitlines()[2:]
    states = [line.split()[1] for line in table if not line.startswith("    ")]
    assert states == ["finished", "finished", "failed", "failed"], done.stdout
    (record,) = (runs / "sweeps").glob("*.json")
    saved = json.loads(record.read_text())
    assert saved["grid"] == {"learning_rate": ["1e-3", "3e-3"],
                             "model_name_or_path": ["builtin:tiny-qwen3", str(broken)]}
    assert len(saved["runs"]) == 4 and len(run_folders(runs)) == 5  # the four runs and the sweeps folder
    rows = sweep.table(RunManager(runs), record.stem)
    finished = [row for row in rows if row["state"] == "finished"]
    assert finished[0]["eval_loss"] <= finished[1]["eval_loss"]  # best first
    assert all(row["why"] for row in rows if row["state"] == "failed")  # the table says why
    shown = launch_py("sweep", "--show", record.stem, "--runs-dir", str(runs))
    assert shown.returncode == 0 and shown.stdout.splitlines()[2:] == table
    record.write_text('{"runs": [')  # cut short: said, no traceback
    damaged = launch_py("sweep", "--show", record.stem, "--runs-dir", str(runs))
    assert damaged.returncode == 2 and "cannot be read" in damaged.stderr and "Traceback" not in damaged.stderr
