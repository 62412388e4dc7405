"""The LoRA settings of a recipe (TRL's ModelConfig names), checked before launch.

TRL hands them to PEFT as they are (trl.get_peft_config builds a peft.LoraConfig), and PEFT
checks few of them when the config is made: a bad rank or dropout fails only when the adapter
is put on the model, as a traceback in the run's log, and some values run without a word but
not as written (a single module name, `"no"` for a flag). This mirrors what PEFT rejects
(peft/tuners/lora/config.py, LoraConfig.__post_init__; the layer's own checks in
tuners/lora/layer.py), and adds the values that would run otherwise than meant, each with the
value to write instead. tests/test_peft_check.py puts every value through real PEFT.

No import of peft here: it imports torch (seconds), and this runs in the web app's process.
"""

from __future__ import annotations

import re

# peft.utils.peft_types.TaskType (PEFT checks lora_task_type against it when the config is made)
TASK_TYPES = ("SEQ_CLS", "SEQ_2_SEQ_LM", "CAUSAL_LM", "TOKEN_CLS", "QUESTION_ANS", "FEATURE_EXTRACTION")
ALL_LINEAR = "all-linear"  # PEFT's shorthand for every linear layer but the output layer
# One bare name is matched against whole module names, so it works alone only for a module at
# the model's top: the output layer of a causal LM or of a sequence classifier (reward model).
TOP_LEVEL_MODULES = ("lm_head", "score", "embed_out")


# Typed int by TRL's ModelConfig and PEFT's LoraConfig, but only ever divided by the rank
# (tuners/lora/layer.py: scaling = lora_alpha / r, or / sqrt(r) with rslora): a float is as good.
FLOAT_SCALES = ("lora_alpha",)


def accepted(key: str, field: dict) -> dict:
    """TRL's field description (trl_schema) with the kinds of value PEFT takes for it."""
    if key in FLOAT_SCALES and "float" not in field["types"]:
        return {**field, "types": [*field["types"], "float"]}
    return field


def peft_problems(args: dict) -> list[str]:
    """One message per LoRA setting PEFT would refuse, fail on, or run otherwise than written,
    each saying what to write; [] when `use_peft` is off (they are not read then)."""
    if not args.get("use_peft"):
        return []
    problems = [
        _rank(args.get("lora_r", 16)),
        _alpha(args.get("lora_alpha", 32), args.get("lora_r", 16)),
        _dropout(args.get("lora_dropout", 0.05)),
        _target_modules(args.get("lora_target_modules")),
        _names("lora_target_parameters", args.get("lora_target_parameters"), "[mlp.experts.gate_up_proj]"),
        _names("lora_modules_to_save", args.get("lora_modules_to_save"), "[lm_head]"),
        _task_type(args.get("lora_task_type", "CAUSAL_LM")),
        *(_flag(key, args[key]) for key in ("use_rslora", "use_dora") if key in args),
    ]
    return [problem for problem in problems if problem]


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rank(value) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return ""
    return f"lora_r: {value!r} is not a LoRA rank: use a whole number of at least 1, e.g. 16"


def _alpha(value, rank) -> str:
    if _is_number(value) and value > 0:
        return ""
    example = 2 * rank if not _rank(rank) else 32
    if _is_number(value) and value == 0:
        why = "0 scales the adapter's output to nothing, so it would not learn"
    else:
        why = f"{value!r} is not a LoRA scale"
    return f"lora_alpha: {why}: use a number above 0, e.g. {example} (twice lora_r is usual)"


def _dropout(value) -> str:
    if _is_number(value) and 0 <= value < 1:
        return ""
    if _is_number(value) and value == 1:
        why = f"{value!r} drops every input of the adapter, so it would not learn"
    else:
        why = f"{value!r} is not a dropout probability"
    return f"lora_dropout: {why}: use a number from 0 up to (not including) 1, e.g. 0.05"


def _target_modules(value) -> str:
    """None (PEFT's default modules for the model's type), "all-linear", a regular expression
    matched against whole module names, or a list of names matched against their ends."""
    key, fix = "lora_target_modules", "write a list of module names, e.g. [q_proj, v_proj], or [all-linear]"
    if value is None:
        return ""
    if not (isinstance(value, str) or isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return f"{key}: {value!r} is not a module name or a list of them; {fix}"
    if not value:
        return (f"{key}: {value!r} names no module, and the run would fail when PEFT adds the adapter; {fix} "
                "(or leave it out)")
    names = [value] if isinstance(value, str) else value
    if len(names) > 1 and any(name.lower() == ALL_LINEAR for name in names):
        return (f"{key}: {ALL_LINEAR} works only on its own; PEFT reads it in a longer list as a module of that name "
                f"and adapts only the others; write [{ALL_LINEAR}], or the modules without it")
    # TRL passes a one-item list on as its item, and PEFT matches a single string as a regular
    # expression against the whole module name (model.layers.0.self_attn.q_proj): a bare name
    # of a module inside the model matches none of them, and the run fails when PEFT starts.
    if len(names) == 1 and re.fullmatch(r"\w+", names[0]) and names[0] not in TOP_LEVEL_MODULES:
        return (f"{key}: {value!r} matches no module: one name is read as a pattern for the whole module name "
                f"(e.g. model.layers.0.self_attn.{names[0]}); write the pattern '.*\\.{names[0]}', or list two "
                "or more names, e.g. [q_proj, v_proj]")
    return ""


def _names(key: str, value, example: str) -> str:
    if value is None or isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ""
    if isinstance(value, str):  # PEFT would read it letter by letter (lora_modules_to_save) or refuse it
        return f"{key}: {value!r} must be a list, even of one name: write [{value}]"
    return f"{key}: {value!r} is not a list of names; write a list, e.g. {example}"


def _task_type(value) -> str:
    if value is None or value in TASK_TYPES:
        return ""
    upper = value.upper() if isinstance(value, str) else ""
    use = upper if upper in TASK_TYPES else "CAUSAL_LM (SEQ_CLS for a reward model)"
    return f"lora_task_type: {value!r} is not one of PEFT's task types ({', '.join(TASK_TYPES)}); use {use}"


def _flag(key: str, value) -> str:
    if isinstance(value, bool):
        return ""
    return f"{key}: {value!r} is not true or false (PEFT takes any text, even \"no\", as true); write true or false"
