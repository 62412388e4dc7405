"""Issue 49: exporting a vision-language run. Real tiny-VLM runs (the recipe, through RunManager)
are exported, and the exports are loaded with plain Transformers (AutoModelForImageTextToText and
AutoProcessor): a full run's export answers the held-out shapes images token for token as the
run's own saved model does, its card is an image-text-to-text card whose example code runs, and a
LoRA run merges into a full model that answers as its adapter on the base does.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import shutil
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from studio_core.data.builtin_images import ensure_shapes_dataset
from studio_core.data.builtin_vlm import ensure_tiny_vlm
from studio_core.export.export import card_for_repo, export_run


@functools.cache
def held_out() -> list[dict]:
    """Four rows of builtin:shapes' test split (made on first use: not while the tests are collected)."""
    return [json.loads(line) for line in (ensure_shapes_dataset() / "test.jsonl").read_text().splitlines()[:4]]


@pytest.fixture(scope="module")
def vlm_runs(vlm_runs, tmp_path_factory):
    """The session's runs of the tiny VLM (conftest.vlm_runs: a full run long enough to name colours
    and shapes, and a short LoRA run), copied here: (their run manager, their ids)."""
    return vlm_runs.copy_to(tmp_path_factory.mktemp("vlm-export") / "runs"), vlm_runs.ids


def load(folder):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return AutoModelForImageTextToText.from_pretrained(folder), AutoProcessor.from_pretrained(folder)


def greedy(model, processor, row) -> list[int]:
    """The new tokens the model gives the row's question about its image, greedily."""
    import torch
    from PIL import Image

    prompt = processor.apply_chat_template(row["messages"][:1], add_generation_prompt=True)
    inputs = processor(text=prompt, images=[Image.open(ensure_shapes_dataset() / row["images"][0])], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_a_vlm_export_answers_held_out_images_exactly_as_the_runs_own_model(vlm_runs, tmp_path):
    manager, ids = vlm_runs
    run_dir = manager.runs_dir / ids["full"]
    folder = Path(export_run(run_dir, tmp_path / "full")["folder"])
    assert {"model.safetensors", "config.json", "processor_config.json", "tokenizer.json", "chat_template.jinja",
            "README.md"} <= {p.name for p in folder.iterdir()}
    assert not (folder / "training_args.bin").exists()
    assert json.loads((folder / "studio_output.json").read_text())["kind"] == "full"
    exported, trained = load(folder), load(run_dir / "output")
    answers = [greedy(*exported, row) for row in held_out()]
    assert answers == [greedy(*trained, row) for row in held_out()]
    said = [exported[1].decode(a, skip_special_tokens=True).strip() for a in answers]
    assert all(re.search("red|green|blue", text) for text in said), said  # learnt answers, not noise

    card = ModelCard.load(folder / "README.md")
    assert card.data.pipeline_tag == "image-text-to-text" and card.data.library_name == "transformers"
    code = re.search(r"```python\n(.*?)```", card_for_repo(card.content, str(folder)), re.S).group(1)
    assert "AutoModelForCausalLM" not in code and '{"type": "image"}' in code
    image = ensure_shapes_dataset() / held_out()[0]["images"][0]
    scope, printed = {}, io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code.replace('"your-image.png"', repr(str(image))), scope)  # the card's example, as a reader runs it
    assert type(scope["model"]).__name__ == "LlavaForConditionalGeneration"
    assert printed.getvalue().strip().startswith(said[0])  # 64 new tokens, the first 8 as above


def test_a_lora_vlm_run_exports_merged_into_a_full_model(vlm_runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    manager, ids = vlm_runs
    run_dir = manager.runs_dir / ids["lora"]
    folder = Path(export_run(run_dir, tmp_path / "merged", merge=True)["folder"])
    names = {p.name for p in folder.iterdir()}
    assert "model.safetensors" in names and "processor_config.json" in names
    assert not {"adapter_config.json", "adapter_model.safetensors"} & names
    assert json.loads((folder / "studio_output.json").read_text()) == {
        "kind": "merged", "trainer": "sft", "task": "text-generation", "base_model": "builtin:tiny-vlm"}
    assert ModelCard.load(folder / "README.md").data.pipeline_tag == "image-text-to-text"
    merged, processor = load(folder)
    adapted = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(ensure_tiny_vlm()),
                                        run_dir / "output")
    assert [greedy(merged, processor, row) for row in held_out()[:2]] == \
        [greedy(adapted, processor, row) for row in held_out()[:2]]


def test_a_pushed_vlm_export_downloads_and_answers_as_the_export(vlm_runs, tmp_path, monkeypatch):
    """The export pushed to a stand-in Hub (the real huggingface_hub client) comes back whole: the
    downloaded repo loads with plain Transformers and answers an image as the export does."""
    from huggingface_hub import snapshot_download

    from hub_standin import HubStandIn, point_hub_client_at, use_hub_cache
    from studio_core.export import hub

    token = "hf_alice_vlm_push_0123456789"
    manager, ids = vlm_runs
    folder = Path(export_run(manager.runs_dir / ids["full"], tmp_path / "full")["folder"])
    with HubStandIn(tokens={token: {"user": "alice", "orgs": []}}) as standin:
        point_hub_client_at(standin, monkeypatch)
        use_hub_cache(tmp_path / "hub-cache", monkeypatch)
        hub.push(folder, "alice/tiny-vlm-shapes", token, "the token")
        card = standin.repos["alice/tiny-vlm-shapes"]["files"]["README.md"].decode()
        pulled = Path(snapshot_download("alice/tiny-vlm-shapes", token=token))
    assert 'repo_id = "alice/tiny-vlm-shapes"\nmodel = AutoModelForImageTextToText.from_pretrained(repo_id)' in card
    assert (pulled / "processor_config.json").read_bytes() == (folder / "processor_config.json").read_bytes()
    assert greedy(*load(pulled), held_out()[0]) == greedy(*load(folder), held_out()[0])


def test_a_run_trained_at_an_image_size_exports_a_card_whose_example_resizes_the_same_way(vlm_runs, tmp_path):
    """studio.image_size: the card says the size, and its example code resizes the reader's image
    to it, as training did. The run trained at 32, the shapes' own size (the spec says so here:
    resizing 32x32 images to 32x32 is the training the session's run had)."""
    from studio_core.recipe.spec import RunSpec
    from studio_core.rundir import folder as run_folder

    manager, ids = vlm_runs
    run_dir = manager.runs_dir / ids["full"]
    sized = tmp_path / "runs" / run_dir.name
    shutil.copytree(run_dir, sized)
    RunSpec.load(sized / run_folder.SPEC).with_overrides(["studio.image_size=32"]).save(sized / run_folder.SPEC)
    folder = Path(export_run(sized, tmp_path / "sized")["folder"])
    card = card_for_repo(ModelCard.load(folder / "README.md").content, str(folder))
    assert "trained on images resized to 32x32 pixels" in card
    code = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    assert '.convert("RGB").resize((32, 32))' in code
    image = ensure_shapes_dataset() / held_out()[0]["images"][0]
    scope, printed = {}, io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code.replace('"your-image.png"', repr(str(image))), scope)
    model, processor = load(folder)
    assert printed.getvalue().strip().startswith(
        processor.decode(greedy(model, processor, held_out()[0]), skip_special_tokens=True).strip())
