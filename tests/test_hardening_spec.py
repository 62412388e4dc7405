"""What the check before launch refuses (issue 29): values TRL, Transformers or PEFT would
refuse only after the model loaded, numbers that are not finite, a token anywhere in a spec,
and recipes that are empty or not files; and what it must not refuse: every recipe, a float
lora_alpha. Each refusal says which value to change, and nothing is made in the runs folder.

    .venv/bin/python -m pytest -q tests/test_hardening_spec.py
"""

from __future__ import annotations

import importlib.util

import pytest

from cli.main import main as cli_main
from conftest import RECIPES, launch_py
from studio_core.machine.hardware import cpu_hardware, instance_hardware
from studio_core.training import plan
from studio_core.recipe.spec import RunSpec, SpecError
from studio_core.recipe.validate import validate

TOKEN = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
SFT = RunSpec.load(RECIPES / "tiny-sft.yaml")
GRPO = RunSpec.load(RECIPES / "tiny-grpo.yaml")


def refused(manager, spec, hardware=None) -> list[str]:
    """The problems both Preview/`launch.py plan` and Start give; neither makes anything."""
    found = []
    for act in (manager.plan, manager.start):
        with pytest.raises(SpecError) as error:
            act(spec, hardware or cpu_hardware())
        found.append(error.value.problems)
    assert found[0] == found[1] and list(manager.runs_dir.iterdir()) == []
    return found[0]


# --- item 1: what the libraries refuse, asked of them before launch ------------------------
@pytest.mark.fast
@pytest.mark.parametrize("setting, says", [
    ("report_to=garbage", "report_to: 'garbage': Transformers (its report_to trackers) refuses it (ValueError: "
                          "garbage is not supported, only azure_ml"),
    ("logging_steps=0", "logging_steps: 0: TRL's SFTConfig refuses it (ValueError: logging strategy "
                        "IntervalStrategy.STEPS requires non-zero --logging_steps): change it, or leave it out for "
                        "TRL's default (10)"),
    ("save_steps=2.5", "save_steps: 2.5: TRL's SFTConfig refuses it (ValueError: --save_steps must be an integer"),
    ("load_best_model_at_end=true", "load_best_model_at_end: True: TRL's SFTConfig refuses it"),
])
def test_a_value_trl_or_transformers_refuses_is_refused_before_launch(setting, says, manager):
    spec = SFT.with_overrides(["save_strategy=steps", setting])
    (problem,) = refused(manager, spec)
    assert problem.startswith(says)


@pytest.mark.fast
@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_a_tracker_that_is_not_installed_is_refused_with_what_to_install(manager):
    (problem,) = refused(manager, SFT.with_overrides(["report_to=[tensorboard, wandb]"]))
    assert problem.startswith("report_to: ['tensorboard', 'wandb']: Transformers (its report_to trackers) refuses it "
                              "(RuntimeError: WandbCallback requires wandb to be installed. Run `pip install wandb`.)")
    assert problem.endswith("install it in the studio's environment, or leave it out of report_to")


@pytest.mark.fast
def test_grpo_batch_rules_count_the_runs_processes():
    """GRPOConfig checks the batch against the number of processes: 3 completions per step do not
    split into groups of 4 on one process, nor 3 x 2 = 6 on two; 2 x 2 = 4 do."""
    one = GRPO.with_overrides(["per_device_train_batch_size=3"])
    two = GRPO.with_overrides(["per_device_train_batch_size=2", "studio.nproc=2"])
    three = GRPO.with_overrides(["per_device_train_batch_size=3", "studio.nproc=2"])
    found = plan.configs_problems([(one, cpu_hardware()), (two, cpu_hardware()), (three, cpu_hardware())])
    assert found[0][0].startswith("per_device_train_batch_size: 3: TRL's GRPOConfig refuses it")
    assert found[1] == []
    assert "generation_batch_size (6) must be divisible by num_generations (4)" in found[2][0]


