"""The shape forecast against what really reaches the model, and the compile events of real runs.

Each run is a real torchrun run of the tiny model with torch_compile on and automatic dynamic
shapes off (the planner's rule), on Dynamo's cheap "eager" backend (the unpadded SFT run on
"aot_eager", so its compile events show the backward too): Dynamo still traces and recompiles
per shape, so the shapes and compilations are those of a Trainium run, only fast.

The tests call the forecast in this process (`forecast`: the same walk without a Python start
and a TRL import each time); the child process the app and the CLI run it in is tested through
the CLI here (and through the page in test_browser_train.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import launch_py, run_folders
from studio_core.training.forecast import forecast, forecast_in_subprocess
from studio_core.machine.cache import cache_dir
from studio_core.machine.hardware import cpu_hardware, instance_hardware
from studio_core.machine.procs import kill_run_processes
from studio_core.rundir.events import read as read_events
from studio_core.recipe.spec import RunSpec, SpecError
from studio_core.runs.manager import RunManager

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
COMPILED = ["torch_compile=true", "torch_compile_backend=eager", "logging_steps=4"]
# (recipe, overrides, steps): each case trains the fewest steps that reach every batch shape its
# data makes (a forecast of 12 steps finds no other), since compiling is what a step here costs:
# the DPO run compiles again at every step.
CASES = {
    # its third shape comes at step 6; on aot_eager, 8 steps: test_compile_events_of_a_real_run reads this run too
    "sft-unpadded": ("tiny-sft.yaml", ["torch_compile_backend=aot_eager"], 8),
    "sft-padded-128": ("tiny-sft.yaml", ["pad_to_multiple_of=128"], 3),
    "sft-packed-wrapped": ("tiny-sft.yaml", ["packing=true", "packing_strategy=wrapped"], 3),
    "dpo-padded": ("tiny-dpo.yaml", ["pad_to_multiple_of=16"], 3),
    "reward-padded": ("tiny-reward.yaml", ["pad_to_multiple_of=16"], 3),  # chosen and rejected in one batch
    # past Dynamo's own limit of 8 recompiles a frame would run uncompiled: each of the 12 shapes compiles
    "sft-wide-12-shapes": ("tiny-sft.yaml", ["dataset_name=builtin:wide", "max_length=1024"], 12),
}


def recipe(name: str, *overrides: str) -> RunSpec:
    return RunSpec.load(RECIPES / name).with_overrides(list(overrides))


def trained(manager, case: str):
    """The case's run, finished, and the forecast of the spec its plan hands the worker."""
    name, overrides, steps = CASES[case]
    spec = recipe(name, *COMPILED, f"max_steps={steps}", *overrides)
    hardware = cpu_hardware()
    run = manager.start(spec, hardware)
    predicted = forecast(manager.plan(spec, hardware).spec, "cpu")  # while the run trains
    return manager.wait(run.id), predicted


@pytest.fixture(scope="module")
def unpadded(tmp_path_factory):
    """The sft-unpadded case trained once for this file's two tests that read it: (view, forecast)."""
    manager = RunManager(tmp_path_factory.mktemp("unpadded") / "runs")
    yield trained(manager, "sft-unpadded")
    for path in run_folders(manager.runs_dir):
        kill_run_processes(path.name)


@pytest.mark.parametrize("case", CASES)
def test_forecast_equals_the_shapes_that_reach_the_model(case, manager, request):
    steps = CASES[case][2]
    view, predicted = request.getfixturevalue("unpadded") if case == "sft-unpadded" else trained(manager, case)
    assert view.live_state == "finished", view.error_text
    observed = {tuple(event["shape"]) for event in view.shapes}
    assert observed == {(b, length) for b, length, _ in predicted.shapes}
    assert predicted.micro_batches == steps and not predicted.capped
    # the same tokens, so the forecast's padding waste is the run's
    assert view.tokens == predicted.real_tokens
    # every new shape made Dynamo compile the model's forward again, saying why
    first = view.compiles[0]["graph"].split("/")[0]
    recompiles = [c for c in view.compiles if c["graph"].split("/")[0] == first and c["phase"] == "forward"]
    assert len(recompiles) >= len(observed)
    assert all("size mismatch" in c["reason"] for c in recompiles[1:len(observed)] if c.get("reason"))


def test_forecast_sees_what_each_setting_changes():
    spec = recipe("tiny-sft.yaml", "max_steps=30")
    unpadded = forecast(spec, "cpu")
    assert unpadded.graphs > 1 and 0 < unpadded.waste < 0.3
    assert unpadded.truncated == 0 and len(unpadded.lengths) == 12
    # TRL's pad_to_multiple_of "auto" means 128 on Neuron: one shape for this short data
    on_neuron = forecast(spec.with_overrides(["pad_to_multiple_of=auto"]), "neuron")
    assert [s[:2] for s in on_neuron.shapes] == [[4, 128]] and on_neuron.waste > unpadded.waste
    # a short max_length cuts samples, and the forecast counts them
    short = forecast(spec.with_overrides(["max_length=30"]), "cpu")
    assert short.truncated == sum(length > 30 for length in short.lengths) > 0
    assert all(length <= 30 for _, length, _ in short.shapes)
    # each suggestion is worth taking, and applying it gives what it promised
    assert unpadded.suggestions
    for suggestion in unpadded.suggestions:
        assert suggestion["graphs"] < unpadded.graphs or suggestion["waste"] < unpadded.waste
    best = unpadded.suggestions[0]
    applied = forecast(spec.with_overrides([f"{k}={v}" for k, v in best["set"].items()]), "cpu")
    assert applied.graphs == best["graphs"] and applied.waste == pytest.approx(best["waste"], abs=1e-4)


