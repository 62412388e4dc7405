"""Issue 49, item 3: `studio.image_size`, every image resized to one square so that each gives the
same number of image tokens (one shape, one compile on Trainium). A real Qwen2-VL image processor
gives images of other sizes other token counts until the studio resizes them; the setting is
checked before launch, kept by the recipe and the Train form, warned about on Neuron for the
families that need it, and applied where the run's model reads an image: its training data (and
the forecast, through TRL's own collator), chat, evaluation and the exported card's example.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from studio_core.data import image_size
from studio_core.data.builtin_vlm import BUILTIN_VLM, TINY_VLM_CONFIG, ensure_tiny_vlm
from studio_core.recipe.spec import RunSpec
from studio_core.recipe.validate import validate

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
RECIPE = RECIPES / "tiny-vlm-sft.yaml"
# Qwen2.5-VL-3B-Instruct's config.json, as far as the plan reads it (its model_type and vision tower)
QWEN_VL = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
           "vision_config": {"model_type": "qwen2_5_vl", "patch_size": 14, "spatial_merge_size": 2},
           "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2, "num_hidden_layers": 36,
           "intermediate_size": 11008, "vocab_size": 151936}


def photos():
    """Three pictures of other sizes and shapes, as a dataset of photos has them."""
    from PIL import Image, ImageDraw

    made = []
    for size in ((64, 48), (300, 100), (130, 250)):
        image = Image.new("RGB", size, (20, 90, 200))
        ImageDraw.Draw(image).ellipse((5, 5, size[0] // 2, size[1] // 2), fill=(230, 40, 40))
        made.append(image)
    return made


def image_tokens(processor, image) -> int:
    """The image tokens Qwen2-VL gives an image: its grid of patches, merged 2x2."""
    grid = processor(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
    return grid[0] * grid[1] * grid[2] // processor.merge_size ** 2


@pytest.mark.fast
def test_image_size_is_checked_before_launch_and_kept_by_the_recipe_and_the_form():
    from app.train_form import form_values, spec_from_form

    sized = RunSpec.load(RECIPE).with_overrides(["studio.image_size=448"])
    assert validate(sized) == []
    assert RunSpec.from_dict(sized.to_dict()).image_size == 448 and "image_size: 448" in sized.to_yaml()
    assert spec_from_form(form_values(sized)).image_size == 448
    assert spec_from_form(form_values(RunSpec.load(RECIPE))).image_size is None  # the box's 0: the processor's own
    for bad in ("0", "-3", "12.5", "'448'", "true", "5000"):
        [message] = validate(sized.with_overrides([f"studio.image_size={bad}"]))
        assert message.startswith("studio.image_size: ") and "whole number of pixels a side" in message, bad
    [message] = validate(RunSpec.load(RECIPES / "tiny-sft.yaml").with_overrides(["studio.image_size=448"]))
    assert message.startswith("studio.image_size: the model takes text alone")


@pytest.mark.fast
def test_the_plan_for_neuron_says_when_images_of_many_sizes_make_many_shapes():
    """Qwen2.5-VL's processor keeps each image near its own size: on Neuron the plan says to set
    studio.image_size. Not once it is set, nor for a family that resizes to one square itself (the
    built-in LLaVA), nor on the CPU, where a new shape costs no compile."""
    from studio_core.machine.hardware import cpu_hardware, instance_hardware
    from studio_core.training.plan import plan

    trn2 = instance_hardware("trn2.3xlarge")
    spec = RunSpec.load(RECIPE)

    def told(spec, hardware, config):
        return [w for w in plan(spec, hardware, model_config=config).warnings if w.startswith("studio.image_size")]

    [warning] = told(spec, trn2, QWEN_VL)
    assert "Qwen2.5-VL" in warning and "set studio.image_size" in warning
    assert told(spec.with_overrides(["studio.image_size=448"]), trn2, QWEN_VL) == []
    assert told(spec, trn2, TINY_VLM_CONFIG) == [] and told(spec, cpu_hardware(), QWEN_VL) == []


def test_a_qwen_vl_processor_gives_each_size_its_own_token_count_until_the_images_are_resized():
    from datasets import Dataset
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil()  # Qwen2-VL's and Qwen2.5-VL's defaults
    assert len({image_tokens(processor, image) for image in photos()}) == 3
    dataset = Dataset.from_dict({"images": [[image] for image in photos()], "messages": [[]] * 3})
    resized = image_size.resize_dataset(dataset, 448)
    images = [row["images"][0] for row in resized]
    assert {image.size for image in images} == {(448, 448)}
    assert {image_tokens(processor, image) for image in images} == {(448 // 28) ** 2}  # 16x16 merged patches
    assert image_size.resize_dataset(dataset, None) is dataset


def test_the_run_reads_its_images_at_the_size_and_trls_collator_takes_them(tmp_path):
    """The training set as the worker loads it (train_data.load_datasets) holds the resized images,
    and the shape forecast walks them through TRL's vision collator: the run's own data path."""
    from studio_core.machine.hardware import cpu_hardware
    from studio_core.runs.manager import RunManager
    from studio_core.training.forecast import forecast
    from studio_core.training.train_data import load_datasets

    spec = RunSpec.load(RECIPE).with_overrides(["studio.image_size=24", "max_steps=3"])
    train, _ = load_datasets(spec)
    assert {image.size for row in train.select(range(8)) for image in row["images"]} == {(24, 24)}
    predicted = forecast(RunManager(tmp_path / "runs").plan(spec, cpu_hardware()).spec, "cpu")
    assert predicted.micro_batches == 3 and min(predicted.lengths) > 64  # the 64 image tokens and the text


def test_chat_and_evaluation_resize_a_runs_images_as_its_training_did(tmp_path):
    """A run's studio.image_size reaches its chat target (chat, the endpoint and evaluation load
    through it), and encode_vision resizes each image before the processor: the pixels the model
    gets are those of the resized image, not of the image as sent."""
    import base64
    import io

    import torch
    from transformers import AutoProcessor

    from studio_core.rundir import events, folder
    from studio_core.rundir.folder import OUTPUT_INFO
    from studio_core.serve import chat
    from studio_core.serve.generation import encode_vision

    runs = tmp_path / "runs"
    run_id = "20250101-000000-tiny-vlm-sft-abc123"
    run_dir = runs / run_id
    shutil.copytree(ensure_tiny_vlm(), run_dir / folder.OUTPUT)
    RunSpec.load(RECIPE).with_overrides(["studio.image_size=8"]).save(run_dir / folder.SPEC)
    events.append_all(run_dir / folder.EVENTS, [events.status("starting"), events.status("finished", exit_code=0)])
    folder.write_json(run_dir / folder.OUTPUT / OUTPUT_INFO, {"kind": "full", "trainer": "sft", "task":
                                                              "text-generation", "base_model": BUILTIN_VLM})
    assert chat.resolve(run_id, runs).image_size == 8 and chat.resolve(BUILTIN_VLM, runs).image_size is None

    processor = AutoProcessor.from_pretrained(ensure_tiny_vlm())
    photo = photos()[1]
    png = io.BytesIO()
    photo.save(png, format="PNG")
    sent = [{"role": "user", "content": [{"type": "image", "data": base64.b64encode(png.getvalue()).decode()},
                                         {"type": "text", "text": "What shape is this?"}]}]
    ids, extras = encode_vision(processor, {}, sent, image_size=8)
    plain_ids, plain = encode_vision(processor, {}, sent)
    expected = processor(images=[image_size.resize(photo, 8)], return_tensors="pt")["pixel_values"]
    assert ids == plain_ids and torch.equal(extras["pixel_values"], expected)
    assert not torch.equal(plain["pixel_values"], expected)  # 8x8 keeps less of the picture than 32x32


def tiny_qwen_vl(folder: Path) -> Path:
    """A Qwen2.5-VL folder as the Hub has one, shrunk: its config (random weights), the tiny text
    model's tokenizer with Qwen's vision tokens, and Qwen2.5-VL-3B-Instruct's preprocessor_config.json."""
    import json

    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from studio_core.data.builtin import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    vision_tokens = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": vision_tokens})
    tokenizer.save_pretrained(folder)
    start, end, image, video = tokenizer.convert_tokens_to_ids(vision_tokens)
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2,
                     "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                       "fullatt_block_indexes": [1]},
        image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}))
    return folder


