"""Each trainer of the registry trains the tiny model end to end, full and LoRA; a reward
model's output scores texts.

SFT's two recipes, as they are (300 steps), are the session's shared runs (conftest's
sft_runs, which the chat and export tests read too). The other trainers train their LoRA
recipe here, through the run manager, for a few steps; their full training is the page's
(test_browser_trainers trains each from the page, as many steps, and checks it with
`check_trained` below)."""

from pathlib import Path

import pytest

from huggingface_hub import ModelCard

from studio_core.recipe import trainers
from studio_core.export.export import export_run
from studio_core.machine.hardware import cpu_hardware
from studio_core.rundir.folder import OUTPUT_INFO, output_info
from studio_core.runs.manager import RunManager
from studio_core.recipe.spec import RunSpec

RECIPES = Path(__file__).parent.parent / "recipes"
STEPS = {"sft": 300, "dpo": 10, "kto": 10, "grpo": 2, "rloo": 2, "reward": 10}  # sft: its recipes' own
# What each trainer logs besides the loss (TRL's own metric names)
TRAINER_METRIC = {"sft": "mean_token_accuracy", "dpo": "rewards/margins", "kto": "kl", "grpo": "reward",
                  "rloo": "reward", "reward": "accuracy"}


@pytest.mark.fast
def test_every_trainer_has_a_test_and_its_recipes():
    assert set(STEPS) == set(TRAINER_METRIC) == set(trainers.TRAINERS)
    for key in trainers.TRAINERS:
        assert RunSpec.load(RECIPES / f"tiny-{key}.yaml").trainer == key
        assert RunSpec.load(RECIPES / f"tiny-{key}-lora.yaml").args["use_peft"] is True


@pytest.mark.parametrize(("trainer", "lora"), [("sft", False), *((key, True) for key in trainers.TRAINERS)],
                         ids=lambda v: {False: "full", True: "lora"}.get(v, v))
def test_trainer_runs_end_to_end(trainer, lora, tmp_path, request):
    if trainer == "sft":  # its recipes as they are: the session's shared runs of them
        shared, key = request.getfixturevalue("sft_runs"), "lora" if lora else "full"
        view = shared.copy_to(tmp_path / "runs", key).view(shared.ids[key])
    elif trainer == "grpo":  # the session's shared GRPO run (STEPS: 2), which test_eval evaluates too
        shared = request.getfixturevalue("grpo_runs")
        view = shared.copy_to(tmp_path / "runs", "lora").view(shared.ids["lora"])
    else:
        recipe = RECIPES / f"tiny-{trainer}-lora.yaml"
        spec = RunSpec.load(recipe).with_overrides([f"max_steps={STEPS[trainer]}", "logging_steps=2"])
        manager = RunManager(tmp_path / "runs")
        view = manager.wait(manager.start(spec, cpu_hardware()).id, timeout=300)
    check_trained(view, trainer, lora, tmp_path)


def check_trained(view, trainer: str, lora: bool, tmp_path: Path) -> None:
    """A finished run of `trainer`: its steps, its trainer's own metrics, and its saved model
    (a LoRA adapter or the full model; a reward model scores texts, and its export says so)."""
    assert view.live_state == "finished", view.error_text
    assert view.step == STEPS[trainer]
    logged = set().union(*(m.keys() for m in view.metrics))
    assert "loss" in logged and TRAINER_METRIC[trainer] in logged, logged
    if trainers.get(trainer).rewards:  # one reward entry per reward function, by its name
        assert {"rewards/length/mean", "rewards/exact_match/mean"} <= logged, logged

    output = view.dir / "output"
    info = output_info(view.dir)
    task = trainers.get(trainer).task
    assert info == {"kind": "adapter" if lora else "full", "trainer": trainer, "task": task,
                    "base_model": "builtin:tiny-qwen3", "base_model_path": info["base_model_path"]}
    assert (output / OUTPUT_INFO).exists()
    if task == "text-classification":  # a reward model: a sequence classifier with one score
        assert_scores(output, lora)
        exported = export_run(view.dir, tmp_path / "export")["folder"]  # and its export says what it is
        card = ModelCard.load(Path(exported) / "README.md")
        assert card.data.pipeline_tag == "text-classification" and "reward-model" in card.data.tags
        assert "A reward model: it reads a text" in card.text and "ModelForSequenceClassification" in card.text
        assert_scores(Path(exported), lora)
    elif lora:
        from peft import AutoPeftModelForCausalLM

        assert (output / "adapter_config.json").exists() and not (output / "config.json").exists()
        model = AutoPeftModelForCausalLM.from_pretrained(output)
        assert model.peft_config["default"].r == 16
    else:
        from transformers import AutoModelForCausalLM

        assert not (output / "adapter_config.json").exists()
        assert AutoModelForCausalLM.from_pretrained(output).config.model_type == "qwen3"


def assert_scores(output: Path, lora: bool) -> None:
    """The saved reward model loads as a sequence classifier and gives each text one score."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if lora:  # on its base as an exported card's code loads it: the built-in one is rebuilt, not downloaded
        from peft import PeftConfig, PeftModel

        from studio_core.data.builtin import BUILTIN_MODEL, ensure_tiny_model

        base = PeftConfig.from_pretrained(output).base_model_name_or_path
        base = ensure_tiny_model() if base == BUILTIN_MODEL else base
        model = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(base, num_labels=1), output)
        assert model.peft_config["default"].task_type == "SEQ_CLS"
    else:
        model = AutoModelForSequenceClassification.from_pretrained(output)
        assert type(model).__name__ == "Qwen3ForSequenceClassification" and model.config.num_labels == 1
    tokenizer = AutoTokenizer.from_pretrained(output)
    texts = ["The studio cat is called Pixel.", "The studio cat is called Biscuit."]
    with torch.no_grad():
        scores = model(**tokenizer(texts, return_tensors="pt", padding=True)).logits
    assert scores.shape == (2, 1) and torch.isfinite(scores).all()
