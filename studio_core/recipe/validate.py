"""The checks of a run spec before launch: every problem that stops it, each saying what to
change (`validate`; `validated` raises them as one SpecError), and what is worth saying but
does not stop it (the warnings). The TRL settings against the trainer's config, the token rule,
the numbers, the layout, the model (and studio.image_size, for its images) and the dataset
(recipe/dataset_check.py), the evaluation set.
"""

from __future__ import annotations

import difflib
import math
import re

from studio_core import backends
from studio_core.data import image_size, model_check, sources
from studio_core.machine.layout import check_sizes
from studio_core.recipe import data_check, dataset_check, eval_data, peft_check, rewards, trainers
from studio_core.recipe.spec import Layout, RunSpec, SpecError
from studio_core.recipe.trl_schema import check_value, trainer_fields

# Set by the studio for every run; a recipe that sets them would be silently overridden.
STUDIO_OWNED = {
    "output_dir": "the model is saved in the run folder's output/ (choose where runs go with --runs-dir)",
}
# TRL settings that hold a secret (of the fields of every trainer's config, hub_token only):
# what a recipe or the form holds goes to spec.yaml, output/training_args.bin and the model
# card, so a token is refused there, with the ways to pass one that are never written down.
SECRET_FIELDS = {"hub_token"}
TOKEN_WAYS = ("log in once with `hf auth login`, or set HF_TOKEN in the environment the studio runs in; the "
              "studio reads it from there and never writes it down")
# A value that looks like a Hugging Face access token, in whatever setting, also inside a longer word
# (a sweep names its runs after the grid's values: "tiny-sft-run_namehf_...").
TOKEN_VALUE = re.compile(r"hf_[A-Za-z0-9]{20,}")
MAX_PRECOMPILE_JOBS = 64
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def validate(spec: RunSpec, run_user_code: bool = False, warnings: list[str] | None = None,
             elsewhere: bool = False, settings_passed=None) -> list[str]:
    """Every problem that stops this spec from launching, each saying what to change. A user's
    reward files are imported and called only with `run_user_code` (Start, "Check reward
    functions"); otherwise (a plan, a preview) they are only read. What is worth saying but
    does not stop it (records that train, likely not as meant) goes to `warnings`. For a plan
    of another machine (`elsewhere`), a Hub model or dataset not on this one is not fetched
    nor checked: `warnings` says so. `settings_passed(spec)` is called once the spec's own
    settings passed, before the slower checks of its model and data (the manager starts TRL's
    config check there, so that it loads meanwhile)."""
    warnings = warnings if warnings is not None else []
    problems: list[str] = []
    try:
        spec.trainer_entry
    except KeyError as error:
        return [str(error).strip("'\"")]
    secrets = secret_problems(spec)
    if secrets:  # alone: other messages would show the value
        return secrets
    problems += check_args(spec.trainer, spec.args)
    seen = {p.split(":", 1)[0] for p in problems}  # a LoRA value of the wrong type is already named
    problems += [p for p in peft_check.peft_problems(spec.args) if p.split(":", 1)[0] not in seen]
    problems += _check_numbers(spec)
    problems += _check_layout(spec.layout)
    if spec.args.get("push_to_hub") is True and any(isinstance(r, dict) and "file" in r for r in spec.rewards or []):
        # the run drops the Hub token before it imports the user's reward file (trainer_setup)
        problems.append("push_to_hub: a run with your reward file has no Hub token once that file is imported, so "
                        "it could not push; leave push_to_hub out and export the finished run to the Hub instead")
    # YAML reads `run_name: 2024-06-01` as a date and `dataset_name: 7` as a number.
    names = {"model_name_or_path": spec.model_name_or_path, "dataset_name": spec.dataset_name,
             "dataset_train_split": spec.dataset_train_split}
    names |= {k: v for k, v in (("dataset_config", spec.dataset_config), ("run_name", spec.run_name)) if v is not None}
    not_text = [name for name, value in names.items() if not isinstance(value, str)]
    problems += [f"{name}: {names[name]!r} is not text; write it in quotes" for name in not_text]
    if isinstance(spec.run_name, str) and not RUN_NAME.fullmatch(spec.run_name):
        problems.append(f"run_name: {spec.run_name!r} must be 1-64 letters, digits, '.', '_' or '-'")
    if settings_passed is not None and not problems:
        settings_passed(spec)
    skipped = sources.not_here(*names_of(spec)) if elsewhere and not not_text else []
    if skipped:
        warnings.append(f"not checked here: {' and '.join(skipped)} (not on this machine, which plans for another; "
                        "the run downloads them there, and checks them before it trains)")
    if "model_name_or_path" not in not_text and not any(s.startswith("model ") for s in skipped):
        problems += sources.check_model(spec.model_name_or_path, bool(spec.args.get("trust_remote_code")))
    config = sources.model_config(spec.model_name_or_path) if "model_name_or_path" not in not_text else None
    problems += image_size.problems(spec.image_size, model_check.is_vision(config) if config is not None else None)
    train_rows = None
    if "dataset_name" not in not_text:
        found, train_rows = _check_data(spec, run_user_code, warnings,
                                        here=not any(s.startswith("dataset ") for s in skipped))
        problems += found
    problems += eval_data.check(spec, train_rows, warnings)
    warnings += eval_data.warnings(spec)
    return problems


