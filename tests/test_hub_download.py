"""The first use of a Hub model in a run: downloaded with progress shown on the run's page.

The model is published to HubStandIn (a local stand-in for the Hub) and a real run trains
on it by its Hub id, downloading it into an empty Hugging Face cache.
"""

from __future__ import annotations

from huggingface_hub import HfApi

from hub_standin import HubStandIn, point_hub_client_at
from studio_core.builtin import ensure_tiny_model
from studio_core.hardware import cpu_hardware
from test_runs import tiny, wait_until_final

TOKEN = "hf_alice_publish_0123456789"


def test_a_hub_model_is_downloaded_with_progress_on_first_use(manager, monkeypatch, tmp_path):
    with HubStandIn(tokens={TOKEN: {"user": "alice", "orgs": []}}) as standin:
        point_hub_client_at(standin, monkeypatch)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))  # for the run's processes
        api = HfApi(endpoint=standin.url, token=TOKEN)
        api.create_repo("alice/tiny-qwen3", private=False)
        api.upload_folder(folder_path=str(ensure_tiny_model()), repo_id="alice/tiny-qwen3")

        view = wait_until_final(manager, manager.start(tiny("max_steps=5", "model_name_or_path=alice/tiny-qwen3"),
                                                       cpu_hardware()).id)
        assert view.live_state == "finished", view.error_text
        weights = len(standin.repos["alice/tiny-qwen3"]["files"]["model.safetensors"])
        assert view.download["model"] == "alice/tiny-qwen3"
        assert view.download["done_bytes"] == view.download["total_bytes"] >= weights
        assert list((tmp_path / "empty-hub-cache").glob("models--alice--tiny-qwen3/snapshots/*/model.safetensors"))