@pytest.mark.fast
def test_every_recipe_builds_its_config_as_the_planner_hands_it_on_every_backend():
    """The planner's defaults (CPU: use_cpu, bf16 off, gloo; Neuron: bf16, pad_to_multiple_of
    auto, torch_compile...) are in what is checked, so no recipe is refused on any machine."""
    machines = [cpu_hardware(), instance_hardware("trn2.3xlarge"), instance_hardware("trn2.48xlarge")]
    pairs = [(RunSpec.load(recipe), hardware) for recipe in sorted(RECIPES.glob("*.yaml")) for hardware in machines]
    found = plan.configs_problems(pairs)
    assert {f"{spec.display_name} on {hardware.backend}": p for (spec, hardware), p in zip(pairs, found) if p} == {}


# --- item 2: numbers that are not finite -----------------------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("setting, field, shown", [
    ("learning_rate=1e999", "learning_rate", "inf"),
    ("learning_rate=-.inf", "learning_rate", "-inf"),
    ("weight_decay=.nan", "weight_decay", "nan"),
    ("model_init_kwargs={scale: [1, .inf]}", "model_init_kwargs.scale[1]", "inf"),
    ("studio.eval_fraction=.nan", "studio.eval_fraction", "nan"),
])
def test_a_number_that_is_not_finite_is_refused_naming_its_field(setting, field, shown, manager):
    problems = refused(manager, SFT.with_overrides([setting]))
    assert f"{field}: {shown} is not a finite number; write a number (e.g. 2e-5 for a learning rate)" in problems


@pytest.mark.fast
def test_a_reward_weight_that_is_not_finite_is_refused():
    spec = SFT.with_overrides(["studio.rewards=[{name: length, target: 40, weight: 1e999}]"])
    assert "studio.rewards[0].weight: inf is not a finite number" in validate(spec)[0]


# --- item 3: the token rule over every value a user gives ------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("setting, field", [
    (f"run_name={TOKEN}", "run_name"),
    (f"dataset_name={TOKEN}", "dataset_name"),
    (f"model_name_or_path=me/{TOKEN}", "model_name_or_path"),
    (f"dataset_config=cfg-{TOKEN}", "dataset_config"),
    (f"studio.column_map={{{TOKEN}: text}}", "studio.column_map"),
    (f"studio.keep_columns=[text, {TOKEN}]", "studio.keep_columns"),
    (f"studio.eval_dataset={TOKEN}", "studio.eval_dataset"),
    (f"hub_model_id=me/{TOKEN}", "hub_model_id"),
])
def test_a_token_anywhere_in_a_spec_is_refused_and_never_shown(setting, field, manager):
    (problem,) = refused(manager, SFT.with_overrides([setting]))
    assert problem.startswith(f"{field}: a secret does not belong in a recipe or the form")
    assert "HF_TOKEN" in problem and TOKEN not in problem


@pytest.mark.fast
def test_a_token_in_a_reward_entry_is_refused():
    (problem,) = validate(GRPO.with_overrides([f"studio.rewards=[{{name: length, target: 40, note: {TOKEN}}}]"]))
    assert problem.startswith("studio.rewards: a secret does not belong") and TOKEN not in problem


