"""Issue 49, items 1 and 3: a second vision-language family through the studio, on the CPU. An
Idefics3 (the architecture of SmolVLM-256M-Instruct and SmolVLM-500M-Instruct) built offline from
a config, with random weights, laid out as the Hub has one: its processor tiles each image by its
size, so images of two shapes give two sequence lengths, and `studio.image_size` makes them one.
A run of it at that size trains, and `launch.py chat --image` answers as plain Transformers
answers from the run's export, given the image resized as the card says. Its processor needs no
torchvision (Qwen-VL's and SmolVLM2's do: tests/test_vlm_image_size.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import launch_py
from studio_core.data.builtin_vlm import VLM_CHAT_TEMPLATE
from studio_core.recipe.spec import RunSpec

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny-vlm-sft.yaml"
QUESTION, ANSWER = "What is in the picture?", "A red circle."
TILE = 32  # pixels a side of the vision tower's input: each tile is (32 / 4)^2 / 2^2 = 16 image tokens


def build_idefics3(folder: Path) -> Path:
    """A tiny Idefics3: a 2-layer SigLIP-like tower on 32-pixel tiles of 4-pixel patches, pixel
    shuffle by 2 (16 tokens a tile), a 2-layer Llama, the tiny text model's tokenizer with ChatML
    that writes <image> for each image part; the processor cuts an image into 32-pixel tiles after
    resizing its longest side to 64, plus one whole-image tile."""
    import torch
    from transformers import AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from studio_core.data.builtin import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    images = Idefics3ImageProcessorPil(size={"longest_edge": 2 * TILE}, max_image_size={"longest_edge": TILE},
                                       do_image_splitting=True, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=16,
                                  chat_template=VLM_CHAT_TEMPLATE)  # adds its image tokens to the tokenizer
    ids = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.pad_token_id,
           "eos_token_id": tokenizer.eos_token_id}
    config = Idefics3Config(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": TILE, "patch_size": 4},
        text_config={"model_type": "llama", "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, **ids},
        scale_factor=2, image_token_id=processor.image_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Idefics3ForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def two_shapes_of_pictures(folder: Path) -> Path:
    """A JSONL of 8 rows, one question and answer, each with a picture: half square, half twice as
    wide as high (the only difference between rows, so any two lengths are the images')."""
    from PIL import Image, ImageDraw

    (folder / "pics").mkdir(parents=True)
    rows = []
    for n in range(8):
        size = (40, 40) if n % 2 else (80, 40)
        image = Image.new("RGB", size, (240, 240, 240))
        ImageDraw.Draw(image).ellipse((4, 4, 36, 36), fill=(220, 30, 30))
        image.save(folder / "pics" / f"{n}.png")
        rows.append({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                                  {"role": "assistant", "content": ANSWER}], "images": [f"pics/{n}.png"]})
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    """(the model folder, the data file)."""
    root = tmp_path_factory.mktemp("idefics3")
    return build_idefics3(root / "model"), two_shapes_of_pictures(root / "data")


def spec_of(model: Path, data: Path, *more: str) -> RunSpec:
    return RunSpec.load(RECIPE).with_overrides([f"model_name_or_path={model}", f"dataset_name={data}",
                                                "max_length=null", "per_device_train_batch_size=1", *more])


def test_its_tiles_make_a_length_for_each_image_shape_until_image_size_makes_one(idefics3, tmp_path):
    from studio_core.data import sources
    from studio_core.machine.hardware import cpu_hardware, instance_hardware
    from studio_core.recipe.validate import validate
    from studio_core.runs.manager import RunManager
    from studio_core.training.forecast import forecast
    from studio_core.training.plan import plan

    model, data = idefics3
    assert sources.is_vision_model(str(model)) and validate(spec_of(model, data)) == []
    manager = RunManager(tmp_path / "runs")
    as_is = forecast(manager.plan(spec_of(model, data, "max_steps=8"), cpu_hardware()).spec, "cpu")
    sized = forecast(manager.plan(spec_of(model, data, "max_steps=8", f"studio.image_size={TILE}"),
                                  cpu_hardware()).spec, "cpu")
    assert len(set(as_is.lengths)) == 2 and len(set(sized.lengths)) == 1, (as_is.lengths, sized.lengths)
    assert len(as_is.shapes) == 2 and len(sized.shapes) == 1
    warnings = plan(spec_of(model, data), instance_hardware("trn2.3xlarge"),
                    model_config=sources.model_config(str(model))).warnings
    assert any(w.startswith("studio.image_size: Idefics3's processor") for w in warnings)


def test_a_run_at_one_image_size_trains_and_chats_as_plain_transformers_answers_from_its_export(idefics3, tmp_path):
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model, data = idefics3
    runs, picture = tmp_path / "runs", data.parent / "pics" / "0.png"  # a wide one: resized to a square
    recipe = tmp_path / "idefics3.yaml"
    spec_of(model, data, "max_steps=40", f"studio.image_size={TILE}", "logging_steps=10").save(recipe)
    done = launch_py("train", str(recipe), "--runs-dir", str(runs), timeout=600)
    assert done.returncode == 0 and "finished (exit code 0)" in done.stdout, done.stdout + done.stderr
    run_id = next(p.name for p in runs.iterdir() if p.is_dir() and not p.name.startswith("."))
    chat = launch_py("chat", run_id, "--image", str(picture), "--prompt", QUESTION, "--max-new-tokens", "4",
                     "--runs-dir", str(runs))
    assert chat.returncode == 0, chat.stderr
    exported = launch_py("export", run_id, "--out", str(tmp_path / "export"), "--runs-dir", str(runs))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    folder = tmp_path / "export"
    assert f".resize(({TILE}, {TILE}))" in (folder / "README.md").read_text()
    plain, processor = AutoModelForImageTextToText.from_pretrained(folder), AutoProcessor.from_pretrained(folder)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    inputs = processor(text=processor.apply_chat_template(messages, add_generation_prompt=True),
                       images=[Image.open(picture).convert("RGB").resize((TILE, TILE))], return_tensors="pt")
    with torch.no_grad():
        out = plain.generate(**inputs, max_new_tokens=4, do_sample=False)
    expected = processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    assert chat.stdout.strip() == expected and expected, (chat.stdout, expected)
    assert ANSWER.startswith(expected), expected  # learnt (every row answers so), not near-tied noise


def test_a_max_length_that_cuts_into_the_images_is_named_by_the_forecast(idefics3, tmp_path):
    """Each picture here is 5 tiles of 16 image tokens and their tags: a max_length of 60 cuts into
    them. Idefics3's processor then fails with a TypeError (LLaVA's with "Mismatch in `image` token
    count"), and the run would stop at its first batch: the forecast says which max_length holds them."""
    from studio_core.machine.hardware import cpu_hardware
    from studio_core.recipe.spec import SpecError
    from studio_core.runs.manager import RunManager
    from studio_core.training.forecast import forecast_in_subprocess

    model, data = idefics3
    spec = RunManager(tmp_path / "runs").plan(spec_of(model, data, "max_steps=2", "max_length=60"), cpu_hardware()).spec
    with pytest.raises(SpecError) as refused:
        forecast_in_subprocess(spec, "cpu")
    [problem] = refused.value.problems
    assert problem.startswith("shape forecast: max_length: 60 cuts into the image tokens of 8 of 8 samples"), problem
    least = int(problem.split("set max_length to at least ")[1].split()[0])
    held = forecast_in_subprocess(spec.with_overrides([f"max_length={least + 16}"]), "cpu")  # room for the text
    assert held.micro_batches == 2