def test_data_parallel_processes_share_the_batches():
    one = forecast(recipe("tiny-sft.yaml", "max_steps=10"), "cpu")
    two = forecast(recipe("tiny-sft.yaml", "max_steps=10", "studio.nproc=2"), "cpu")
    assert (one.micro_batches, two.micro_batches) == (10, 20)
    assert two.data_parallel == 2 and two.busiest_rank_shapes <= two.graphs


@pytest.mark.fast
def test_grpo_is_not_forecast_and_says_why():
    with pytest.raises(SpecError, match="generates"):
        forecast_in_subprocess(recipe("tiny-grpo.yaml"), "cpu")


def write_chats(path: Path, answers: list[int]) -> None:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "Say it."}, {
        "role": "assistant", "content": "yes " * n}]}) + "\n" for n in answers))


def test_a_forecast_is_remembered_while_what_it_read_stays(tmp_path):
    """The child's answer is kept on disk (the next process's plan reads it), and the data
    changed asks it again."""
    data = tmp_path / "chats.jsonl"
    write_chats(data, [3, 9, 27] * 4)
    spec = recipe("tiny-sft.yaml", f"dataset_name={data}", "max_steps=4")
    kept = cache_dir() / "forecasts"
    before = set(kept.glob("*.json"))
    first = forecast_in_subprocess(spec, "cpu")
    [entry] = set(kept.glob("*.json")) - before
    assert len(first.lengths) == 12
    tampered = json.loads(entry.read_text()) | {"steps": 999}
    entry.write_text(json.dumps(tampered))
    assert forecast_in_subprocess(spec, "cpu").steps == 999  # read from the disk, not walked again
    write_chats(data, [3, 9, 27, 81] * 5)
    again = forecast_in_subprocess(spec, "cpu")
    assert again.steps != 999 and len(again.lengths) == 20


def test_plan_without_the_forecast(tmp_path):
    """(README's plan for trn2.3xlarge, with its forecast, runs in tests/test_readme.py.)"""
    skipped = launch_py("plan", str(RECIPES / "tiny-sft.yaml"), "--runs-dir", str(tmp_path),
                        "--backend", "cpu", "--no-forecast")
    assert skipped.returncode == 0 and "Shape forecast" not in skipped.stdout


def test_compile_events_of_a_real_run(unpadded):
    view, _ = unpadded  # tiny SFT, torch_compile on aot_eager, 8 steps, a loss every 4
    assert view.live_state == "finished", view.error_text
    assert not view.compiling  # every compile_start has its compile_end
    assert {c["phase"] for c in view.compiles} == {"forward", "backward"}  # aot_eager compiles the backward too
    assert all(c["seconds"] >= 0 and c["step"] >= 1 for c in view.compiles)
    # the first step holds the first compilations; its step time leaves them out
    first_step_compile = sum(c["seconds"] for c in view.compiles if c["step"] == 1)
    assert first_step_compile > 0
    assert view.step_seconds[0] < view.progress_times[0][0] - view.started
    assert view.compile_seconds() == pytest.approx(sum(c["seconds"] for c in view.compiles))
    # each step that compiled says so, and the ETA's rate leaves it out (and the first step)
    progress = [e for e in read_events(view.dir / "events.jsonl") if e["type"] == "progress"]
    compiled = {e["step"] for e in progress if e["compiled"]}
    assert compiled == {c["step"] for c in view.compiles} and 1 in compiled
    assert view.steady_step_seconds == [e["step_s"] for e in progress[1:] if not e["compiled"]]
    # a new shape after the warm-up is a late compile, with Dynamo's reason naming the input
    late = [entry for entry in view.late_compiles() if entry["shape"]]
    assert late and all("input_ids" in entry["reason"] and "size mismatch" in entry["reason"] for entry in late)
    assert {tuple(entry["shape"]) for entry in late} <= {tuple(e["shape"]) for e in view.shapes}
    assert view.tokens > 0 and view.tokens_per_second() > 0


def test_plan_for_a_trn_instance_uses_neuron_padding_in_the_forecast(manager):
    hardware = instance_hardware("trn2.3xlarge")
    launch = manager.plan(recipe("tiny-dpo.yaml", "max_steps=5"), hardware)
    predicted = forecast(launch.spec, hardware.backend)
    assert all(length % 128 == 0 for _, length, _ in predicted.shapes)
