"""Issue 49, the model side of vision-language fine-tuning: the built-in tiny VLM (a LLaVA built
offline from a config) loads with plain Transformers, the studio knows its shape without building
it, its folder passes the model check as a VLM (AutoModelForImageTextToText on the meta device,
its processor through AutoProcessor), a damaged one is refused saying what to change, and the
memory estimate counts its vision tower.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from studio_core.data import sources
from studio_core.data.builtin_vlm import BUILTIN_VLM, TINY_VLM_CONFIG, VLM_IMAGE_TOKENS, ensure_tiny_vlm
from studio_core.machine.hardware import cpu_hardware
from studio_core.recipe.spec import RunSpec
from studio_core.training import memory

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny-vlm-sft.yaml"


def copied(tmp_path: Path) -> Path:
    folder = tmp_path / "vlm"
    shutil.copytree(ensure_tiny_vlm(), folder)
    return folder


def test_the_built_in_vlm_loads_with_plain_transformers_and_answers_about_an_image():
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = ensure_tiny_vlm()
    model = AutoModelForImageTextToText.from_pretrained(folder)
    processor = AutoProcessor.from_pretrained(folder)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What shape is this?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=prompt, images=[Image.new("RGB", (50, 40), (200, 30, 30))], return_tensors="pt")
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert int((inputs["input_ids"] == image_token).sum()) == VLM_IMAGE_TOKENS  # any image size: the same count
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]


def test_the_shape_the_studio_knows_is_the_built_models():
    built = json.loads((ensure_tiny_vlm() / "config.json").read_text())
    for section in ("text_config", "vision_config"):
        for key, value in TINY_VLM_CONFIG[section].items():
            assert built[section][key] == value, (section, key)
    assert built["architectures"] == TINY_VLM_CONFIG["architectures"]
    assert sources.model_config(BUILTIN_VLM) is TINY_VLM_CONFIG  # no build in the web app's process


def test_a_vlm_folder_passes_the_model_check_and_its_damage_is_named(tmp_path):
    assert sources.check_model(BUILTIN_VLM) == []
    assert sources.check_model(str(ensure_tiny_vlm())) == []
    no_processor = copied(tmp_path / "a")
    for name in ("processor_config.json", "preprocessor_config.json"):
        (no_processor / name).unlink(missing_ok=True)
    [message] = sources.check_model(str(no_processor))
    assert "its processor" in message and "processor.save_pretrained" in message, message
    wider = copied(tmp_path / "b")
    config = json.loads((wider / "config.json").read_text())
    config["vision_config"]["hidden_size"] = 96
    (wider / "config.json").write_text(json.dumps(config))
    [message] = sources.check_model(str(wider))
    assert "its weights do not fit its config.json" in message and "the config makes it [64, 96]" in message, message


@pytest.mark.fast
def test_a_generation_model_without_a_vision_tower_is_still_refused(tmp_path):
    folder = tmp_path / "t5"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["T5ForConditionalGeneration"],
                                                    "model_type": "t5"}))
    [message] = sources.check_model(str(folder))
    assert "not a causal language model" in message and "vision-language" in message


@pytest.mark.fast
def test_the_memory_estimate_counts_the_vision_tower_and_its_activations():
    spec = RunSpec.load(RECIPE)
    vlm = memory.estimate("sft", spec.layout, spec.args, cpu_hardware(), TINY_VLM_CONFIG)
    assert {"vision tower and projector", "their gradients and optimizer state", "vision activations"} <= set(vlm.parts)
    twice = memory.estimate("sft", spec.layout, {**spec.args, "per_device_train_batch_size": 32}, cpu_hardware(),
                            TINY_VLM_CONFIG)
    assert twice.parts["vision activations"] == 2 * vlm.parts["vision activations"]  # an image a sample
    lora = memory.estimate("sft", spec.layout, {**spec.args, "use_peft": True}, cpu_hardware(), TINY_VLM_CONFIG)
    assert "their gradients and optimizer state" not in lora.parts  # the tower frozen
    text = memory.estimate("sft", spec.layout, spec.args, cpu_hardware(), sources.model_config("builtin:tiny-qwen3"))
    assert not any("vision" in part for part in text.parts)


@pytest.mark.fast
def test_a_text_model_with_images_and_a_vlm_with_text_are_refused_before_launch():
    from studio_core.recipe.validate import validate

    vlm = RunSpec.load(RECIPE)
    assert validate(vlm) == []
    [message] = validate(vlm.with_overrides(["model_name_or_path=builtin:tiny-qwen3"]))
    assert "it has images (`images`), and builtin:tiny-qwen3 is a text model" in message
    [message] = validate(vlm.with_overrides(["dataset_name=builtin:qa"]))
    assert "it has no images, and builtin:tiny-vlm is a vision-language model" in message and "builtin:shapes" in message


def test_a_vlm_is_loaded_as_a_vision_model_and_what_takes_no_images_says_so_before_anything_starts(
        tmp_path):
    """Chat and evaluation load a VLM with its processor (tests/test_vlm_chat.py); lm-eval's tasks and
    vLLM take text alone so far, and say so before anything starts. The run folder is one as
    training leaves it (the built VLM's files as its saved model)."""
    from conftest import launch_py
    from studio_core.rundir import events, folder
    from studio_core.rundir.folder import OUTPUT_INFO
    from studio_core.serve import chat, vllm_server

    runs = tmp_path / "runs"
    run_id = "20250101-000000-tiny-vlm-sft-abc123"
    run_dir = runs / run_id
    shutil.copytree(ensure_tiny_vlm(), run_dir / folder.OUTPUT)
    RunSpec.load(RECIPE).save(run_dir / folder.SPEC)
    events.append_all(run_dir / folder.EVENTS, [events.status("starting"), events.status("finished", exit_code=0)])
    folder.write_json(run_dir / folder.OUTPUT / OUTPUT_INFO, {"kind": "full", "trainer": "sft", "task":
                                                              "text-generation", "base_model": BUILTIN_VLM})
    for name in (run_id, BUILTIN_VLM):
        assert chat.resolve(name, runs).vision
        with pytest.raises(chat.ChatError, match="is a vision-language model, which the studio does not hand to vLLM"):
            vllm_server.plan([name], runs, 1)
    assert not chat.resolve("builtin:tiny-qwen3", runs).vision
    assert chat.resolve(BUILTIN_VLM, runs).untrained == ("tuned",)  # random weights, said as the text one's are
    done = launch_py("eval", run_id, "--lm-eval-tasks", "hellaswag", "--runs-dir", str(runs), timeout=120)
    assert done.returncode != 0 and "is a vision-language model, and lm-eval's tasks take a text model" in \
        done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert not (run_dir / "eval").exists()


@pytest.mark.fast
def test_dpo_and_kto_of_a_vlm_do_not_pad_to_a_multiple_which_their_vision_collators_refuse():
    """TRL's DPO and KTO collators of vision data raise NotImplementedError at the first batch when
    pad_to_multiple_of is set, as "auto" sets it on Neuron: the plan makes it null there and says
    why; a number is refused on any backend. SFT of a VLM (messages rows) keeps Neuron's padding."""
    from studio_core.machine.hardware import instance_hardware
    from studio_core.training.plan import plan

    trn2 = instance_hardware("trn2.3xlarge")
    for trainer in ("dpo", "kto"):
        spec = RunSpec.load(RECIPE).with_overrides([f"trainer={trainer}", "dataset_name=pairs.jsonl"])
        planned = plan(spec, trn2, model_config=TINY_VLM_CONFIG)
        [(_, value, why)] = [entry for entry in planned.applied if entry[0] == "pad_to_multiple_of"]
        assert value is None and "cannot pad to a multiple" in why and not planned.errors, planned.applied
        assert not [w for w in planned.warnings if "pad_to_multiple_of" in w]  # not told to go back to "auto"
        refused = plan(spec.with_overrides(["pad_to_multiple_of=64"]), cpu_hardware(), model_config=TINY_VLM_CONFIG)
        assert any(e.startswith("pad_to_multiple_of: 64:") and "set it to null" in e for e in refused.errors)
        text = plan(spec, trn2, model_config=json.loads((ensure_tiny_vlm() / "config.json").read_text())["text_config"])
        assert ("pad_to_multiple_of", "auto") in [entry[:2] for entry in text.applied]  # a text model pads
    sft = plan(RunSpec.load(RECIPE), trn2, model_config=TINY_VLM_CONFIG)
    assert ("pad_to_multiple_of", "auto") in [entry[:2] for entry in sft.applied] and not sft.errors


@pytest.mark.fast
def test_a_vlm_sft_whose_max_length_is_no_multiple_of_its_padding_is_refused_before_launch():
    """SFT's vision collator has the processor truncate and pad in one call, which raises ValueError
    ("truncation length ... is not a multiple of pad_to_multiple_of") at the first batch: the plan
    refuses the pair, naming the multiples on either side, whether the multiple is the recipe's or
    Neuron's "auto" (128). A text model's SFT pads after truncating and takes any max_length."""
    from studio_core.machine.hardware import instance_hardware
    from studio_core.training.plan import plan

    spec = RunSpec.load(RECIPE)
    [error] = plan(spec.with_overrides(["max_length=70", "pad_to_multiple_of=32"]), cpu_hardware(),
                   model_config=TINY_VLM_CONFIG).errors
    assert error.startswith("max_length: 70 is not a multiple of pad_to_multiple_of 32") and "64 or 96" in error
    [error] = plan(spec.with_overrides(["max_length=100"]), instance_hardware("trn2.3xlarge"),
                   model_config=TINY_VLM_CONFIG).errors
    assert '128 ("auto" on this backend)' in error and error.endswith("set max_length to 128")
    assert plan(spec.with_overrides(["max_length=70"]), cpu_hardware(), model_config=TINY_VLM_CONFIG).errors == []
    assert plan(spec.with_overrides(["max_length=256"]), instance_hardware("trn2.3xlarge"),
                model_config=TINY_VLM_CONFIG).errors == []
    text = json.loads((ensure_tiny_vlm() / "config.json").read_text())["text_config"]
    assert plan(spec.with_overrides(["max_length=70", "pad_to_multiple_of=32"]), cpu_hardware(),
                model_config=text).errors == []


@pytest.mark.fast
def test_a_max_length_that_cannot_hold_an_image_is_refused_before_launch():
    """The built-in LLaVA reads each image as 64 tokens (its config's image_seq_length): a max_length
    of 32 would cut every sample inside its image, and the processor stops the run at the first batch
    ("Mismatch in `image` token count"). The plan refuses it; the recipe's 128 passes."""
    from studio_core.training.plan import plan

    spec = RunSpec.load(RECIPE)
    [error] = plan(spec.with_overrides(["max_length=32"]), cpu_hardware(), model_config=TINY_VLM_CONFIG).errors
    assert error.startswith("max_length: 32 tokens cannot hold an image, which this model reads as 64 tokens")
    assert plan(spec, cpu_hardware(), model_config=TINY_VLM_CONFIG).errors == []
    assert plan(spec.with_overrides(["max_length=null"]), cpu_hardware(), model_config=TINY_VLM_CONFIG).errors == []
