"""Every recipe is commented, and is a valid config for TRL's own CLI of its trainer."""

from pathlib import Path

import pytest
import yaml

from studio_core.recipe import data_check
from studio_core.recipe.spec import RunSpec, read_yaml
from studio_core.recipe import trainers

pytestmark = pytest.mark.fast  # starts no run, torchrun, browser or app: in `pytest -m fast`

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_every_key_is_commented(recipe):
    for number, line in enumerate(recipe.read_text().splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            assert "#" in line, f"{recipe.name}:{number} has no comment: {line!r}"


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_recipe_loads_into_trl_cli_parser(recipe, tmp_path):
    import trl  # here, not at the top: collecting the tests imports no TRL (nor torch)

    data = read_yaml(recipe.read_text())
    trainer = data.pop("studio")["trainer"]
    config_class = getattr(trl, trainers.get(trainer).config_class)
    # What `trl <trainer> --config` would read, minus the studio block. use_cpu only lets
    # this CPU build a config that asks for bf16; output_dir is the studio's to set.
    trl_config = tmp_path / "trl.yaml"
    trl_config.write_text(yaml.safe_dump({**data, "output_dir": str(tmp_path / "out"), "use_cpu": True}))
    parser = trl.TrlParser((trl.ScriptArguments, config_class, trl.ModelConfig))
    script_args, config, model_args = parser.parse_args_and_config(
        ["--config", str(trl_config)], fail_with_unknown_args=True)
    for key, value in data.items():
        holder = next(o for o in (script_args, config, model_args) if hasattr(o, key))
        got = getattr(holder, key)
        got = getattr(got, "value", got)  # TRL turns strategy strings into enums
        if value == "auto":
            continue  # TRL resolves "auto" for the device at hand (pad_to_multiple_of: 128 on Neuron)
        if key == "lora_target_modules" and value == ["all-linear"]:
            value = "all-linear"  # ModelConfig unwraps a one-element list
        assert got == value, f"{recipe.name}: {key} became {got!r}"


def test_ultrachat_recipe_keeps_only_the_chats():
    # HuggingFaceH4/ultrachat_200k (train_sft) has a string `prompt` beside `messages`: as it is,
    # TRL would read prompts; the recipe keeps `messages`, as the TorchNeuron announcement does.
    spec = RunSpec.load(RECIPES[0].parent / "qwen3-8b-sft-tp4-fsdp8.yaml")
    chat = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    record = {"prompt": "Hi.", "prompt_id": "8f2c", "messages": chat}
    assert data_check.fit_problems(data_check.detect([record]), "sft")
    kept = data_check.detect(data_check.apply_column_map([record], spec.column_map, spec.keep_columns))
    assert kept.type == "language_modeling" and data_check.fit_problems(kept, "sft") == []
