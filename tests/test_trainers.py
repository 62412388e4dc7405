"""Each trainer, full and LoRA, trains the tiny model end to end through the run manager."""

import json
import time
from pathlib import Path

import pytest

from studio_core.hardware import cpu_hardware
from studio_core.runs import RunManager
from studio_core.spec import RunSpec
from studio_core.worker import OUTPUT_INFO

RECIPES = Path(__file__).parent.parent / "recipes"
STEPS = {"sft": 20, "dpo": 10, "grpo": 4}
# What each trainer logs besides the loss (TRL's own metric names)
TRAINER_METRIC = {"sft": "mean_token_accuracy", "dpo": "rewards/margins", "grpo": "reward"}


def wait_final(manager, run_id, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        view = manager.view(run_id)
        if view.live_state in ("finished", "failed", "stopped"):
            return view
        time.sleep(0.5)
    raise TimeoutError(f"run {run_id} did not end in {timeout} s")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("trainer", ["sft", "dpo", "grpo"])
def test_trainer_runs_end_to_end(trainer, lora, tmp_path):
    recipe = RECIPES / f"tiny-{trainer}{'-lora' if lora else ''}.yaml"
    spec = RunSpec.load(recipe).with_overrides([f"max_steps={STEPS[trainer]}", "logging_steps=2"])
    manager = RunManager(tmp_path / "runs")
    view = wait_final(manager, manager.start(spec, cpu_hardware()).id)
    assert view.live_state == "finished", view.error_text
    assert view.step == STEPS[trainer]
    logged = set().union(*(m.keys() for m in view.metrics))
    assert "loss" in logged and TRAINER_METRIC[trainer] in logged, logged
    if trainer == "grpo":  # one reward entry per reward function, by its name
        assert {"rewards/length/mean", "rewards/exact_match/mean"} <= logged, logged

    output = view.dir / "output"
    info = json.loads((output / OUTPUT_INFO).read_text())
    assert info == {"kind": "adapter" if lora else "full", "trainer": trainer,
                    "base_model": "builtin:tiny-qwen3", "base_model_path": info["base_model_path"]}
    if lora:
        from peft import AutoPeftModelForCausalLM

        assert (output / "adapter_config.json").exists() and not (output / "config.json").exists()
        model = AutoPeftModelForCausalLM.from_pretrained(output)
        assert model.peft_config["default"].r == 16
    else:
        from transformers import AutoModelForCausalLM

        assert not (output / "adapter_config.json").exists()
        assert AutoModelForCausalLM.from_pretrained(output).config.model_type == "qwen3"
