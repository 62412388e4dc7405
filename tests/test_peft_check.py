"""Tests for the LoRA settings check (studio_core.recipe.peft_check): each bad value gives its message,
good values none, and every value is put through real TRL and PEFT on a tiny Qwen3 model, the
way the worker builds the adapter (ModelConfig -> trl.get_peft_config -> peft.get_peft_model),
so the check can neither refuse what PEFT trains as written nor pass what it would not."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from studio_core.recipe.peft_check import ALL_LINEAR, TASK_TYPES, peft_problems

pytestmark = pytest.mark.fast  # starts no run, torchrun, browser or app: in `pytest -m fast`

# What real PEFT does with a value the check refuses:
REFUSED = "refused"  # TRL's ModelConfig or PEFT's LoraConfig raises when the config is made
FAILS = "fails"  # peft.get_peft_model or the first training step raises: a traceback mid-launch
LEARNS_NOTHING = "learns nothing"  # it runs, but the adapter gets no gradient
RUNS_OTHERWISE = "runs otherwise"  # it runs, as a different adapter from the one meant (`meant`)

# (settings, a part of the one message, what PEFT does, what the user meant)
BAD = [
    ({"lora_r": 0}, "lora_r: 0 is not a LoRA rank: use a whole number of at least 1, e.g. 16", FAILS, None),
    ({"lora_r": -8}, "lora_r: -8 is not a LoRA rank", FAILS, None),
    ({"lora_r": 8.0}, "lora_r: 8.0 is not a LoRA rank", FAILS, None),
    ({"lora_r": "8"}, "lora_r: '8' is not a LoRA rank", FAILS, None),
    ({"lora_r": True}, "lora_r: True is not a LoRA rank", FAILS, None),
    ({"lora_alpha": 0}, "lora_alpha: 0 scales the adapter's output to nothing, so it would not learn: use a number "
     "above 0, e.g. 32", LEARNS_NOTHING, None),
    ({"lora_alpha": -16, "lora_r": 8}, "lora_alpha: -16 is not a LoRA scale: use a number above 0, e.g. 16",
     RUNS_OTHERWISE, {"lora_alpha": 16, "lora_r": 8}),  # the adapter's output has the other sign
    ({"lora_alpha": "32"}, "lora_alpha: '32' is not a LoRA scale", FAILS, None),
    ({"lora_dropout": -0.1}, "lora_dropout: -0.1 is not a dropout probability: use a number from 0 up to (not "
     "including) 1, e.g. 0.05", RUNS_OTHERWISE, {"lora_dropout": 0.1}),  # PEFT drops nothing
    ({"lora_dropout": 1.0}, "lora_dropout: 1.0 drops every input of the adapter, so it would not learn",
     LEARNS_NOTHING, None),
    ({"lora_dropout": 1.5}, "lora_dropout: 1.5 is not a dropout probability", FAILS, None),
    ({"lora_dropout": "0.1"}, "lora_dropout: '0.1' is not a dropout probability", FAILS, None),
    ({"lora_target_modules": []}, "lora_target_modules: [] names no module", FAILS, None),
    ({"lora_target_modules": ""}, "lora_target_modules: '' names no module", FAILS, None),
    ({"lora_target_modules": [1]}, "lora_target_modules: [1] is not a module name or a list of them", FAILS, None),
    ({"lora_target_modules": 5}, "lora_target_modules: 5 is not a module name", FAILS, None),
    ({"lora_target_modules": {"q_proj": 1}}, "lora_target_modules: {'q_proj': 1} is not a module name", REFUSED,
     None),
    ({"lora_target_modules": ["q_proj"]}, "lora_target_modules: ['q_proj'] matches no module: one name is read as "
     "a pattern for the whole module name", FAILS, None),
    ({"lora_target_modules": ["all-linear", "q_proj"]}, "lora_target_modules: all-linear works only on its own",
     RUNS_OTHERWISE, {"lora_target_modules": ["all-linear"]}),  # PEFT adapts q_proj only
    ({"lora_target_parameters": "mlp.up_proj.weight"}, "lora_target_parameters: 'mlp.up_proj.weight' must be a "
     "list, even of one name: write [mlp.up_proj.weight]", REFUSED, None),
    ({"lora_modules_to_save": "lm_head"}, "lora_modules_to_save: 'lm_head' must be a list, even of one name: "
     "write [lm_head]", RUNS_OTHERWISE, {"lora_modules_to_save": ["lm_head"]}),  # trains norms and more
    ({"lora_modules_to_save": [3]}, "lora_modules_to_save: [3] is not a list of names", FAILS, None),
    ({"lora_task_type": "causal_lm"}, "lora_task_type: 'causal_lm' is not one of PEFT's task types", REFUSED, None),
    ({"lora_task_type": "chat"}, "use CAUSAL_LM (SEQ_CLS for a reward model)", REFUSED, None),
    ({"use_rslora": "no"}, "use_rslora: 'no' is not true or false", RUNS_OTHERWISE, {"use_rslora": False}),
    ({"use_dora": "no"}, "use_dora: 'no' is not true or false (PEFT takes any text, even \"no\", as true); write "
     "true or false", RUNS_OTHERWISE, {"use_dora": False}),
]
GOOD = [
    {}, {"lora_r": 1}, {"lora_r": 64, "lora_alpha": 128}, {"lora_alpha": 16.5}, {"lora_alpha": 1},
    {"lora_dropout": 0}, {"lora_dropout": 0.0}, {"lora_dropout": 0.99},
    {"lora_target_modules": None}, {"lora_target_modules": ["all-linear"]}, {"lora_target_modules": "ALL-LINEAR"},
    {"lora_target_modules": ["q_proj", "v_proj"]}, {"lora_target_modules": [r".*\.q_proj"]},
    {"lora_target_modules": ["lm_head"]}, {"lora_target_parameters": []},
    {"lora_modules_to_save": ["lm_head"]}, {"lora_modules_to_save": []},
    {"lora_task_type": "CAUSAL_LM"}, {"lora_task_type": "SEQ_CLS"}, {"lora_task_type": None},
    {"use_rslora": True}, {"use_dora": True}, {"use_dora": False},
]


def ids(cases):
    return [",".join(f"{k}={v!r}" for k, v in case.items()) or "defaults" for case in cases]


@pytest.mark.parametrize(("settings", "message", "outcome", "meant"), BAD, ids=ids([b[0] for b in BAD]))
def test_each_bad_value_says_what_to_write(settings, message, outcome, meant):
    (problem,) = peft_problems({"use_peft": True, **settings})
    assert message in problem
    assert problem.startswith(f"{next(iter(settings))}: ")


@pytest.mark.parametrize("settings", GOOD, ids=ids(GOOD))
def test_good_values_pass(settings):
    assert peft_problems({"use_peft": True, **settings}) == []


def test_nothing_is_checked_without_peft():
    assert peft_problems({"lora_r": 0, "lora_dropout": 2}) == []
    assert peft_problems({"use_peft": False, "lora_r": 0}) == []


def test_every_recipe_passes():
    recipes = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))
    assert any(yaml.safe_load(r.read_text()).get("use_peft") for r in recipes)
    for recipe in recipes:
        assert peft_problems(yaml.safe_load(recipe.read_text())) == [], recipe.name


def test_the_names_and_defaults_are_trl_and_peft_own():
    import peft
    from trl import ModelConfig

    fields = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    read = {"use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters",
            "lora_modules_to_save", "lora_task_type", "use_rslora", "use_dora"}
    assert read <= set(fields)
    assert peft_problems({key: fields[key] for key in read} | {"use_peft": True}) == []  # TRL's defaults pass
    assert TASK_TYPES == tuple(t.value for t in peft.TaskType)
    assert ALL_LINEAR == peft.utils.constants.INCLUDE_LINEAR_LAYERS_SHORTHAND


def test_import_stays_light():
    # The web app's process checks specs: the check must not pull in peft or torch.
    code = "import sys, studio_core.recipe.peft_check; print(sorted(m for m in ('peft', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent.parent)
    assert out.stdout.strip() == "[]"


# --- the same values through real TRL and PEFT ------------------------------------------------

def tiny():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=64, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=4, num_labels=1, pad_token_id=0)


def config(settings: dict):
    """The LoraConfig the worker would make (ModelConfig -> trl.get_peft_config)."""
    from trl import ModelConfig, get_peft_config

    return get_peft_config(ModelConfig(model_name_or_path="tiny", use_peft=True, **settings))


def adapted(lora_config):
    """The tiny model with the adapter on, as peft.get_peft_model puts it there."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(0)
    auto = AutoModelForSequenceClassification if lora_config.task_type == "SEQ_CLS" else AutoModelForCausalLM
    return peft.get_peft_model(auto.from_config(tiny()), lora_config)


