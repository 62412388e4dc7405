"""Evaluation for real: preference accuracy, a stopped evaluation of a LoRA run that keeps what it
scored and frees its core, a GRPO run scored under its own reward functions, and a held-out
fraction that training and evaluation agree on. `launch.py eval` on the built-in Q&A (the tuned model right, its random base not)
and the exported card's model-index are README commands (tests/test_readme.py); bad input is in
tests/test_cli_errors.py (fast).

    .venv/bin/python -m pytest -q tests/test_eval.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import RECIPES
from studio_core.machine import leases
from studio_core.data.builtin import BUILTIN_DATASETS
from studio_core.evaluate.evaluation import EvalProcess, EvalRequest, read_rows_file
from studio_core.machine.hardware import cpu_hardware
from studio_core.recipe.rewards import reward_functions
from studio_core.recipe.spec import RunSpec


def questions(dataset: str = "builtin:qa") -> dict[str, str]:
    """The built-in sample's questions and their answers."""
    rows = [json.loads(line) for line in BUILTIN_DATASETS[dataset].read_text().splitlines() if line.strip()]
    return {row["messages"][0]["content"]: row["messages"][1]["content"] for row in rows}


def test_the_tuned_model_prefers_the_chosen_answers_and_a_stopped_evaluation_frees_its_core(trained_runs, tmp_path):
    manager, ids = trained_runs
    runs_dir = tmp_path / "runs"
    for key in ("full", "lora"):
        shutil.copytree(manager.runs_dir / ids[key], runs_dir / ids[key])
    hardware = cpu_hardware()
    # an lm-eval task of the user's, offline: two identical choices score the same and lm-eval picks the
    # first of equals, so its accuracy is the share of rows whose target is the first: 3 of 8
    include = tmp_path / "tasks"
    include.mkdir()
    rows = [{"question": q, "choices": ["teal", "teal"], "label": 0 if i < 3 else 1} for i, q in enumerate(
        list(questions())[:8])]
    (include / "same.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (include / "same.yaml").write_text(json.dumps({
        "task": "studio_same_choices", "dataset_path": "json", "test_split": "test",
        "dataset_kwargs": {"data_files": {"test": str(include / "same.jsonl")}}, "output_type": "multiple_choice",
        "doc_to_text": "{{question}}", "doc_to_choice": "choices", "doc_to_target": "label",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}))
    request = EvalRequest(ids["full"], data="builtin:preference", metrics=("preference_accuracy", "exact_match"),
                          tasks=("studio_same_choices",), task_include=str(include))
    evaluation = EvalProcess.start(request, runs_dir, hardware)
    assert leases.holders(runs_dir, "cpu", hardware.cores)[evaluation.cores[0]]["kind"] == "eval"
    events = list(evaluation.events())
    assert [e["type"] for e in events][0] == "loaded" and events[-1]["type"] == "done"
    results = events[-1]["summary"]["results"]
    # SFT trained on the answers the preference set calls chosen: the adapter prefers them, the base cannot
    assert results["tuned"]["preference_accuracy"] >= 0.75 > results["base"]["preference_accuracy"]
    assert set(results["tuned"]) == {"preference_accuracy", "exact_match"}
    harness = events[-1]["summary"]["harness"]["studio_same_choices"]
    assert harness["acc"] == pytest.approx(3 / 8) and harness["samples"] == 8

    # a LoRA run (its adapter switched off for the base), stopped after its first answer: what was
    # scored is saved, the process ends, the core is free
    evaluation = EvalProcess.start(EvalRequest(ids["lora"], max_new_tokens=64), runs_dir, hardware)
    seen = []
    for event in evaluation.events():
        seen.append(event)
        if event["type"] == "progress" and event["done"] == 1:
            evaluation.stop()
    done = seen[-1]
    assert done["type"] == "done" and done["summary"]["stopped"]
    assert done["summary"]["rows"] < done["summary"]["of_rows"]
    assert len(read_rows_file(done["dir"])) == done["summary"]["rows"]
    assert evaluation.proc.poll() is not None
    assert leases.holders(runs_dir, "cpu", hardware.cores) == {}


def test_a_grpo_run_is_scored_under_its_own_rewards(grpo_runs, tmp_path):
    manager = grpo_runs.copy_to(tmp_path / "runs", "lora")
    run_id = grpo_runs.ids["lora"]
    spec = RunSpec.load(manager.runs_dir / run_id / "spec.yaml")
    evaluation = EvalProcess.start(EvalRequest(run_id, limit=4, max_new_tokens=16), manager.runs_dir, cpu_hardware())
    done = list(evaluation.events())[-1]
    summary = done["summary"]
    assert {"mean_reward", "reward/length", "reward/exact_match"} <= set(summary["results"]["tuned"])
    assert "mean_reward" in summary["results"]["base"]
    # the same functions, called here on the saved answers, give the saved scores
    rows = read_rows_file(done["dir"])
    funcs, weights = reward_functions(spec.rewards)
    prompts = [json.loads(line) for line in BUILTIN_DATASETS["builtin:prompts"].read_text().splitlines()][:4]
    for side in ("tuned", "base"):
        completions = [[{"role": "assistant", "content": row[side]["answer"]}] for row in rows]
        values = [func(prompts=[p["prompt"] for p in prompts], completions=completions,
                       reference=[p["reference"] for p in prompts]) for func in funcs]
        for index, row in enumerate(rows):
            expected = sum(w * v[index] for w, v in zip(weights, values))
            assert row[side]["scores"]["mean_reward"] == pytest.approx(expected)


