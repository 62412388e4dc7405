"""Export and push: a finished run becomes a model folder with a card, and goes to the Hub.

Exports are made from real runs (conftest's trained_runs) and loaded back with plain
transformers and with peft; pushes go through the real huggingface_hub client to
HubStandIn, a standard-library HTTP server on 127.0.0.1 standing in for the Hub.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from huggingface_hub import ModelCard

from child_env import with_child_environment
from hub_standin import HubStandIn, point_hub_client_at
from studio_core.export import hub
from studio_core.machine import leases
from studio_core.data.builtin import BUILTIN_DATASETS
from studio_core.export.export import (REPO_LINE, ExportError, _card_text, card_data, card_for_repo, export_info, export_run,
                                 read_output_info, run_summary)
from studio_core.machine.compile_cache import compile_cache_root
from studio_core.machine.hardware import Hardware, instance_hardware

ROOT = Path(__file__).resolve().parent.parent
QA = [json.loads(line)["messages"] for line in Path(BUILTIN_DATASETS["builtin:qa"]).read_text().splitlines()]
TOKEN, READ_ONLY, WRONG = "hf_alice_write_0123456789", "hf_alice_read_0123456789", "hf_wrong_0123456789"


def answer(model, tokenizer, question: str) -> str:
    import torch

    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        enable_thinking=False, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def metadata(folder: Path) -> dict:
    return yaml.safe_load((folder / "README.md").read_text().split("---")[1])


def card_code(card: str) -> dict:
    """What the card's usage code leaves defined (model, tokenizer) when run."""
    scope = {}
    exec(re.search(r"```python\n(.*?)```", card, re.S).group(1), scope)
    return scope


@pytest.fixture(scope="module")
def exports(trained_runs, tmp_path_factory):
    """The full run exported, and the LoRA run exported as an adapter and merged. The adapter
    is exported as on a trn2.3xlarge (it loads on CPU there too), its child's environment kept."""
    manager, ids = trained_runs
    out = tmp_path_factory.mktemp("exports")
    adapter, env = with_child_environment("studio_core.export.export", lambda: export_run(
        manager.runs_dir / ids["lora"], out / "adapter", hardware=instance_hardware("trn2.3xlarge")))
    return {
        "full": Path(export_run(manager.runs_dir / ids["full"], out / "full")["folder"]),
        "adapter": Path(adapter["folder"]),
        "merged": Path(export_run(manager.runs_dir / ids["lora"], out / "merged", merge=True)["folder"]),
        "neuron_env": env,
    }


def test_the_export_child_gets_the_neuron_environment_and_no_core(exports):
    env = exports["neuron_env"]
    assert env["HF_DEACTIVATE_ASYNC_LOAD"] == "1" and env["NEURON_LOGICAL_NC_CONFIG"] == "2"
    assert env["TORCH_NEURONX_NEFF_CACHE_DIR"] == str(compile_cache_root() / "neuron" / "neff")
    assert "NEURON_RT_VISIBLE_CORES" not in env  # it loads on CPU: no NeuronCore is taken from a run


@pytest.fixture
def standin(monkeypatch):
    tokens = {TOKEN: {"user": "alice", "orgs": ["alice-org"]},
              READ_ONLY: {"user": "alice", "orgs": [], "role": "read"}}
    with HubStandIn(tokens=tokens) as server:
        point_hub_client_at(server, monkeypatch)
        yield server
    assert server.errors == []


def test_full_and_merged_exports_load_and_answer_with_plain_transformers(exports):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    question, expected = QA[0][0]["content"], QA[0][1]["content"]
    for kind in ("full", "merged"):
        folder = exports[kind]
        assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "README.md",
                "loss.png"} <= {p.name for p in folder.iterdir()}
        assert not (folder / "training_args.bin").exists()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert tokenizer.chat_template  # the chat template travels with the model
        assert answer(AutoModelForCausalLM.from_pretrained(folder), tokenizer, question) == expected
        assert metadata(folder)["library_name"] == "transformers"
        # a merged export is a full model, made from the base the run named (no local path)
        assert json.loads((folder / "studio_output.json").read_text()) == {
            "kind": kind, "trainer": "sft", "task": "text-generation", "base_model": "builtin:tiny-qwen3"}