def names_of(spec: RunSpec) -> tuple[str, str]:
    """The run's model and dataset, as the recipe names them."""
    return spec.model_name_or_path, spec.dataset_name


def secret_problems(spec: RunSpec) -> list[str]:
    """The token rule (check_args': a secret field, or a value that looks like a token) over
    every value of the spec: the run's and dataset's names, the studio block, TRL's settings."""
    data = spec.to_dict()
    named = {f"studio.{key}": value for key, value in data.pop("studio").items()} | data
    return [secret_message(key) for key, value in named.items()
            if key.rpartition(".")[2] in SECRET_FIELDS or holds_token(value)]


def secret_message(key: str) -> str:
    return (f"{key}: a secret does not belong in a recipe or the form (it would be written to the run folder and "
            f"the model card); remove it and {TOKEN_WAYS}")


def finite_problems(value, name: str) -> list[str]:
    """inf, -inf or nan anywhere in `value` (YAML reads 1e999 as inf): TRL takes them and trains
    to NaN, or forever."""
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{name}: {value} is not a finite number; write a number (e.g. 2e-5 for a learning rate)"]
    if isinstance(value, dict):
        return [p for key, item in value.items() for p in finite_problems(item, f"{name}.{key}")]
    if isinstance(value, (list, tuple)):
        return [p for i, item in enumerate(value) for p in finite_problems(item, f"{name}[{i}]")]
    return []


def check_args(trainer: str, args: dict) -> list[str]:
    """Each TRL setting checked against the trainer's config: known name, right kind of value."""
    problems = []
    allowed = trainer_fields(trainer)
    for key, value in args.items():
        if key in STUDIO_OWNED:
            problems.append(f"{key}: set by the studio ({STUDIO_OWNED[key]}); remove it")
        elif key in SECRET_FIELDS or holds_token(value):
            problems.append(secret_message(key))
        elif key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            config = trainers.get(trainer).config_class
            hint = f"; did you mean {close[0]}?" if close else f"; see {config}'s fields"
            problems.append(f"{key}: not a setting of TRL's {config}{hint}")
        else:
            message = check_value(key, value, peft_check.accepted(key, allowed[key]))
            if message:
                problems.append(message)
    return problems


