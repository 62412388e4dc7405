"""Tests for the run spec (studio_core.recipe.spec): recipes in and out, overrides, and the
messages that say what to change when a spec cannot launch."""

import json
from pathlib import Path

import pytest
from huggingface_hub import constants

from studio_core.data import sources
from studio_core.data.builtin import BUILTIN_MODEL, ensure_tiny_model
from studio_core.machine.hardware import Hardware, instance_hardware
from studio_core.training.plan import plan
from studio_core.recipe.spec import Layout, RunSpec, SpecError
from studio_core.recipe.validate import validate, validated

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))
REPO_RECIPES = Path(__file__).parent.parent / "recipes"
TINY = REPO_RECIPES / "tiny-sft.yaml"
CHAT = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]


def tiny(*overrides: str) -> RunSpec:
    return RunSpec.load(TINY).with_overrides(list(overrides))


def only_problem(spec: RunSpec) -> str:
    problems = validate(spec)
    assert len(problems) == 1, problems
    return problems[0]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# --- recipes ----------------------------------------------------------------------------
@pytest.mark.fast
def test_there_are_recipes():
    assert TINY in RECIPES


@pytest.fixture(scope="module")
def recipe_standin():
    """A stand-in for the Hub serving the config.json of every Hub model a recipe names (the
    check before launch fetches it, asks for the list of files: weights and a tokenizer there, and
    reads the weights' header), as the real Hub has them: Qwen3 causal LMs. Filled once for the
    file; the tests only read it."""
    from huggingface_hub import HfApi

    from hub_standin import HubStandIn, header_only_safetensors, point_hub_client_at

    token = "hf_qwen_recipes_0123456789"
    with HubStandIn(tokens={token: {"user": "qwen-bot", "orgs": ["Qwen"]}}) as hub:
        with pytest.MonkeyPatch.context() as patch:
            point_hub_client_at(hub, patch)
            api = HfApi(endpoint=hub.url, token=token)
            config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
            weights = header_only_safetensors(config["model_type"])
            for name in sorted({RunSpec.load(r).model_name_or_path for r in RECIPES} - set(sources.BUILTIN_MODELS)):
                api.create_repo(name)
                api.upload_file(path_or_fileobj=json.dumps(config).encode(), path_in_repo="config.json", repo_id=name)
                api.upload_file(path_or_fileobj=b"{}", path_in_repo="tokenizer.json", repo_id=name)  # its name is asked
                api.upload_file(path_or_fileobj=weights, path_in_repo="model.safetensors", repo_id=name)  # header read
        yield hub


@pytest.fixture
def recipe_hub(recipe_standin, monkeypatch, tmp_path):
    """The Hub "on", as the file's stand-in, with an empty Hugging Face cache of the test's own."""
    from hub_standin import point_hub_client_at, use_hub_cache

    point_hub_client_at(recipe_standin, monkeypatch)
    use_hub_cache(tmp_path / "hub-cache", monkeypatch)
    return recipe_standin


# A recipe with reward functions is checked by importing and calling them in a child process:
# seconds each, so those are left out of the fast subset.
@pytest.mark.parametrize("recipe", [pytest.param(r, id=r.name, marks=() if RunSpec.load(r).rewards else pytest.mark.fast)
                                    for r in RECIPES])
def test_every_recipe_loads_validates_and_round_trips(recipe, tmp_path, recipe_hub):
    # A recipe may name Hub sources; whether they are cached is this machine's business, so the
    # Hub is "on" here, a stand-in for it (a Hub dataset is not read before launch).
    spec = RunSpec.load(recipe)
    assert validate(spec) == []
    # every recipe plans for the trn instance it is sized for; the tiny ones for a 2-core CPU too
    assert plan(spec, instance_hardware("trn2.48xlarge" if spec.layout.nproc > 4 else "trn2.3xlarge")).errors == []
    if spec.model_name_or_path in sources.BUILTIN_MODELS:
        assert plan(spec, Hardware("cpu", 2, cpu_count=2)).errors == []
    saved = tmp_path / "again.yaml"
    spec.save(saved)
    again = RunSpec.load(saved)
    assert again == spec
    assert again.to_dict() == spec.to_dict()


