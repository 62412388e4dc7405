"""The model is checked before launch, as the data is (issue 47): a model folder (or a Hub model
in the cache) whose config.json is not an object, names an architecture Transformers does not
know, holds a size that is no size, or whose weights or tokenizer are missing or do not fit it,
is refused with what to change, before a run, chat, evaluation or export starts; so is a Hub
model that is not on this machine while the Hub cannot be reached.

The folders are real: the built-in tiny model's, or one Transformers builds from a config
(AutoConfig.for_model, AutoModelForCausalLM.from_config(...).save_pretrained), then damaged.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import pytest

from conftest import RECIPES, launch_py, run_folders
from hub_standin import HubStandIn, point_hub_client_at, use_hub_cache
from studio_core.data import sources
from studio_core.data.builtin import BUILTIN_MODEL, TINY_VOCAB, ensure_tiny_model
from studio_core.machine.cache import cache_dir
from studio_core.machine.hardware import cpu_hardware
from studio_core.recipe.spec import Layout, RunSpec
from studio_core.recipe.validate import validate
from studio_core.training import memory

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tiny(*overrides: str) -> RunSpec:
    return RunSpec.load(RECIPES / "tiny-sft.yaml").with_overrides(list(overrides))


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def copied(tmp_path: Path, source: Path | None = None, **changes) -> Path:
    """A copy of a model folder (the built-in model's by default), its config.json changed."""
    folder = tmp_path / "model"
    shutil.copytree(source or ensure_tiny_model(), folder)
    if changes:
        edit_config(folder, **changes)
    return folder


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny Qwen3 saved by Transformers from a config, with the built-in model's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("saved") / "qwen3"
    config = AutoConfig.for_model("qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=TINY_VOCAB)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(ensure_tiny_model()).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def sharded(saved, tmp_path_factory) -> Path:
    """The same model saved in several shards, with their index."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("sharded") / "qwen3"
    AutoModelForCausalLM.from_pretrained(saved).save_pretrained(folder, max_shard_size="40KB")
    for name in TOKENIZER_FILES:
        shutil.copy(saved / name, folder / name)
    return folder


def only(problems: list[str]) -> str:
    assert len(problems) == 1, problems
    return problems[0]


# --- config.json, read as JSON: no child process ------------------------------------------------

@pytest.mark.fast
@pytest.mark.parametrize("text, kind", [("[1, 2]", "a JSON array"), ('"Qwen3"', "a JSON string"),
                                        ("7", "the number 7"), ("null", "JSON null")])
def test_a_config_that_is_not_an_object_is_refused_not_a_traceback(tmp_path, text, kind):
    folder = copied(tmp_path)
    (folder / "config.json").write_text(text)
    message = only(validate(tiny(f"model_name_or_path={folder}")))
    assert message.startswith(f"model_name_or_path: {folder}: ")
    assert f"holds {kind}, not an object of settings" in message and "save_pretrained" in message
    assert sources.model_config(str(folder)) is None  # the plan's readers get no config, not a list


@pytest.mark.fast
@pytest.mark.parametrize("key, value, said", [
    ("num_hidden_layers", -2, "num_hidden_layers is -2"), ("num_hidden_layers", 0, "num_hidden_layers is 0"),
    ("hidden_size", "64", "hidden_size is '64'"), ("intermediate_size", 64.5, "intermediate_size is 64.5"),
    ("vocab_size", True, "vocab_size is True"), ("num_attention_heads", float("nan"), "num_attention_heads is nan"),
])
def test_a_size_that_is_no_size_is_refused_as_it_is(tmp_path, key, value, said):
    folder = copied(tmp_path, **{key: value})
    message = only(sources.check_model(str(folder)))
    assert f"config.json's {said}, not a whole number above 0" in message
    assert "lacks" not in message


@pytest.mark.fast
def test_architectures_written_as_a_string_is_named_whole(tmp_path):
    folder = copied(tmp_path, architectures="Qwen3ForCausalLM")
    message = only(sources.check_model(str(folder)))
    assert "architectures is 'Qwen3ForCausalLM'; write a list of class names" in message
    assert "Q, w, e" not in message


@pytest.mark.fast
def test_a_folder_with_a_config_and_no_weights_is_refused(tmp_path):
    folder = copied(tmp_path)
    (folder / "model.safetensors").unlink()
    message = only(validate(tiny(f"model_name_or_path={folder}")))
    assert "has a config.json but no weights" in message and "model.safetensors" in message


@pytest.mark.fast
def test_an_unreadable_safetensors_header_is_refused(tmp_path):
    folder = copied(tmp_path)
    (folder / "model.safetensors").write_bytes((2**20).to_bytes(8, "little") + b"{not json")
    message = only(sources.check_model(str(folder)))
    assert "model.safetensors is not a readable safetensors file" in message and "copy it again" in message


# --- the estimate reads the same sizes ----------------------------------------------------------

TINY_CONFIG = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1002}


@pytest.mark.fast
@pytest.mark.parametrize("key, value", [("num_hidden_layers", -2), ("hidden_size", "64"), ("intermediate_size", 64.5),
                                        ("hidden_size", float("nan"))])
def test_the_estimate_says_a_bad_size_as_it_is(key, value):
    shape, why = memory.read_shape({**TINY_CONFIG, key: value})
    assert shape is None
    assert why == f"its config.json's {key} is {value!r}, not a whole number above 0"
    estimate = memory.estimate("sft", Layout(), {}, cpu_hardware(), {**TINY_CONFIG, key: value})
    assert estimate.describe() == [f"  not estimated: {why}"]  # no "weights: -0 MiB"


@pytest.mark.fast
def test_the_estimate_names_an_architectures_string_whole():
    config = {key: value for key, value in TINY_CONFIG.items() if key != "model_type"}
    _, why = memory.read_shape({**config, "architectures": "SuperformerForCausalLM"})
    assert why == "its architecture (SuperformerForCausalLM) is not one the estimate knows how to count"


# --- what Transformers says, in a child process ------------------------------------------------

def test_a_folder_transformers_saved_passes_and_its_pass_is_remembered(saved, tmp_path):
    folder = copied(tmp_path, saved)
    before = set((cache_dir() / "model-checks").glob("*.passed"))
    assert sources.check_model(str(folder)) == []
    assert len(set((cache_dir() / "model-checks").glob("*.passed")) - before) == 1  # in the studio's cache
    began = time.monotonic()
    assert sources.check_model(str(folder)) == []  # remembered: no child process this time
    assert time.monotonic() - began < 1
    edit_config(folder, intermediate_size=96)  # a changed file is checked again
    assert "its weights do not fit its config.json" in only(sources.check_model(str(folder)))


def test_the_config_check_child_answers_the_model_check_where_it_is_up_as_the_checks_own_child(saved, tmp_path,
                                                                                             monkeypatch):
    """A process that keeps the TRL config check's child (the app, a test worker) has it answer a model
    check too: it has Transformers and torch imported already, so no child of the model check's own
    starts (each imports them: seconds of CPU), and its answer is that child's. With none up, the
    model check's own child runs."""
    import sys

    from studio_core.data import model_check
    from studio_core.machine import children
    from studio_core.recipe import trl_schema

    started, recording = [], [True]  # the command line of each process this one starts meanwhile
    sys.addaudithook(lambda event, args: started.append(" ".join(map(str, args[1])))
                     if event == "subprocess.Popen" and recording[0] else None)
    try:
        good, bad = copied(tmp_path / "good", saved), copied(tmp_path / "bad", saved, intermediate_size=96)
        trl_schema.start_config_check()
        assert sources.check_model(str(good)) == []
        assert "its weights do not fit its config.json" in only(sources.check_model(str(bad)))
        assert not [line for line in started if "-m studio_core.data.model_child" in line], started
        # the same answer as the model check's own child gives
        own = children.run("studio_core.data.model_child", bad, env={"HF_HUB_OFFLINE": "1"}, capture_output=True,
                           text=True, timeout=model_check.CHILD_TIMEOUT_S)
        here = trl_schema._model_check_here([str(bad)], model_check.CHILD_TIMEOUT_S)
        assert model_check.answer(here) == model_check.answer(own) != []
        started.clear()
        monkeypatch.setattr(trl_schema, "_checker", None)  # none up
        other = copied(tmp_path / "other", saved, intermediate_size=80)
        assert "its weights do not fit its config.json" in only(sources.check_model(str(other)))
        assert [line for line in started if "-m studio_core.data.model_child" in line], started
    finally:
        recording[0] = False


def test_the_built_in_models_folder_passes():
    assert sources.check_model(str(ensure_tiny_model())) == []
    assert sources.check_model(BUILTIN_MODEL) == []


def test_an_architecture_transformers_does_not_know_is_refused(saved, tmp_path):
    folder = copied(tmp_path, saved, model_type="superformer", architectures=["SuperformerForCausalLM"])
    message = only(validate(tiny(f"model_name_or_path={folder}")))
    assert "its model_type 'superformer' is not an architecture Transformers" in message
    assert "pip install -U transformers" in message


def test_weights_of_other_shapes_than_the_config_are_refused(saved, tmp_path):
    folder = copied(tmp_path, saved, intermediate_size=96)
    message = only(sources.check_model(str(folder)))
    assert "its weights do not fit its config.json: model.layers.0.mlp.down_proj.weight is [32, 64] in " \
           "model.safetensors, the config makes it [32, 96] (6 tensors differ)" in message


def test_a_renamed_tensor_is_refused(saved, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = copied(tmp_path, saved)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.up.weight"] = tensors.pop("model.layers.0.mlp.up_proj.weight")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    message = only(sources.check_model(str(folder)))
    assert ("its weights lack 1 tensor(s) of the model its config.json describes (model.layers.0.mlp.up_proj.weight), "
            "and hold 1 it does not know (model.layers.0.mlp.up.weight)") in message


def test_a_folder_without_a_tokenizer_is_refused(saved, tmp_path):
    folder = copied(tmp_path, saved)
    for name in TOKENIZER_FILES:
        (folder / name).unlink()
    message = only(sources.check_model(str(folder)))
    assert "it has no tokenizer" in message and "tokenizer.save_pretrained" in message


def test_a_sharded_folder_passes_and_a_missing_shard_is_refused(sharded, tmp_path):
    assert sources.check_model(str(sharded)) == []
    folder = copied(tmp_path, sharded)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    message = only(sources.check_model(str(folder)))
    assert f"1 of the {len(shards)} weight shards its model.safetensors.index.json names are not in" in message
    assert shards[-1].name in message


# --- a Hub model: in the cache, or asked of the Hub ---------------------------------------------

def hub_snapshot(cache: Path, repo_id: str, files: list[Path]) -> Path:
    """The Hugging Face cache's own layout: refs/main names a snapshot holding the files."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for file in files:
        shutil.copy(file, snapshot / file.name)
    return snapshot


@pytest.mark.fast
def test_a_hub_model_whose_config_alone_is_cached_is_not_taken_as_downloaded(tmp_path, monkeypatch):
    use_hub_cache(tmp_path / "hub", monkeypatch)
    hub_snapshot(tmp_path / "hub", "acme/tiny", [ensure_tiny_model() / "config.json"])
    message = only(sources.check_model("acme/tiny"))  # the tests run with HF_HUB_OFFLINE=1
    assert "only its config.json is in the local Hugging Face cache, not its weights" in message
    assert "hf download acme/tiny" in message
    assert sources.cached_models(tmp_path / "hub") == []  # not offered as usable offline
    assert sources.not_here("acme/tiny", "builtin:qa") == ["model acme/tiny"]


def test_a_hub_model_in_the_cache_is_checked_whole(tmp_path, monkeypatch):
    use_hub_cache(tmp_path / "hub", monkeypatch)
    files = [ensure_tiny_model() / name for name in ("config.json", "model.safetensors")]
    hub_snapshot(tmp_path / "hub", "acme/tiny", files)  # no tokenizer
    assert "it has no tokenizer" in only(sources.check_model("acme/tiny"))


def test_a_hub_model_without_weights_is_refused_by_its_list_of_files(tmp_path, monkeypatch):
    from huggingface_hub import HfApi

    token = "hf_alice_publish_0123456789"
    folder = tmp_path / "publish"
    folder.mkdir()
    shutil.copy(ensure_tiny_model() / "config.json", folder / "config.json")  # a config, nothing else
    with HubStandIn(tokens={token: {"user": "alice", "orgs": []}}) as hub:
        point_hub_client_at(hub, monkeypatch)
        use_hub_cache(tmp_path / "hub", monkeypatch)
        api = HfApi(endpoint=hub.url, token=token)
        api.create_repo("alice/config-only")
        api.upload_folder(folder_path=str(folder), repo_id="alice/config-only")
        message = only(validate(tiny("model_name_or_path=alice/config-only")))
    assert message.startswith("model_name_or_path: alice/config-only has no weights on the Hub")
    assert hub.errors == []


def test_an_unreachable_hub_is_said_by_the_plan_not_by_a_failed_run(tmp_path):
    with socket.socket() as unused:  # a port nothing listens on: the Hub is down
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_CACHE": str(tmp_path / "hub")}
    began = time.monotonic()
    done = launch_py("plan", str(RECIPES / "tiny-sft.yaml"), "--runs-dir", str(tmp_path / "runs"), "--no-forecast",
                     "--set", "model_name_or_path=bigcorp/SuperModel-9000B-does-not-exist", env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert ("model_name_or_path: bigcorp/SuperModel-9000B-does-not-exist is not on this machine and the Hub "
            f"(http://127.0.0.1:{port}) cannot be reached") in done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert time.monotonic() - began < 60


# --- the command line, chat, evaluation and export ----------------------------------------------

def test_launch_py_plan_and_train_refuse_a_config_array_without_a_traceback(tmp_path):
    folder = copied(tmp_path)
    (folder / "config.json").write_text("[1, 2]")
    for command in ("plan", "train"):
        done = launch_py(command, str(RECIPES / "tiny-sft.yaml"), "--runs-dir", str(tmp_path / "runs"),
                         "--no-forecast" if command == "plan" else "--backend=cpu",
                         "--set", f"model_name_or_path={folder}")
        assert done.returncode == 2, done.stdout + done.stderr
        assert "holds a JSON array, not an object of settings" in done.stderr
        assert "Traceback" not in done.stdout + done.stderr
    assert not (tmp_path / "runs").exists() or run_folders(tmp_path / "runs") == []


@pytest.mark.fast
def test_chat_and_eval_refuse_a_folder_that_is_no_model_before_starting(tmp_path):
    from studio_core.evaluate.evaluation import EvalRequest, check_request
    from studio_core.serve.chat import ChatError, resolve

    folder = copied(tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ChatError) as refused:
        resolve(str(folder), tmp_path / "runs")
    assert str(refused.value).startswith(f"{folder}: it has a config.json but no weights")
    _, problems = check_request(EvalRequest(target="/etc", data="builtin:qa"), tmp_path / "runs")
    assert problems == ["/etc has no config.json, so it is not a saved Transformers model; give the folder that "
                        "save_pretrained wrote"]


def test_launch_py_eval_of_etc_is_refused_before_an_evaluation_starts(tmp_path):
    done = launch_py("eval", "/etc", "--data", "builtin:qa", "--runs-dir", str(tmp_path / "runs"))
    assert done.returncode != 0
    assert "/etc has no config.json" in done.stdout + done.stderr
    assert "sentencepiece" not in done.stdout + done.stderr and "Traceback" not in done.stdout + done.stderr
    assert not (tmp_path / "runs" / "evals").exists()


@pytest.mark.fast
def test_export_of_an_adapter_whose_base_is_gone_is_refused_before_the_child(tmp_path):
    from studio_core.export.export import ExportError, export_run

    base = copied(tmp_path)
    (base / "model.safetensors").unlink()  # the base's weights, deleted since the run
    run_dir = tmp_path / "runs" / "20260101-000000-tiny-lora-abcdef"
    (run_dir / "output").mkdir(parents=True)
    tiny(f"model_name_or_path={base}").save(run_dir / "spec.yaml")
    (run_dir / "output" / "studio_output.json").write_text(json.dumps({
        "kind": "adapter", "trainer": "sft", "task": "text-generation", "base_model": str(base),
        "base_model_path": str(base)}))
    with pytest.raises(ExportError) as refused:
        export_run(run_dir, tmp_path / "export", hardware=cpu_hardware())
    assert str(refused.value).startswith(f"run {run_dir.name} is a LoRA adapter on {base}, and the export cannot "
                                         f"load that base: {base}: it has a config.json but no weights")
    assert not (tmp_path / "export").exists()



# --- a weight file cut off, a pickle, a run's own saved model (issue 47) ------------------------

def cut_off(path: Path) -> None:
    """The file's header and half of its tensors' bytes: a download or a copy cut off."""
    data = path.read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")
    path.write_bytes(data[:start + (len(data) - start) // 2])


@pytest.mark.fast
def test_a_safetensors_file_cut_off_after_its_header_is_named_incomplete(tmp_path):
    folder = copied(tmp_path)
    cut_off(folder / "model.safetensors")
    message = only(sources.check_model(str(folder)))
    assert f"{folder / 'model.safetensors'} is incomplete (its header says its tensors end at byte " in message
    assert "download it again, or save the model again" in message


def test_a_pytorch_model_bin_folder_passes_with_its_pickle_left_unloaded(saved, tmp_path):
    """pytorch_model.bin has no header to read and is never loaded before launch (a pickle can run
    code): it is checked for being there, not refused as weights lacking every tensor."""
    import torch
    from safetensors.torch import load_file

    folder = copied(tmp_path, saved)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    assert sources.check_model(str(folder)) == []


def run_folder(runs_dir: Path, run_id: str, spec: RunSpec, info: dict) -> Path:
    """A finished run's folder as the studio reads it: its spec.yaml, and its output/ with the
    saved model's studio_output.json."""
    run_dir = runs_dir / run_id
    (run_dir / "output").mkdir(parents=True)
    spec.save(run_dir / "spec.yaml")
    (run_dir / "output" / "studio_output.json").write_text(json.dumps({"trainer": "sft", "task": "text-generation",
                                                                         **info}))
    return run_dir


def test_chat_eval_and_serve_refuse_a_run_whose_saved_model_was_cut_off(tmp_path):
    runs_dir, run_id = tmp_path / "runs", "20260101-000000-tiny-sft-abcdef"
    run_dir = run_folder(runs_dir, run_id, tiny(), {"kind": "full", "base_model": BUILTIN_MODEL})
    shutil.copytree(ensure_tiny_model(), run_dir / "output", dirs_exist_ok=True)
    cut_off(run_dir / "output" / "model.safetensors")
    for argv in (["chat", run_id, "--prompt", "Hello"], ["eval", run_id, "--data", "builtin:qa"],
                 ["serve", run_id, "--plan"]):
        done = launch_py(*argv, "--runs-dir", str(runs_dir))
        said = done.stdout + done.stderr
        assert done.returncode != 0, (argv, said)
        assert f"run {run_id}'s saved model in {run_dir / 'output'} cannot be loaded" in said, (argv, said)
        assert f"{run_dir / 'output' / 'model.safetensors'} is incomplete" in said and "train the run again" in said
        assert "Traceback" not in said
    assert not (run_dir / "eval").exists()


def test_chat_of_a_lora_run_checks_its_adapter_and_its_base(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from studio_core.serve.chat import ChatError, resolve

    base = copied(tmp_path)
    runs_dir, run_id = tmp_path / "runs", "20260101-000000-tiny-sft-lora-abcdef"
    run_dir = run_folder(runs_dir, run_id, tiny(f"model_name_or_path={base}", "use_peft=true"),
                         {"kind": "adapter", "base_model": str(base), "base_model_path": str(base)})
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, target_modules="all-linear"))
    model.save_pretrained(run_dir / "output")
    assert resolve(run_id, runs_dir).adapter == str(run_dir / "output")
    cut_off(run_dir / "output" / "adapter_model.safetensors")
    with pytest.raises(ChatError) as refused:
        resolve(run_id, runs_dir)
    assert f"{run_dir / 'output' / 'adapter_model.safetensors'} is incomplete" in str(refused.value)
    model.save_pretrained(run_dir / "output")  # whole again; now its base loses its weights
    (base / "model.safetensors").unlink()
    with pytest.raises(ChatError) as refused:
        resolve(run_id, runs_dir)
    assert str(refused.value).startswith(f"run {run_id} is a LoRA adapter on {base}, which cannot be loaded: "
                                         f"{base}: it has a config.json but no weights")


def upload(hub: HubStandIn, monkeypatch, tmp_path: Path, repo: str, folder: Path, token: str) -> None:
    from huggingface_hub import HfApi

    point_hub_client_at(hub, monkeypatch)
    use_hub_cache(tmp_path / "hub", monkeypatch)
    api = HfApi(endpoint=hub.url, token=token)
    api.create_repo(repo)
    api.upload_folder(folder_path=str(folder), repo_id=repo)


def test_a_hub_model_not_downloaded_has_its_weights_names_and_shapes_read_on_the_hub(saved, sharded, tmp_path,
                                                                                       monkeypatch):
    token = "hf_alice_publish_0123456789"
    wrong = copied(tmp_path, saved, intermediate_size=96)
    cut = tmp_path / "cut"
    shutil.copytree(sharded, cut)
    last = sorted(cut.glob("model-*.safetensors"))[-1]
    last.unlink()
    with HubStandIn(tokens={token: {"user": "alice", "orgs": []}}) as hub:
        upload(hub, monkeypatch, tmp_path, "alice/fits", saved, token)
        upload(hub, monkeypatch, tmp_path, "alice/other-shapes", wrong, token)
        upload(hub, monkeypatch, tmp_path, "alice/sharded", sharded, token)
        upload(hub, monkeypatch, tmp_path, "alice/shard-gone", cut, token)
        assert sources.check_model("alice/fits") == []
        assert sources.check_model("alice/sharded") == []
        message = only(sources.check_model("alice/other-shapes"))
        gone = only(sources.check_model("alice/shard-gone"))
        ranges = [r for r in hub.requests if any(k.lower() == "range" for k in r.headers)]
    assert message.startswith("model_name_or_path: alice/other-shapes: its weights do not fit its config.json: "
                              "model.layers.0.mlp.down_proj.weight is [32, 64] in model.safetensors, the config "
                              "makes it [32, 96]")
    assert gone.startswith("model_name_or_path: alice/shard-gone: a weight file its model.safetensors.index.json "
                           "names is not on the Hub") and last.name in gone
    assert ranges, "the headers are read by range, not by downloading the weights"
    assert not any((tmp_path / "hub").rglob("*.safetensors")), "no weight file was downloaded"