def test_a_qwen_vl_folder_is_known_as_a_vlm_and_what_its_processor_lacks_is_said_before_launch(tmp_path):
    """Transformers 5 builds Qwen2.5-VL's processor with a video processor that imports torchvision,
    which the studio does not install (the package index's builds are CUDA ones): the model check
    says what to install, not "copy in the processor files". With torchvision, the folder passes.
    Either way the plan for Neuron reads the folder's own config and asks for studio.image_size."""
    import importlib.util

    from studio_core.data import sources
    from studio_core.machine.hardware import instance_hardware
    from studio_core.training.plan import plan

    folder = str(tiny_qwen_vl(tmp_path / "qwen-vl"))
    assert sources.is_vision_model(folder) and image_size.follows_image(sources.model_config(folder)) == "Qwen2.5-VL"
    found = sources.check_model(folder)
    if importlib.util.find_spec("torchvision") is None:
        [message] = found
        assert "its processor needs torchvision" in message and "pip install torchvision==0." in message
        assert "copy in the processor files" not in message
    else:
        assert found == []
    spec = RunSpec.load(RECIPE).with_overrides([f"model_name_or_path={folder}"])
    warnings = plan(spec, instance_hardware("trn2.3xlarge"), model_config=sources.model_config(folder)).warnings
    assert any(w.startswith("studio.image_size: Qwen2.5-VL's processor") for w in warnings)