def test_adapter_export_loads_on_its_base_with_peft(exports, trained_runs):
    """As its card says: the built-in base is no Hub model, so the studio rebuilds it."""
    folder = exports["adapter"]
    assert (folder / "adapter_model.safetensors").exists() and not (folder / "model.safetensors").exists()
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == "builtin:tiny-qwen3"
    loaded = card_code(card_for_repo((folder / "README.md").read_text(), str(folder)))
    question, expected = QA[1][0]["content"], QA[1][1]["content"]
    assert answer(loaded["model"], loaded["tokenizer"], question) == expected
    # the folder the studio built the base in goes nowhere near the Hub
    manager, ids = trained_runs
    local = read_output_info(manager.runs_dir / ids["lora"])["base_model_path"]
    for kind in ("adapter", "merged", "full"):
        assert not [p for p in exports[kind].iterdir() if p.suffix in (".md", ".json") and local in p.read_text()]


def test_the_card_says_what_was_trained_and_how(exports, trained_runs):
    card = ModelCard.load(exports["adapter"] / "README.md")
    assert card.data.library_name == "peft" and card.data.pipeline_tag == "text-generation"
    assert {"trl", "sft", "lora", "trn-studio"} <= set(card.data.tags)
    assert "trainium" not in card.data.tags  # trained on this CPU, so not tagged as Trainium
    assert card.data.base_model is None  # builtin:tiny-qwen3 is no Hub model; the text names it
    text = card.text
    assert "builtin:tiny-qwen3" in text and "builtin:qa" in text and "![training loss](loss.png)" in text
    assert "| `max_steps` | `300` |" in text and "train_loss" in text and "graph compilations" in text
    assert "not on the Hub, so it cannot be downloaded" in text and "needs the studio to rebuild" in text
    assert REPO_LINE in text and "(REPO)" not in text  # a local export: a placeholder that says to replace it


def test_a_hub_base_is_named_by_its_hub_id(trained_runs):
    manager, ids = trained_runs
    summary = run_summary(manager.runs_dir / ids["lora"])
    summary["spec"] = replace(summary["spec"], model_name_or_path="Qwen/Qwen3-0.6B")
    info = {"kind": "adapter", "trainer": "sft", "task": "text-generation", "base_model": "Qwen/Qwen3-0.6B",
            "base_model_path": "Qwen/Qwen3-0.6B"}
    adapter = _card_text(summary, "adapter", info, None)
    assert adapter["base_note"] == ("The adapter's base model is `Qwen/Qwen3-0.6B` on the Hub: PEFT downloads it "
                                    "when it loads the adapter.")
    assert "AutoPeftModelForCausalLM.from_pretrained(repo_id)" in adapter["loader"]
    assert card_data(summary, "adapter", None).base_model == "Qwen/Qwen3-0.6B"
    assert _card_text(summary, "merged", info, None)["base_note"] == ""  # a whole model: nothing to fetch
    assert export_info(info, "merged") == {"kind": "merged", "trainer": "sft", "task": "text-generation",
                                           "base_model": "Qwen/Qwen3-0.6B"}


def test_bad_exports_say_what_to_change(trained_runs, exports, tmp_path):
    manager, ids = trained_runs
    with pytest.raises(ExportError, match="no adapter to merge"):
        export_run(manager.runs_dir / ids["full"], tmp_path / "x", merge=True)
    with pytest.raises(ExportError, match="not empty"):
        export_run(manager.runs_dir / ids["full"], exports["full"])
    with pytest.raises(ExportError, match="no saved model"):
        export_run(manager.runs_dir / "no-such-run", tmp_path / "y")