@pytest.mark.fast
def test_a_reward_file_reading_a_real_column_passes_on_a_hub_dataset(tmp_path, recipe_hub):
    # trl-lib/tldr is not read before launch: the file is imported, its function looked up, not
    # called on a made-up row without the `completion` column it reads (the run calls it on real rows)
    rewards = tmp_path / "tldr_rewards.py"
    rewards.write_text("def f(completions, completion, **kwargs):\n"
                       "    return [-abs(len(c) - len(r)) / 100 for c, r in zip(completions, completion)]\n")
    spec = RunSpec.load(REPO_RECIPES / "qwen3-0.6b-grpo-tldr.yaml")
    assert validate(spec.with_overrides([f"studio.rewards=[{{file: {rewards}, function: f}}]"])) == []
    (problem,) = validate(spec.with_overrides([f"studio.rewards=[{{file: {rewards}, function: g}}]"]))
    assert problem.startswith("studio.rewards[0] (") and "has no 'g'; it defines: f" in problem


@pytest.mark.fast
def test_recipe_keys_land_where_they_belong():
    spec = RunSpec.load(TINY)
    assert spec.trainer == "sft"
    assert spec.layout == Layout(nproc=1, cores=None, tp_size=1, fsdp_size=1)
    assert spec.model_name_or_path == BUILTIN_MODEL
    assert spec.dataset_name == "builtin:qa"
    assert spec.run_name == "tiny-sft"
    assert spec.args["max_steps"] == 300
    assert spec.args["learning_rate"] == 2.0e-3
    assert spec.args["save_strategy"] == "no"
    for key in ("studio", "model_name_or_path", "dataset_name", "run_name"):
        assert key not in spec.args  # only the trainer's own fields go to TRL's config


@pytest.mark.fast
def test_a_recipe_without_the_studio_block_is_an_sft_run_on_one_process(tmp_path):
    recipe = tmp_path / "plain.yaml"
    recipe.write_text("model_name_or_path: builtin:tiny-qwen3\ndataset_name: builtin:chat\nmax_steps: 3\n")
    spec = validated(RunSpec.load(recipe))
    assert spec.trainer == "sft" and spec.layout.nproc == 1
    assert spec.args == {"max_steps": 3}


@pytest.mark.fast
def test_save_keeps_values_that_yaml_would_otherwise_retype(tmp_path):
    spec = tiny("run_name=off-by-one", "save_strategy=no", "lr_scheduler_type=constant")
    spec.save(tmp_path / "spec.yaml")
    again = RunSpec.load(tmp_path / "spec.yaml")
    assert again.args["save_strategy"] == "no"
    assert again == spec


# --- --set overrides --------------------------------------------------------------------
@pytest.mark.fast
def test_overrides_are_typed_as_yaml():
    spec = tiny("max_steps=5", "learning_rate=0.01", "logging_first_step=true", "max_length=null",
                "dataset_name=builtin:chat")
    assert spec.args["max_steps"] == 5 and type(spec.args["max_steps"]) is int
    assert spec.args["learning_rate"] == 0.01 and type(spec.args["learning_rate"]) is float
    assert spec.args["logging_first_step"] is True
    assert spec.args["max_length"] is None
    assert spec.dataset_name == "builtin:chat"
    assert validate(spec) == []


@pytest.mark.fast
def test_overrides_read_values_as_trl_and_yaml_1_2_do():
    # `no` is one of save_strategy's choices, not a boolean; 1e-5 is a float, as in TRL's CLI.
    spec = tiny("save_strategy=no", "learning_rate=1e-5", "report_to=none")
    assert spec.args["save_strategy"] == "no"
    assert spec.args["learning_rate"] == 1e-5 and type(spec.args["learning_rate"]) is float
    assert spec.args["report_to"] == "none"
    assert validate(spec) == []


