"""A Hub dataset in a run: downloaded with progress, checked on its first rows before the model loads.

Datasets are published to HubStandIn (a local stand-in for the Hub) and real runs of the tiny
model name them by Hub id, config and split; the real `datasets` and `huggingface_hub` clients
resolve and download them into an empty Hugging Face cache.
"""

from __future__ import annotations

import json

from huggingface_hub import HfApi

from conftest import launch_py, run_folders
from hub_standin import HubStandIn
from studio_core.data.builtin import ensure_tiny_model
from studio_core.machine.hardware import cpu_hardware
from studio_core.runs.manager import RunManager
from studio_core.recipe.spec import RunSpec
from studio_core.recipe.validate import validate
from test_hub_download import TOKEN, hub  # noqa: F401 (fixture: the stand-in, an empty Hub cache)
from test_runs import REPO, TINY, tiny

CHATS = [{"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                       {"role": "assistant", "content": f"{i + 1}."}]} for i in range(12)]
# a dataset card declaring a config whose splits are not called train/test, as ultrachat_200k's
CARD = """---
configs:
- config_name: sft
  data_files:
  - split: train_sft
    path: sft/train_sft-*.parquet
  - split: test_sft
    path: sft/test_sft-*.parquet
---
# Sums, for tests
"""


def publish(hub: HubStandIn, repo_id: str, files: dict[str, bytes | list[dict]], tmp_path) -> None:
    """A dataset repo with these files; a list of rows becomes a Parquet file."""
    folder = tmp_path / "publish" / repo_id
    for path, content in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, list):
            import pyarrow as pa  # here, not at the top: collecting the tests imports no pyarrow
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(content), folder / path)
        else:
            (folder / path).write_bytes(content)
    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo(repo_id, repo_type="dataset")
    api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="dataset")


def publish_tiny_model(hub: HubStandIn) -> None:
    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo("alice/tiny-qwen3")
    api.upload_folder(folder_path=str(ensure_tiny_model()), repo_id="alice/tiny-qwen3")


def resolved(hub: HubStandIn, repo_id: str) -> list[str]:
    """The files of a repo that were downloaded (GET), by path; a part of one read by range (a
    safetensors header, read before launch) is not a download."""
    return [r.path.split("/resolve/", 1)[1].split("/", 1)[1] for r in hub.requests
            if r.method == "GET" and f"{repo_id}/resolve/" in r.path
            and not any(key.lower() == "range" for key in r.headers)]


def test_a_hub_dataset_split_is_downloaded_with_progress_and_trains(hub, tmp_path):
    publish(hub, "alice/sums", {"README.md": CARD.encode(), "sft/train_sft-00000-of-00001.parquet": CHATS,
                                "sft/test_sft-00000-of-00001.parquet": CHATS[:3]}, tmp_path)
    choice = ["dataset_name=alice/sums", "dataset_config=sft", "dataset_train_split=train_sft"]
    assert validate(tiny(*choice)) == []

    runs_dir = tmp_path / "runs"  # through `launch.py train`, which shows the download's bytes
    done = launch_py("train", str(TINY), "--runs-dir", str(runs_dir), "--backend", "cpu",
                     "--set", "max_steps=2", *[a for pair in zip(["--set"] * 3, choice) for a in pair])
    (run_dir,) = run_folders(runs_dir)
    view = RunManager(runs_dir).view(run_dir.name)
    assert done.returncode == 0 and view.live_state == "finished", view.error_text or done.stderr
    size = len(hub.datasets["alice/sums"]["files"]["sft/train_sft-00000-of-00001.parquet"])
    assert view.download == {**view.download, "dataset": "alice/sums", "done_bytes": size, "total_bytes": size}
    assert "downloading dataset alice/sums: 100%" in done.stderr, done.stderr
    # the card (read to find the config's files) and the train split's file, not the test split's
    assert sorted(resolved(hub, "alice/sums")) == ["README.md", "sft/train_sft-00000-of-00001.parquet"]
    assert view.step == 2


def test_a_hub_dataset_that_does_not_fit_fails_before_the_model_is_fetched(hub, manager, tmp_path):
    # a stray string `prompt` beside `messages`: TRL would read prompt-completion pairs and miss the chats
    rows = [{**row, "prompt": "unused"} for row in CHATS]
    publish(hub, "alice/stray", {"data/train.parquet": rows}, tmp_path)
    publish_tiny_model(hub)
    spec = tiny("max_steps=2", "dataset_name=alice/stray", "model_name_or_path=alice/tiny-qwen3")
    assert validate(spec) == []  # not read before launch: the run checks it

    view = manager.wait(manager.start(spec, cpu_hardware()).id)
    assert view.live_state == "failed"
    # the same lines the check before launch gives for the same rows in a local file
    local = tmp_path / "stray.jsonl"
    local.write_text("".join(json.dumps(row) + "\n" for row in rows))
    expected = validate(tiny(f"dataset_name={local}"))
    assert expected and all(line in view.error_text for line in expected), view.error_text
    assert "studio.keep_columns: [messages]" in view.error_text
    assert resolved(hub, "alice/tiny-qwen3") == ["config.json"]  # fetched before launch; no weights
    assert view.started is None and view.step == 0


def test_a_hub_dataset_missing_the_columns_names_the_fix(hub, manager, tmp_path):
    rows = [{"question": f"{i} + 1?", "answer": f"{i + 1}"} for i in range(6)]
    publish(hub, "alice/qa", {"data/train.jsonl": "".join(json.dumps(r) + "\n" for r in rows).encode()}, tmp_path)
    view = manager.wait(manager.start(tiny("max_steps=2", "dataset_name=alice/qa"), cpu_hardware()).id)
    assert view.live_state == "failed"
    assert "studio.column_map: {question: prompt, answer: completion}" in view.error_text, view.error_text


REWARD_FILE = '''
def reads_the_completion_column(completions, completion, **kwargs):
    return [float(len(c) == len(ref)) for c, ref in zip(completions, completion)]


def reads_a_column_that_is_not_there(completions, reference, **kwargs):
    return [0.0 for _ in completions]
'''


def grpo_spec(dataset: str, function: str, rewards_file) -> RunSpec:
    return RunSpec.load(REPO / "recipes" / "tiny-grpo.yaml").with_overrides(
        ["max_steps=1", f"dataset_name={dataset}",
         f"studio.rewards=[{{file: {rewards_file}, function: {function}}}]"])


def test_grpo_rewards_on_a_hub_dataset_are_called_on_its_real_rows_in_the_run(hub, manager, tmp_path):
    rows = [{"prompt": f"Summarise: post {i}", "completion": f"summary {i}"} for i in range(8)]
    publish(hub, "alice/tldr", {"data/train.parquet": rows}, tmp_path)
    rewards_file = tmp_path / "my_rewards.py"
    rewards_file.write_text(REWARD_FILE)
    # before launch the file is imported and its functions looked up, not called on made-up rows
    assert validate(grpo_spec("alice/tldr", "reads_the_completion_column", rewards_file)) == []
    missing = validate(grpo_spec("alice/tldr", "no_such_function", rewards_file))
    assert len(missing) == 1 and "has no 'no_such_function'" in missing[0]

    spec = grpo_spec("alice/tldr", "reads_a_column_that_is_not_there", rewards_file)
    assert validate(spec) == []
    view = manager.wait(manager.start(spec, cpu_hardware()).id)
    assert view.live_state == "failed" and view.started is None
    assert "studio.rewards[0] (" in view.error_text and "calling it on 5 sample rows raised TypeError" in \
        view.error_text, view.error_text