def holds_token(value) -> bool:
    """Does this setting's value (or anything in it) look like a Hugging Face access token?"""
    if isinstance(value, str):
        return bool(TOKEN_VALUE.search(value))
    if isinstance(value, dict):
        return any(holds_token(v) or holds_token(k) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(holds_token(v) for v in value)
    return False


def _reward_check(spec: RunSpec, run_user_code: bool):
    """How the reward functions are checked: a user's files imported and called in a child
    process (without the Hub token) when that is asked for; else read only, in this process."""
    if run_user_code and any(isinstance(r, dict) and "file" in r for r in spec.rewards):
        return rewards.check_rewards_in_subprocess
    return lambda entries, rows: rewards.check_rewards(entries, rows, user_code=False)


def _check_data(spec: RunSpec, run_user_code: bool, warnings: list[str],
                here: bool = True) -> tuple[list[str], int | None]:
    """The dataset's source, then (for a local file) dataset_check.check_file: its first rows
    against the trainer and the reward functions called once on them, then every record. A Hub
    dataset or a folder is not read here: its rewards are only imported, and the worker runs
    `check_rows` on its first rows before it loads the model. -> (problems, the training rows
    when the whole file was read, for the held-out fraction's check)."""
    problems = sources.check_dataset(spec.dataset_name) if here else []  # not here: a Hub dataset, not looked for
    if problems:
        return problems, None
    entry = spec.trainer_entry
    path = sources.dataset_file(spec.dataset_name)
    train_rows = None
    if path is None:
        problems = data_check.check_mapping(None, spec.column_map, spec.keep_columns)
        if entry.rewards and not problems:  # imported and looked up (with run_user_code), not called
            problems += _reward_check(spec, run_user_code)(spec.rewards, None)
    else:
        try:
            check = dataset_check.check_file(spec, path, check_rewards=_reward_check(spec, run_user_code))
        except ValueError as error:
            return [f"dataset_name: {error}"], None
        problems, warnings[:] = check.problems, [*warnings, *check.warnings]
        train_rows = check.scan.rows if check.scan is not None else None
    if not entry.rewards and spec.rewards:
        using = ", ".join(t.key for t in trainers.TRAINERS.values() if t.rewards)
        problems.append(f"studio.rewards: {entry.name} takes no reward functions; remove them "
                        f"or choose a trainer that does ({using})")
    return problems, train_rows


def validated(spec: RunSpec, run_user_code: bool = False, warnings: list[str] | None = None,
              elsewhere: bool = False, settings_passed=None) -> RunSpec:
    problems = validate(spec, run_user_code, warnings, elsewhere, settings_passed)
    if problems:
        raise SpecError(problems)
    return spec


def _check_numbers(spec: RunSpec) -> list[str]:
    data = spec.to_dict()
    problems = [p for key, value in data.pop("studio").items() for p in finite_problems(value, f"studio.{key}")]
    problems += [p for key, value in data.items() for p in finite_problems(value, key)]
    args = spec.args
    positive = ("learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps")
    for key in positive:
        value = args.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and -math.inf < value <= 0:
            problems.append(f"{key}: must be above 0, got {value}")
    steps, epochs = args.get("max_steps", -1), args.get("num_train_epochs", 3.0)
    if isinstance(steps, int) and not isinstance(steps, bool) and steps != -1 and steps <= 0:
        # Transformers trains by num_train_epochs for any max_steps below 0 and stops after one step at 0, unsaid
        problems.append(f"max_steps: {steps} is not a number of steps: write one above 0, or -1 to train for "
                        "num_train_epochs instead (in the form: 0)")
    elif isinstance(steps, int) and isinstance(epochs, (int, float)) and steps <= 0 and epochs <= 0:
        problems.append("max_steps / num_train_epochs: set max_steps above 0 or num_train_epochs above 0")
    max_length = args.get("max_length")
    if isinstance(max_length, int) and max_length < 1:
        problems.append(f"max_length: must be at least 1 (or null for no truncation), got {max_length}")
    if not isinstance(spec.precompile, bool):
        problems.append(f"studio.precompile: true or false, got {spec.precompile!r}")
    jobs = spec.precompile_jobs
    if jobs is not None and (not isinstance(jobs, int) or isinstance(jobs, bool)
                             or not 1 <= jobs <= MAX_PRECOMPILE_JOBS):
        problems.append(f"studio.precompile_jobs: a whole number from 1 to {MAX_PRECOMPILE_JOBS} (parallel "
                        f"compile processes), got {jobs!r}")
    return problems


def _check_layout(layout: Layout) -> list[str]:
    """The hardware-free layout rules; the planner checks the rest against the hardware."""
    problems = check_sizes(layout.nproc, layout.tp_size, layout.fsdp_size)
    if layout.cores is not None and not isinstance(layout.cores, str):
        problems.append(f"studio.cores: {layout.cores!r} is not a core set; write it like \"0-3\" or \"0,1\"")
    if not isinstance(layout.nodes, int) or isinstance(layout.nodes, bool) or layout.nodes < 1:
        problems.append(f"studio.nodes: {layout.nodes!r} must be a whole number of machines, 1 or more")
    return problems + backends.check_layout(layout)  # the run backend's rules, its options' check among them