@pytest.mark.fast
def test_a_recipe_may_write_learning_rate_as_trl_recipes_do(tmp_path):
    recipe = tmp_path / "trl.yaml"
    recipe.write_text("model_name_or_path: builtin:tiny-qwen3\ndataset_name: builtin:qa\n"
                      "learning_rate: 2e-5\nmax_steps: 10\nsave_strategy: no\n")
    spec = validated(RunSpec.load(recipe))
    assert spec.args["learning_rate"] == 2e-5
    assert spec.args["save_strategy"] == "no"


@pytest.mark.fast
def test_studio_overrides_change_the_layout_not_the_trainer_args():
    spec = tiny("studio.nproc=2", "studio.cores=0-1")
    assert spec.layout.nproc == 2 and spec.layout.cores == "0-1"
    assert "nproc" not in spec.args and "cores" not in spec.args
    assert validate(spec) == []
    assert tiny("nproc=2").layout.nproc == 2  # the prefix may be left off


@pytest.mark.fast
def test_overrides_leave_the_original_spec_alone():
    spec = RunSpec.load(TINY)
    spec.with_overrides(["max_steps=5", "studio.nproc=2"])
    assert spec.args["max_steps"] == 300 and spec.layout.nproc == 1


@pytest.mark.fast
def test_a_key_inside_a_backends_block_is_set_and_a_wrong_one_is_named():
    spec = tiny("studio.run_on=ray", "studio.ray.address=http://10.0.0.5:8265")
    assert spec.layout.options.address == "http://10.0.0.5:8265" and validate(spec) == []
    spec = tiny("studio.run_on=slurm", "studio.slurm.time=00:10:00", "studio.slurm.partition=debug")
    assert (spec.layout.options.time, spec.layout.options.partition) == ("00:10:00", "debug")
    for overrides, said in ((["studio.ray.adress=http://h:8265"], "studio.ray.adress: unknown key; it takes address"),
                            (["studio.nproc.x=1"], "--set 'studio.nproc.x=1': studio.nproc is not a block of keys")):
        with pytest.raises(SpecError) as caught:
            tiny(*overrides)
        assert said in str(caught.value)


@pytest.mark.fast
def test_an_override_without_equals_says_how_to_write_it():
    with pytest.raises(SpecError) as caught:
        tiny("max_steps")
    assert "'max_steps'" in str(caught.value) and "key=value" in str(caught.value)


# --- what a bad spec is told ----------------------------------------------------------
@pytest.mark.fast
def test_unknown_key_suggests_the_close_one():
    message = only_problem(tiny("max_step=5"))
    assert message.startswith("max_step:")
    assert "did you mean max_steps?" in message


@pytest.mark.fast
def test_unknown_key_without_a_close_one_points_to_the_config():
    message = only_problem(tiny("zzzqqq=1"))
    assert message.startswith("zzzqqq:") and "SFTConfig" in message


@pytest.mark.fast
@pytest.mark.parametrize("assignment, key, fix", [
    ('learning_rate="fast"', "learning_rate", "expected float"),
    ("max_steps=1.5", "max_steps", "expected int"),
    ("logging_first_step=[1]", "logging_first_step", "expected bool"),
])
def test_wrong_value_type_names_the_type_wanted(assignment, key, fix):
    message = only_problem(tiny(assignment))
    assert message.startswith(f"{key}:")
    assert fix in message


@pytest.mark.fast
def test_an_int_is_a_fine_float():
    assert validate(tiny("learning_rate=1", "num_train_epochs=2")) == []


@pytest.mark.fast
def test_enum_value_not_in_choices_lists_the_choices():
    message = only_problem(tiny("lr_scheduler_type=wobbly"))
    assert message.startswith("lr_scheduler_type:")
    assert "'wobbly'" in message and "cosine" in message and "linear" in message


@pytest.mark.fast
def test_output_dir_is_the_studios_to_set():
    message = only_problem(tiny("output_dir=/tmp/mine"))
    assert message.startswith("output_dir:")
    assert "output/" in message and "remove it" in message