def test_on_the_cpu_backend_an_export_holds_a_core_of_its_own(trained_runs, tmp_path):
    """A held core is refused naming its holder, before anything is written; without a core
    named, the export takes the next free one and works pinned to it."""
    manager, ids = trained_runs
    cpu = Hardware(backend="cpu", devices=2, cpu_count=2)
    with leases.acquire(manager.runs_dir, "cpu", [0], holder="20261130-000000-busy-1a2b3c", kind="run"):
        with pytest.raises(ExportError, match="core 0 is held by run 20261130-000000-busy-1a2b3c"):
            export_run(manager.runs_dir / ids["full"], tmp_path / "refused", hardware=cpu, cores="0")
        assert not (tmp_path / "refused").exists()
        result = export_run(manager.runs_dir / ids["full"], tmp_path / "pinned", hardware=cpu)
    assert result["cores"] == [1] and "model.safetensors" in result["files"]
    assert leases.free_cores(manager.runs_dir, "cpu", 2) == {0, 1}  # the export gave its core back


def test_push_arrives_byte_for_byte_in_one_private_commit(exports, standin, trained_runs):
    folder = exports["merged"]
    url = hub.push(folder, "alice/tiny-merged", TOKEN, "the token")
    assert url == f"{standin.url}/alice/tiny-merged"
    repo = standin.repos["alice/tiny-merged"]
    assert repo["private"] and len(repo["commits"]) == 1
    local = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    card = repo["files"]["README.md"].decode()
    assert repo["files"] | {"README.md": local["README.md"]} == local
    # the card goes up naming its repo; the export folder keeps its placeholder
    assert card == card_for_repo(local["README.md"].decode(), "alice/tiny-merged") != local["README.md"].decode()
    assert 'repo_id = "alice/tiny-merged"\nmodel = AutoModelForCausalLM.from_pretrained(repo_id)' in card
    assert metadata(folder)["tags"] == yaml.safe_load(card.split("---")[1])["tags"]
    # the token is nowhere: not in the runs folder, the export, the pushed files or any request body
    manager, _ = trained_runs
    for path in [*manager.runs_dir.rglob("*"), *folder.rglob("*")]:
        assert not path.is_file() or TOKEN.encode() not in path.read_bytes(), path
    assert all(TOKEN.encode() not in body for body in repo["files"].values())
    assert all(TOKEN.encode() not in r.body for r in standin.requests)


def test_push_failures_each_say_what_to_change(exports, standin):
    folder = exports["full"]
    with pytest.raises(hub.HubError, match="refused.*wrong or expired") as refused:
        hub.push(folder, "alice/m", WRONG, "the token typed for this push")
    assert WRONG not in str(refused.value)
    with pytest.raises(hub.HubError, match="read-only"):
        hub.push(folder, "alice/m", READ_ONLY)
    with pytest.raises(hub.HubError, match="cannot write to 'bob'"):
        hub.push(folder, "bob/m", TOKEN)
    with pytest.raises(hub.HubError, match="your-name/model-name|your-name/m"):
        hub.push(folder, "m", TOKEN)
    hub.push(folder, "alice/m", TOKEN)
    with pytest.raises(hub.HubError, match="already exists"):
        hub.push(folder, "alice/m", TOKEN)
    # a failed upload says what it left: here an existing repo keeps its files
    standin.fail_next_commit = True
    with pytest.raises(hub.HubError, match="keeps its files.*nothing of this export was committed"):
        hub.push(exports["merged"], "alice/m", TOKEN, update=True)
    assert len(standin.repos["alice/m"]["commits"]) == 1
    hub.push(exports["merged"], "alice/m", TOKEN, update=True)  # an update is a new commit
    assert len(standin.repos["alice/m"]["commits"]) == 2