def step(model) -> float:
    """One forward and backward pass; the gradient the adapter's B matrices get (they start at 0,
    so it is what the first step moves)."""
    import torch

    model.train()
    model(input_ids=torch.tensor([[1, 2, 3, 4, 5]])).logits.float().pow(2).mean().backward()
    return sum(float(p.grad.abs().sum()) for name, p in model.named_parameters()
               if "lora_B" in name and p.grad is not None)


def fingerprint(model) -> tuple:
    """What makes one adapter differ from another: what it trains, its scales, its dropout."""
    layers = [m for m in model.modules() if isinstance(getattr(m, "scaling", None), dict) and m.scaling]
    return (sorted(name for name, p in model.named_parameters() if p.requires_grad),
            sorted({float(s) for m in layers for s in m.scaling.values()}),
            sorted({repr(d) for m in layers for d in m.lora_dropout.values()}))


@pytest.mark.parametrize("settings", GOOD, ids=ids(GOOD))
def test_what_the_check_passes_peft_trains(settings):
    assert step(adapted(config(settings))) > 0


@pytest.mark.parametrize(("settings", "message", "outcome", "meant"), BAD, ids=ids([b[0] for b in BAD]))
def test_what_the_check_refuses_peft_refuses_fails_on_or_runs_otherwise(settings, message, outcome, meant):
    if outcome == REFUSED:
        with pytest.raises((ValueError, TypeError, KeyError)):
            config(settings)
        return
    lora_config = config(settings)  # PEFT takes the config as it is
    if outcome == FAILS:
        with pytest.raises((ValueError, TypeError, AttributeError)):
            step(adapted(lora_config))
    elif outcome == LEARNS_NOTHING:
        assert step(adapted(lora_config)) == 0
    else:
        model = adapted(lora_config)
        assert step(model) > 0 and fingerprint(model) != fingerprint(adapted(config(meant)))
