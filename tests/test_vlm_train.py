"""Issue 49: a real tiny vision-language SFT run on the CPU, from the recipe to a saved model that
plain Transformers loads: the built-in LLaVA learns builtin:shapes (its loss falls), the saved
folder holds the processor, and AutoModelForImageTextToText with AutoProcessor answers an image
with the words it learnt. The runs are the session's (conftest.vlm_runs: the recipe, 120 steps;
LoRA, 10 steps), which the VLM chat and export tests read too.
"""

from __future__ import annotations


from pathlib import Path

from studio_core.data.builtin_images import ensure_shapes_dataset

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny-vlm-sft.yaml"


def test_the_tiny_vlm_learns_the_shapes_and_its_saved_folder_answers_with_plain_transformers(vlm_runs, tmp_path):
    import json

    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    view = vlm_runs.copy_to(tmp_path / "runs", "full").view(vlm_runs.ids["full"])
    assert view.live_state == "finished" and view.spec["max_steps"] == 120, view.error_text
    losses = [m["loss"] for m in view.metrics if "loss" in m]
    assert losses[-1] < 0.6 * losses[0], losses  # 6.9 at the start: it learns the answers
    assert any(key == "ddp_find_unused_parameters" for key, _, _ in view.launch()["applied"])

    output = view.dir / "output"
    model = AutoModelForImageTextToText.from_pretrained(output)
    processor = AutoProcessor.from_pretrained(output)
    folder = ensure_shapes_dataset()
    rows = [json.loads(line) for line in (folder / "test.jsonl").read_text().splitlines()[:12]]
    words = set()
    for row in rows:
        prompt = processor.apply_chat_template(row["messages"][:1], add_generation_prompt=True)
        inputs = processor(text=prompt, images=[Image.open(folder / row["images"][0])], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
        words |= set(processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).split())
    assert words & {"red", "green", "blue"} and words & {"circle", "square", "triangle"}, words


def test_a_lora_run_of_the_tiny_vlm_adapts_every_linear_layer_and_saves_its_adapter(vlm_runs, tmp_path):
    """PEFT knows no default layers for LLaVA: without the studio's default the run failed at start."""
    view = vlm_runs.copy_to(tmp_path / "runs", "lora").view(vlm_runs.ids["lora"])
    assert view.live_state == "finished", view.error_text
    assert view.spec["lora_target_modules"] == "all-linear"
    adapter = view.dir / "output" / "adapter_model.safetensors"
    from safetensors import safe_open

    with safe_open(adapter, "pt") as weights:
        names = list(weights.keys())
    assert any("vision_tower" in name for name in names) and any("language_model" in name for name in names)


def test_the_shape_forecast_of_a_vlm_run_is_the_shapes_that_reached_its_model(vlm_runs, tmp_path):
    """The forecast walks a VLM's batches through TRL's vision collator with its processor, image
    tokens included, as the run does: the same shapes and tokens as the session's full run."""
    from studio_core.machine.hardware import cpu_hardware
    from studio_core.recipe.spec import RunSpec
    from studio_core.training.forecast import forecast

    manager = vlm_runs.copy_to(tmp_path / "runs", "full")
    view = manager.view(vlm_runs.ids["full"])
    spec = RunSpec.load(RECIPE).with_overrides(["max_steps=120", "logging_steps=10"])  # as conftest.vlm_runs
    predicted = forecast(manager.plan(spec, cpu_hardware()).spec, "cpu")
    assert {tuple(event["shape"]) for event in view.shapes} == {(b, length) for b, length, _ in predicted.shapes}
    assert predicted.micro_batches == 120 and view.tokens == predicted.real_tokens
    assert min(predicted.lengths) > 64  # each sample's 64 image tokens are counted with its text
    assert not any(s["set"].get("packing") for s in predicted.suggestions)  # TRL packs no images


def test_the_forecast_of_a_vlm_suggests_only_paddings_its_processor_takes(tmp_path):
    """A max_length of 70 trains on the CPU (no padding), and the forecast's suggestions try padding
    to 32, 64 and 128 tokens: a VLM's processor refuses a multiple that max_length is not a multiple of,
    so those are not tried (the forecast failed whole with the processor's ValueError)."""
    from studio_core.machine.hardware import cpu_hardware
    from studio_core.recipe.spec import RunSpec
    from studio_core.runs.manager import RunManager
    from studio_core.training.forecast import forecast

    spec = RunSpec.load(RECIPE).with_overrides(["max_length=70", "max_steps=4"])
    predicted = forecast(RunManager(tmp_path / "runs").plan(spec, cpu_hardware()).spec, "cpu")
    assert predicted.micro_batches == 4 and max(predicted.lengths) > 70  # the samples' own lengths, before the cut
    tried = {s["set"].get("pad_to_multiple_of") for s in predicted.suggestions}
    assert not {32, 64, 128} & tried, predicted.suggestions