@pytest.mark.fast
def test_unknown_studio_key_lists_the_studio_keys(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("studio:\n  nprocs: 2\n")
    with pytest.raises(SpecError) as caught:
        RunSpec.load(recipe)
    (message,) = caught.value.problems
    assert message.startswith("studio.nprocs:")
    assert "nproc" in message and "tp_size" in message


@pytest.mark.fast
def test_unknown_studio_key_through_set_is_told_as_a_studio_key():
    with pytest.raises(SpecError) as caught:
        tiny("studio.nprocs=2")
    (message,) = caught.value.problems
    assert message.startswith("studio.nprocs:") and "nproc" in message


@pytest.mark.fast
@pytest.mark.parametrize("text", ["- a\n- b\n", "just words\n", "42\n"])
def test_a_recipe_must_be_a_mapping(tmp_path, text):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    with pytest.raises(SpecError) as caught:
        RunSpec.load(recipe)
    assert "mapping" in str(caught.value)


@pytest.mark.fast
def test_studio_block_must_be_a_mapping(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("studio: 2\n")
    with pytest.raises(SpecError) as caught:
        RunSpec.load(recipe)
    assert str(caught.value).startswith("- studio:")


@pytest.mark.fast
def test_invalid_yaml_names_the_file(tmp_path):
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("max_steps: [1, 2\nlearning_rate: 0.1\n")
    with pytest.raises(SpecError) as caught:
        RunSpec.load(recipe)
    assert str(recipe) in str(caught.value) and "not valid YAML" in str(caught.value)


@pytest.mark.fast
def test_missing_recipe_file(tmp_path):
    with pytest.raises(SpecError) as caught:
        RunSpec.load(tmp_path / "nope.yaml")
    assert "nope.yaml not found" in str(caught.value)


@pytest.mark.fast
def test_missing_model_folder(tmp_path):
    message = only_problem(tiny(f"model_name_or_path={tmp_path / 'no-model'}"))
    assert message.startswith("model_name_or_path:")
    assert "not found" in message and "Hub id" in message


@pytest.mark.fast
def test_model_folder_without_config_json(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    message = only_problem(tiny(f"model_name_or_path={tmp_path}"))
    assert message.startswith("model_name_or_path:")
    assert "no config.json" in message and "save_pretrained" in message


def test_a_saved_model_folder_is_fine():  # Transformers' check, in a child process: seconds
    assert validate(tiny(f"model_name_or_path={ensure_tiny_model()}")) == []


@pytest.mark.fast
def test_unknown_builtin_model():
    message = only_problem(tiny("model_name_or_path=builtin:huge"))
    assert message.startswith("model_name_or_path:") and BUILTIN_MODEL in message


@pytest.mark.fast
def test_uncached_hub_model_while_offline():
    assert constants.HF_HUB_OFFLINE  # tests/conftest.py turns the Hub off
    message = only_problem(tiny("model_name_or_path=studio-tests/no-such-model"))
    assert message.startswith("model_name_or_path:")
    assert "HF_HUB_OFFLINE=1" in message and "local folder" in message


@pytest.mark.fast
def test_uncached_hub_dataset_while_offline():
    message = only_problem(tiny("dataset_name=studio-tests/no-such-dataset"))
    assert message.startswith("dataset_name:") and "HF_HUB_OFFLINE=1" in message


@pytest.mark.fast
def test_missing_dataset_file(tmp_path):
    message = only_problem(tiny(f"dataset_name={tmp_path / 'missing.jsonl'}"))
    assert message.startswith("dataset_name:") and "not found" in message


@pytest.mark.fast
def test_empty_dataset_file(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    message = only_problem(tiny(f"dataset_name={tmp_path / 'empty.jsonl'}"))
    assert message.startswith("dataset_name:") and "is empty" in message


@pytest.mark.fast
def test_malformed_first_jsonl_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"messages": [oops]}\n')
    message = only_problem(tiny(f"dataset_name={tmp_path / 'bad.jsonl'}"))
    assert message.startswith("dataset_name:")
    assert "line 1 is not valid JSON" in message


@pytest.mark.fast
def test_jsonl_without_a_trainable_column_names_the_columns_it_has(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "a?", "answer": "b"}])
    message = only_problem(tiny(f"dataset_name={path}"))
    assert message.startswith("dataset:")
    assert "messages" in message and "`question`, `answer`" in message
    assert "dataset_text_field" in message


@pytest.mark.fast
def test_csv_without_a_trainable_column_names_the_columns_it_has(tmp_path):
    (tmp_path / "d.csv").write_text("title,body\nHello,World\n")
    message = only_problem(tiny(f"dataset_name={tmp_path / 'd.csv'}"))
    assert message.startswith("dataset:") and "`title`, `body`" in message


@pytest.mark.fast
@pytest.mark.parametrize("records, extra", [
    ([{"messages": CHAT}], []),
    ([{"prompt": "2+2=", "completion": "4"}], []),
    ([{"text": "Once upon a time."}], []),
    ([{"body": "Once upon a time."}], ["dataset_text_field=body"]),
])
def test_datasets_sft_can_train_on(tmp_path, records, extra):
    path = write_jsonl(tmp_path / "d.jsonl", records)
    assert validate(tiny(f"dataset_name={path}", *extra)) == []


@pytest.mark.fast
def test_json_and_csv_files_are_read(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps([{"messages": CHAT}]))
    (tmp_path / "d.csv").write_text("prompt,completion\n2+2=,4\n")
    assert validate(tiny(f"dataset_name={tmp_path / 'd.json'}")) == []
    assert validate(tiny(f"dataset_name={tmp_path / 'd.csv'}")) == []


@pytest.mark.fast
def test_unreadable_file_type(tmp_path):
    (tmp_path / "d.txt").write_text("hello\n")
    message = only_problem(tiny(f"dataset_name={tmp_path / 'd.txt'}"))
    assert message.startswith("dataset_name:") and ".jsonl" in message


@pytest.mark.fast
def test_unknown_builtin_dataset_lists_the_builtin_ones():
    message = only_problem(tiny("dataset_name=builtin:nope"))
    assert message.startswith("dataset_name:")
    assert "builtin:qa" in message and "builtin:chat" in message


@pytest.mark.fast
def test_tp_times_fsdp_must_equal_nproc():
    message = only_problem(tiny("studio.nproc=4", "studio.tp_size=2", "studio.fsdp_size=1"))
    assert "studio.tp_size x studio.fsdp_size = 2" in message and "studio.nproc = 4" in message
    assert validate(tiny("studio.nproc=4", "studio.tp_size=2", "studio.fsdp_size=2")) == []


@pytest.mark.fast
@pytest.mark.parametrize("value", ["0", "two", "-1", "1.5", "true"])
def test_nproc_must_be_a_whole_number(value):
    message = only_problem(tiny(f"studio.nproc={value}"))
    assert message.startswith("studio.nproc:") and "whole number" in message


@pytest.mark.fast
@pytest.mark.parametrize("name", ["my run", "a/b", "-leading-dash", "x" * 65, "run;rm"])
def test_run_name_with_bad_characters(name):
    message = only_problem(tiny(f"run_name={name}"))
    assert message.startswith("run_name:") and "letters, digits" in message


@pytest.mark.fast
@pytest.mark.parametrize("assignment, key", [
    ("run_name=2024", "run_name"),
    ("run_name=2024-06-01", "run_name"),  # a date, to YAML
    ("model_name_or_path=123", "model_name_or_path"),
    ("dataset_name=7", "dataset_name"),
    ("dataset_train_split=null", "dataset_train_split"),
    ("dataset_config=[a]", "dataset_config"),
])
def test_names_that_yaml_reads_as_something_else_must_be_quoted(assignment, key):
    message = only_problem(tiny(assignment))
    assert message.startswith(f"{key}:") and "write it in quotes" in message


@pytest.mark.fast
def test_a_quoted_number_is_a_fine_run_name():
    spec = tiny("run_name='2024-06-01'")
    assert spec.run_name == "2024-06-01" and validate(spec) == []


@pytest.mark.fast
@pytest.mark.parametrize("key", ["learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps"])
def test_values_that_must_be_positive(key):
    value = "-0.1" if key == "learning_rate" else "0"
    message = only_problem(tiny(f"{key}={value}"))
    assert message.startswith(f"{key}:") and "must be above 0" in message


@pytest.mark.fast
def test_no_steps_and_no_epochs():
    message = only_problem(tiny("max_steps=-1", "num_train_epochs=0"))
    assert "max_steps" in message and "num_train_epochs" in message


@pytest.mark.fast
def test_max_length_below_one():
    message = only_problem(tiny("max_length=0"))
    assert message.startswith("max_length:") and "null" in message


@pytest.mark.fast
def test_an_unknown_trainer_lists_the_available_ones():
    message = only_problem(tiny("studio.trainer=ppo"))
    assert message.startswith("studio.trainer:") and "choose sft, dpo, kto, grpo, rloo, reward" in message


@pytest.mark.fast
def test_every_problem_is_listed_at_once():
    with pytest.raises(SpecError) as caught:
        validated(tiny("max_step=5", "learning_rate=-1", "run_name=a b", "studio.nproc=0"))
    keys = [p.split(":")[0] for p in caught.value.problems]
    assert keys == ["max_step", "learning_rate", "studio.nproc", "run_name"]
    assert str(caught.value).count("\n- ") == 3  # one line each


# --- models: causal LMs only, no foreign code unless allowed, the local cache ---------------
def model_folder(tmp_path, **config) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.fast
def test_a_model_that_is_not_a_causal_lm_is_refused(tmp_path):
    folder = model_folder(tmp_path, architectures=["BertForSequenceClassification"])
    message = only_problem(tiny(f"model_name_or_path={folder}"))
    assert "BertForSequenceClassification" in message and "not a causal language model" in message


@pytest.mark.fast
def test_a_model_with_its_own_code_needs_trust_remote_code(tmp_path):
    folder = model_folder(tmp_path, architectures=["MyForCausalLM"], auto_map={"AutoModelForCausalLM": "m.My"})
    (folder / "model.safetensors").write_bytes((ensure_tiny_model() / "model.safetensors").read_bytes())  # weights
    assert "trust_remote_code: true" in only_problem(tiny(f"model_name_or_path={folder}"))
    assert validate(tiny(f"model_name_or_path={folder}", "trust_remote_code=true")) == []


@pytest.mark.fast
def test_models_in_the_local_hub_cache_are_listed_and_pass_offline(tmp_path):
    from huggingface_hub import try_to_load_from_cache

    from studio_core.data.builtin import ensure_tiny_model
    from studio_core.data.sources import cached_models

    # the Hub cache's own layout: refs/main names a snapshot holding the files
    repo = tmp_path / "hub" / "models--acme--tiny"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "blobs").mkdir()
    for file in ensure_tiny_model().iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    assert cached_models(tmp_path / "hub") == ["acme/tiny"]
    assert isinstance(try_to_load_from_cache("acme/tiny", "config.json", cache_dir=tmp_path / "hub"), str)
    assert cached_models(tmp_path / "nothing-here") == []


@pytest.mark.fast
def test_a_bad_record_deep_in_a_local_file_is_refused_before_launch(tmp_path):
    """The first rows fit; record 40 has empty messages: named with its line before anything runs."""
    good = json.dumps({"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]})
    path = tmp_path / "deep.jsonl"
    path.write_text(f"{good}\n" * 39 + json.dumps({"messages": []}) + "\n" + f"{good}\n")
    problems = validate(RunSpec.load(TINY).with_overrides([f"dataset_name={path}"]))
    assert any("line 40" in p and "`messages` is empty" in p for p in problems), problems