def test_a_held_out_fraction_is_evaluated_in_training_and_after_on_the_same_rows(tmp_path):
    from studio_core.training.forecast import forecast_in_subprocess
    from studio_core.runs.manager import RunManager

    manager = RunManager(tmp_path / "runs")
    spec = RunSpec.load(RECIPES / "tiny-sft.yaml").with_overrides(["max_steps=20", "studio.eval_fraction=0.25"])
    launch = manager.plan(spec, cpu_hardware())
    assert ("eval_strategy", "steps") in [(key, value) for key, value, _ in launch.applied]
    predicted = forecast_in_subprocess(launch.spec, "cpu")
    run = manager.start(spec, cpu_hardware())
    view = manager.wait(run.id)
    assert view.live_state == "finished"
    evaluated = [m for m in view.metrics if "eval_loss" in m]
    assert len(evaluated) == 10  # eval_steps 0.1: ten evaluations over the run
    observed = {tuple(event["shape"]) for event in view.shapes}
    assert predicted.eval_batches == 1 and {tuple(s[:2]) for s in predicted.eval_shapes} <= observed

    # the default evaluation set is the held-out rows: the ones training evaluated on, not trained on
    evaluation = EvalProcess.start(EvalRequest(run.id, metrics=("eval_loss",), max_new_tokens=8), manager.runs_dir,
                                   cpu_hardware())
    done = list(evaluation.events())[-1]
    assert done["summary"]["rows"] == 3 and "did not train on" in done["summary"]["note"]
    held = {row["prompt"][-1]["content"] for row in read_rows_file(done["dir"])}
    assert held <= set(questions()) and len(held) == 3
    from datasets import load_dataset  # the rows datasets itself holds out of the file with this seed

    rows = load_dataset("json", data_files=str(BUILTIN_DATASETS["builtin:qa"]), split="train")
    test = rows.train_test_split(test_size=0.25, seed=42)["test"]
    assert held == {row["messages"][0]["content"] for row in test}


@pytest.mark.fast
def test_the_card_carries_every_evaluation_and_lm_evals_scores():
    from studio_core.export.export import _evaluations_text, eval_results

    older = {"time": 1_790_000_000, "data": "builtin:qa", "split": "train", "rows": 12, "max_new_tokens": 32,
             "results": {"tuned": {"exact_match": 0.5, "rouge_l": 0.7}, "base": {"exact_match": 0.0}}}
    newer = {**older, "time": 1_790_100_000, "results": {"tuned": {"exact_match": 1.0}, "base": {"exact_match": 0.0}},
             "harness": {"studio_qa": {"acc": 0.75, "acc_stderr": 0.1, "samples": 4}}}
    text = _evaluations_text([newer, older])
    assert text.index("2026-09-22") < text.index("2026-09-21 14:13 UTC")  # newest first, each with its date
    assert "| exact_match | 1 | 0 |" in text and "| rouge_l | 0.7 |" in text  # both evaluations' tables
    assert "| studio_qa | acc | 0.75 |" in text
    results = {(r.dataset_name, r.metric_type): (r.metric_value, r.source_name)
               for r in eval_results([newer, older], "text-generation")}
    assert results == {("builtin:qa", "exact_match"): (1.0, None), ("builtin:qa", "rouge_l"): (0.7, None),
                       ("studio_qa", "acc"): (0.75, "lm-evaluation-harness")}  # the newest of each, no stderr


@pytest.mark.fast
def test_models_evaluated_from_the_cli_are_offered_with_their_evaluations(tmp_path):
    from app.eval_tab import download_folder, targets
    from studio_core.evaluate.evaluation import evaluated_models, evaluations_of
    from studio_core.runs.manager import RunManager

    manager = RunManager(tmp_path / "runs")
    for stamp, target in (("20261201-101010", "builtin:tiny-qwen3"), ("20261202-090000", "org/model"),
                          ("20261202-100000", "builtin:tiny-qwen3")):
        out = manager.runs_dir / "evals" / f"{stamp}-{target.replace(':', '-').replace('/', '-')}"
        out.mkdir(parents=True)  # what launch.py eval writes for a model that is not a run
        (out / "summary.json").write_text(json.dumps({"target": target, "data": "builtin:qa", "rows": 1}))
        (out / "rows.jsonl").write_text("{}\n")
    assert evaluated_models(manager.runs_dir) == ["builtin:tiny-qwen3", "org/model"]  # newest first
    assert [Path(s["dir"]).name[:15] for s in evaluations_of("builtin:tiny-qwen3", manager.runs_dir)] == [
        "20261202-100000", "20261201-101010"]
    assert ("org/model (a model, not a run)", "org/model") in targets(manager)

    stale = manager.runs_dir / "exports" / "eval-downloads" / "left-by-a-killed-app.jsonl"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("{}\n")
    assert not download_folder(manager.runs_dir).exists()  # a new app starts with none
