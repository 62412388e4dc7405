"""A Hub model in a run: checked before launch, downloaded with progress on first use.

The model is published to HubStandIn (a local stand-in for the Hub) and a real run trains
on it by its Hub id, downloading it into an empty Hugging Face cache. Before launch only its
config.json is fetched, so a typo, a gated repo or a model that is not a causal LM is refused
then, with what to change.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from types import SimpleNamespace

import pytest
from huggingface_hub import HfApi

from conftest import run_folders
from hub_standin import HubStandIn, point_hub_client_at, use_hub_cache
from studio_core.data.builtin import ensure_tiny_model
from studio_core.machine.hardware import cpu_hardware
from studio_core.recipe.spec import SpecError
from studio_core.recipe.validate import validate
from test_runs import tiny

TOKEN = "hf_alice_publish_0123456789"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with HubStandIn(tokens={TOKEN: {"user": "alice", "orgs": []}}) as standin:
        point_hub_client_at(standin, monkeypatch)
        use_hub_cache(tmp_path / "empty-hub-cache", monkeypatch)
        yield standin
    assert standin.errors == [], "the stand-in met requests it could not handle"


def publish_config(hub: HubStandIn, repo_id: str, tmp_path, **config) -> None:
    """The tiny model (weights, tokenizer) with `config` written over its config.json's keys."""
    folder = tmp_path / "publish" / repo_id
    shutil.copytree(ensure_tiny_model(), folder)
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()), **config}))
    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo(repo_id)
    api.upload_folder(folder_path=str(folder), repo_id=repo_id)


def test_a_hub_model_is_downloaded_with_progress_on_first_use(hub, manager, tmp_path):
    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo("alice/tiny-qwen3", private=False)
    api.upload_folder(folder_path=str(ensure_tiny_model()), repo_id="alice/tiny-qwen3")

    view = manager.wait(manager.start(tiny("max_steps=5", "model_name_or_path=alice/tiny-qwen3"), cpu_hardware()).id)
    assert view.live_state == "finished", view.error_text
    weights = len(hub.repos["alice/tiny-qwen3"]["files"]["model.safetensors"])
    assert view.download["model"] == "alice/tiny-qwen3"
    assert view.download["done_bytes"] == view.download["total_bytes"] >= weights
    assert list((tmp_path / "empty-hub-cache").glob("models--alice--tiny-qwen3/snapshots/*/model.safetensors"))


@pytest.mark.fast
def test_a_missing_hub_model_is_refused_before_launch(hub, manager):
    with pytest.raises(SpecError) as refused:
        manager.start(tiny("model_name_or_path=alice/tiny-qwen"), cpu_hardware())
    (message,) = refused.value.problems
    assert message.startswith("model_name_or_path: alice/tiny-qwen not found on the Hub: check the id")
    assert run_folders(manager.runs_dir) == []


@pytest.mark.fast
def test_a_hub_model_that_is_not_a_causal_lm_is_refused_before_launch(hub, tmp_path):
    publish_config(hub, "alice/classifier", tmp_path, architectures=["BertForSequenceClassification"])
    (message,) = validate(tiny("model_name_or_path=alice/classifier"))
    assert "BertForSequenceClassification, not a causal language model" in message
    # only the config was fetched
    assert [r.path for r in hub.requests if r.method == "GET" and "/resolve/" in r.path] == \
        ["/alice/classifier/resolve/main/config.json"]


@pytest.mark.fast
def test_a_hub_model_with_its_own_code_needs_trust_remote_code(hub, tmp_path):
    publish_config(hub, "alice/custom", tmp_path, architectures=["MyForCausalLM"],
                   auto_map={"AutoModelForCausalLM": "modeling.MyForCausalLM"})
    (message,) = validate(tiny("model_name_or_path=alice/custom"))
    assert "trust_remote_code: true" in message
    assert validate(tiny("model_name_or_path=alice/custom", "trust_remote_code=true")) == []


def test_a_gated_hub_model_says_to_log_in(hub, tmp_path, monkeypatch):  # its config checked in a child: seconds
    publish_config(hub, "alice/gated", tmp_path, architectures=["Qwen3ForCausalLM"])
    hub.repos["alice/gated"]["gated"] = True
    (message,) = validate(tiny("model_name_or_path=alice/gated"))
    assert "gated on the Hub" in message and "HF_TOKEN" in message and "hf auth login" in message
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # alice's own repo: granted
    assert validate(tiny("model_name_or_path=alice/gated")) == []


@pytest.mark.fast
def test_an_unreachable_hub_is_said_before_launch_and_blocks_no_plan_for_elsewhere(hub, monkeypatch):
    """A Hub model not on this machine, and the Hub down: refused at once, saying so and what to do
    (it was let through, and the run failed at its download); planning for a trn instance from a
    machine without the network still works."""
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    point_hub_client_at(SimpleNamespace(url=f"http://127.0.0.1:{port}"), monkeypatch)  # the Hub is down
    began = time.monotonic()
    (message,) = validate(tiny("model_name_or_path=alice/anything"))
    assert message.startswith("model_name_or_path: alice/anything is not on this machine and the Hub")
    assert "cannot be reached" in message and "hf download alice/anything" in message
    warnings: list[str] = []
    assert validate(tiny("model_name_or_path=alice/anything"), warnings=warnings, elsewhere=True) == []
    assert any(w.startswith("not checked here: model alice/anything") for w in warnings), warnings
    assert time.monotonic() - began < 15
