"""Sweeps: a recipe over a grid of values, a run per combination, checked and planned before any
starts, then run through the queue; its table ranks the runs and says why a failed one failed,
which does not stop the others. `launch.py sweep` as a user runs it, real runs of the tiny model."""

from __future__ import annotations

import json
import re

import pytest

from conftest import launch_py, run_folders
from studio_core.recipe.spec import RunSpec, SpecError
from studio_core.runs import sweep
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


def test_a_sweep_runs_every_combination_and_ranks_them_a_failed_run_last(tmp_path):
    runs = tmp_path / "runs"
    broken = broken_model(tmp_path)
    done = launch_py("sweep", TINY, "--grid", "learning_rate=1e-3,3e-3", "--grid",
                     f"model_name_or_path=builtin:tiny-qwen3,{broken}", "--set", "max_steps=10", "--set",
                     "studio.eval_fraction=0.25", "--runs-dir", str(runs), "--wait", timeout=600)
    assert done.returncode == 1, done.stderr  # one of them failed: the sweep went on with the others
    table = done.stdout[done.stdout.index("best first by eval_loss"):].splitlines()[2:]
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