def test_no_network_and_no_token_are_explained(exports, standin, monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on port 9
    with pytest.raises(hub.HubError, match="cannot reach http://127.0.0.1:9"):
        hub.push(exports["full"], "alice/offline", TOKEN)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # no saved login there
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    with pytest.raises(hub.HubError, match="no Hub token: type one for this push, set HF_TOKEN"):
        hub.resolve_token("")
    with pytest.raises(hub.HubError) as cli_refusal:  # the command line has no token field to type into
        hub.resolve_token(None, can_type=False)
    assert "type one" not in str(cli_refusal.value) and "HF_TOKEN" in str(cli_refusal.value)
    assert hub.resolve_token(" typed ") == ("typed", "the token typed for this push")


def test_export_command_with_a_wrong_token_says_so(trained_runs, tmp_path):
    """(README's export command, pushed, runs in tests/test_readme.py.)"""
    manager, ids = trained_runs
    with HubStandIn(tokens={TOKEN: {"user": "alice", "orgs": []}}) as server:
        env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
        env |= {"HF_ENDPOINT": server.url, "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": WRONG}
        again = subprocess.run([sys.executable, "launch.py", "export", ids["lora"], "--runs-dir",
                                str(manager.runs_dir), "--out", str(tmp_path / "cli2"), "--push", "alice/x"],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 1 and "wrong or expired" in again.stderr and WRONG not in again.stderr


def runs_folder_with_two_runs(root: Path) -> tuple[Path, Path]:
    """A runs folder holding two run folders (each with its spec.yaml) and the studio's own state."""
    runs = root / "runs"
    first, second = runs / "20260101-000000-a-aaaaaa", runs / "20260101-000001-b-bbbbbb"
    for run in (first, second):
        run.mkdir(parents=True)
        (run / "spec.yaml").write_text("model_name_or_path: builtin:tiny-qwen3\n")
    for state in ("sweeps", "serve-logs", "smoke", "uploads", ".leases", ".deleting-20260101-000002-c-cccccc"):
        (runs / state).mkdir()
    return first, second


@pytest.mark.fast
@pytest.mark.parametrize("inside, said", [
    ("{own}/out", "inside the folder of run 20260101-000000-a-aaaaaa"),
    ("{other}/out", "inside the folder of run 20260101-000001-b-bbbbbb"),
    ("{other}/output/deep", "the export would be deleted with that run"),
    ("{runs}", "is the runs folder itself"),
    ("{runs}/sweeps/x", "the sweeps' records"),
    ("{runs}/serve-logs/x", "the model servers' logs"),
    ("{runs}/smoke/x", "the smoke tests' folders and runs"),
    ("{runs}/uploads", "the Train tab's uploads"),
    ("{runs}/.leases/x", "the core leases"),
    ("{runs}/.deleting-20260101-000002-c-cccccc/x", "making or deleting"),
])
def test_an_export_inside_any_run_or_the_runs_folders_state_is_refused(tmp_path, inside, said):
    own, other = runs_folder_with_two_runs(tmp_path)
    out = inside.format(own=own, other=other, runs=own.parent)
    with pytest.raises(ExportError, match=re.escape(said)) as refused:
        export_run(own, out)
    assert f"such as {own.parent / 'exports' / own.name}" in str(refused.value)  # what to give instead
    assert not Path(out).exists() or Path(out).name != "x"  # nothing made


@pytest.mark.fast
def test_an_export_through_a_symlink_into_another_run_is_refused(tmp_path):
    own, other = runs_folder_with_two_runs(tmp_path)
    (tmp_path / "link").symlink_to(other)
    with pytest.raises(ExportError, match="inside the folder of run 20260101-000001-b-bbbbbb"):
        export_run(own, tmp_path / "link" / "out")


@pytest.mark.fast
@pytest.mark.parametrize("where", ["exports/{id}", "exports/eval-downloads/{id}", "my-exports/{id}"])
def test_the_runs_folders_exports_and_other_folders_of_its_own_pass_the_check(tmp_path, where):
    own, _ = runs_folder_with_two_runs(tmp_path)
    with pytest.raises(ExportError, match="no saved model"):  # the next check: the folder itself was accepted
        export_run(own, own.parent / where.format(id=own.name))