@pytest.mark.fast
def test_a_token_as_run_name_on_the_command_line_is_refused_and_not_echoed(tmp_path, capsys):
    code = cli_main(["train", str(RECIPES / "tiny-sft.yaml"), "--set", f"run_name={TOKEN}", "--backend", "cpu",
                     "--runs-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2 and "run_name: a secret does not belong" in err and TOKEN not in err
    assert list((tmp_path / "runs").iterdir()) == []


# --- item 4: lora_alpha as PEFT takes it ------------------------------------------------------
@pytest.mark.fast
def test_a_float_lora_alpha_is_accepted_as_peft_accepts_it():
    spec = RunSpec.load(RECIPES / "tiny-sft-lora.yaml").with_overrides(["lora_alpha=16.5"])
    assert validate(spec) == []
    assert plan.trl_problems(spec, cpu_hardware()) == []  # TRL's ModelConfig and PEFT's LoraConfig build with it
    wrong = spec.with_overrides(["lora_alpha=[16]"])
    assert validate(wrong) == ["lora_alpha: expected int or float, got list [16]"]


# --- item 5: recipes that are empty or not files ----------------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n"])
def test_an_empty_recipe_is_refused(text, tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as error:
        RunSpec.load(path)
    assert error.value.problems[0].startswith(f"recipe {path} is empty: write at least the trainer, model and dataset")


@pytest.mark.fast
def test_a_recipe_that_is_a_folder_or_a_device_says_what_it_is(tmp_path):
    for path, says in ((tmp_path, "is a folder, give a YAML file"), ("/dev/null", "is not a regular file")):
        with pytest.raises(SpecError) as error:
            RunSpec.load(path)
        (problem,) = error.value.problems
        assert problem.startswith(f"recipe {path} {says}") and "not found" not in problem


@pytest.mark.fast
@pytest.mark.parametrize("name", ["tiny\n", "tiny\ntouch x", "a" * 65])
def test_a_run_name_with_a_line_break_or_too_long_is_refused(name):
    """The run name becomes part of the run folder and the Slurm job's label: `$` in a pattern
    also matches before a final line break, so the whole name must match."""
    problems = validate(RunSpec.from_dict({**SFT.to_dict(), "run_name": name}))
    assert any(p.startswith("run_name") for p in problems), problems


@pytest.mark.fast
def test_push_to_hub_with_a_reward_file_is_refused_since_the_run_drops_the_token(tmp_path):
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text("def f(completions, **kwargs):\n    return [1.0 for _ in completions]\n")
    spec = GRPO.with_overrides([f"studio.rewards=[{{file: {rewards}, function: f}}]"])
    assert not [p for p in validate(spec) if p.startswith("push_to_hub")]
    problems = validate(spec.with_overrides(["push_to_hub=true"]))
    assert any(p.startswith("push_to_hub: a run with your reward file has no Hub token") for p in problems), problems


@pytest.mark.fast
def test_a_config_check_child_that_cannot_answer_is_replaced(monkeypatch, tmp_path):
    """A check child that is up but answers nothing (leaving, idle, as it is asked; or its pipe
    lost) is ended and a new one asked, instead of being asked twice and failing the start."""
    import subprocess
    import sys

    from studio_core.recipe import trl_schema

    mute = subprocess.Popen([sys.executable, "-c", "import os, time; os.close(1); time.sleep(60)"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    monkeypatch.setattr(trl_schema, "_checker", mute)
    monkeypatch.setattr(trl_schema, "_passed", set())
    monkeypatch.setattr(trl_schema, "_passed_file", lambda key: tmp_path / "passed" / "check")
    try:
        assert plan.trl_problems(SFT.with_overrides(["logging_steps=7"]), cpu_hardware()) == []
        assert mute.poll() is not None  # ended, not left behind
    finally:
        mute.kill()
        mute.wait()


def test_a_config_check_child_that_ends_idle_is_reaped(monkeypatch, tmp_path):
    """The check child ends by itself once idle; it is reaped then, never left defunct under the
    app for as long as the app lives, and leaves nothing in the temp folder (each left a folder)."""
    import time

    import psutil

    from studio_core.recipe import trl_schema

    monkeypatch.setattr(trl_schema, "CHECK_IDLE_S", 1)
    monkeypatch.setattr(trl_schema, "_checker", None)
    monkeypatch.setattr(trl_schema, "_passed", set())
    monkeypatch.setattr(trl_schema, "_passed_file", lambda key: tmp_path / "passed" / "check")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # the child's temp folder
    assert plan.trl_problems(SFT.with_overrides(["logging_steps=9"]), cpu_hardware()) == []
    child = psutil.Process(trl_schema._checker.pid)
    deadline = time.monotonic() + 60
    while child.is_running() and child.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.2)  # idle for a second: it ends
    time.sleep(1)
    assert not child.is_running(), "the idle check child was left defunct"
    assert list((tmp_path / "tmp").glob("studio*")) == []  # (torch keeps its compile cache there: one a user)


@pytest.mark.fast
def test_the_config_check_child_starts_early_only_when_a_verdict_is_not_kept(monkeypatch, tmp_path):
    """manager.check starts the child before the model and data checks (it imports TRL meanwhile),
    but only when it will be asked: a kept verdict starts nothing."""
    from studio_core.recipe import trl_schema

    kept = tmp_path / "kept"
    monkeypatch.setattr(trl_schema, "_checker", None)
    monkeypatch.setattr(trl_schema, "_passed", set())
    monkeypatch.setattr(trl_schema, "_passed_file", lambda key: kept)
    plan.prepare_trl_check(SFT.with_overrides(["logging_steps=11"]), cpu_hardware())
    started = trl_schema._checker
    try:
        assert started is not None and started.poll() is None  # loading TRL, not yet asked
        kept.touch()
        monkeypatch.setattr(trl_schema, "_checker", None)
        plan.prepare_trl_check(SFT.with_overrides(["logging_steps=11"]), cpu_hardware())
        assert trl_schema._checker is None
    finally:
        started.kill()
        started.wait()


@pytest.mark.fast
def test_a_kept_pass_holds_for_a_run_of_another_name_with_the_same_settings(monkeypatch, tmp_path):
    """A kept pass was named by the whole request, the run's name too, so each new run name asked
    TRL again (a child importing it: seconds of CPU); other settings are still asked."""
    from studio_core.recipe import trl_schema

    first = plan._config_request(SFT.with_overrides(["logging_steps=13"]), cpu_hardware())
    renamed = plan._config_request(SFT.with_overrides(["logging_steps=13", "run_name=another-name"]), cpu_hardware())
    other = plan._config_request(SFT.with_overrides(["logging_steps=14"]), cpu_hardware())
    assert renamed["run_name"] != first["run_name"]
    monkeypatch.setenv("STUDIO_CACHE_DIR", str(tmp_path))  # nothing kept but what this test keeps
    monkeypatch.setattr(trl_schema, "_checker", None)
    monkeypatch.setattr(trl_schema, "_passed", set())
    passed = trl_schema._passed_file(trl_schema._verdict_key(first))
    passed.parent.mkdir(parents=True)
    passed.touch()  # as the first run's check left it
    assert trl_schema.config_problems([renamed]) == [[]] and trl_schema._checker is None
    assert not trl_schema._kept(trl_schema._verdict_key(other))


def test_a_plan_refused_before_the_config_check_answers_leaves_no_check_child(tmp_path):
    """The check child starts early (it imports TRL while the rest is checked); a plan refused
    for its layout exited and left it running, orphaned, until TRL was imported and it read the
    end of its input."""
    import shutil

    import psutil

    from studio_core.data.builtin import ensure_tiny_model
    from studio_core.machine.cache import cache_dir
    from studio_core.recipe.trl_schema import trl_schema

    cache = tmp_path / "cache"  # the session's model and TRL's fields, but no verdict kept: the child starts
    ensure_tiny_model()
    trl_schema()
    shutil.copytree(cache_dir(), cache, ignore=shutil.ignore_patterns("config-checks"))
    done = launch_py("plan", str(RECIPES / "tiny-sft.yaml"), "--runs-dir", str(tmp_path / "runs"), "--instance",
                     "trn2.3xlarge", "--set", "studio.nproc=8", env={"STUDIO_CACHE_DIR": str(cache)}, timeout=120)
    assert done.returncode != 0 and "use at most 4" in done.stdout + done.stderr
    left = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if process.environ().get("STUDIO_CACHE_DIR") == str(cache):
                left.append(" ".join(process.info["cmdline"] or [])[:120])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    assert left == []
