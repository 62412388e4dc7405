"""Tests for the offline built-in model and datasets (studio_core.data.builtin)."""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


from studio_core.data import builtin  # noqa: E402
from studio_core.data.builtin import (  # noqa: E402
    BUILTIN_DATASETS,
    BUILTIN_MODEL,
    TINY_MODEL_FOLDER,
    cache_dir,
    ensure_tiny_model,
)

pytestmark = pytest.mark.fast  # starts no run, torchrun, browser or app: in `pytest -m fast`

SAMPLE = [
    {"role": "system", "content": "You are a friendly assistant."},
    {"role": "user", "content": "What colour is the studio mascot?"},
    {"role": "assistant", "content": "The studio mascot is teal."},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("cache") / "tiny-qwen3")


def test_public_names():
    assert BUILTIN_MODEL == "builtin:tiny-qwen3"
    assert set(BUILTIN_DATASETS) == {"builtin:qa", "builtin:chat", "builtin:preference",
                                     "builtin:feedback", "builtin:prompts", "builtin:wide",  # wide: test_wide_sample
                                     "builtin:shapes"}  # images: test_vlm_data


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("STUDIO_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path


def test_default_root_under_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("STUDIO_CACHE_DIR", str(tmp_path))
    assert ensure_tiny_model() == tmp_path / "models" / TINY_MODEL_FOLDER


def test_folder_reloads_offline(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (model_dir / "config.json").is_file()
    assert (model_dir / "model.safetensors").is_file()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.model_type == "qwen3"
    assert model.config.vocab_size == len(tokenizer)
    from studio_core.data.sources import model_config  # what the plan knows of it without building it
    from studio_core.training.memory import read_shape

    assert read_shape(model_config("builtin:tiny-qwen3"))[0].params() == model.num_parameters()
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


def test_special_tokens(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    markers = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    ids = []
    for marker in markers:
        encoded = tokenizer.encode(marker, add_special_tokens=False)
        assert len(encoded) == 1, marker
        assert tokenizer.decode(encoded) == marker
        ids.append(encoded[0])
    assert len(set(ids)) == len(markers)
    assert ids[2] == tokenizer.eos_token_id
    assert ids[0] == tokenizer.pad_token_id


def test_chat_template(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(SAMPLE, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a friendly assistant.<|im_end|>\n")
    assert text.endswith("The studio mascot is teal.<|im_end|>\n")
    full = tokenizer.apply_chat_template(SAMPLE, tokenize=True, return_dict=True)["input_ids"]
    # The generation prompt must tokenize as an exact prefix of the training sequence.
    prompt = tokenizer.apply_chat_template(
        SAMPLE[:-1], add_generation_prompt=True, enable_thinking=False, tokenize=True, return_dict=True
    )["input_ids"]
    assert full[: len(prompt)] == prompt
    assert tokenizer.decode(full[len(prompt):]) == "The studio mascot is teal.<|im_end|>\n"


def test_second_call_reuses_folder(model_dir):
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert ensure_tiny_model(model_dir) == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before


def test_build_is_deterministic(model_dir, tmp_path):
    other = ensure_tiny_model(tmp_path / "tiny-qwen3")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (other / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_losing_a_build_race_uses_the_winners_folder(monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM

    root = tmp_path / "tiny-qwen3"
    real_build = builtin._build

    def build_while_another_process_wins(folder):
        real_build(root)  # the "other process" finishes first
        real_build(folder)

    monkeypatch.setattr(builtin, "_build", build_while_another_process_wins)
    assert ensure_tiny_model(root) == root
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-qwen3"]  # our temp folder is gone
    AutoModelForCausalLM.from_pretrained(root)


def test_concurrent_builds_leave_one_complete_folder(tmp_path):
    from transformers import AutoModelForCausalLM

    root = tmp_path / "tiny-qwen3"
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(ensure_tiny_model, [root, root]))
    assert results == [root, root]
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-qwen3"]  # no temp folders left
    AutoModelForCausalLM.from_pretrained(root)


@pytest.mark.parametrize("name", builtin.CORPUS_DATASETS)  # the others: tests/test_data_check.py
def test_datasets_load(name):
    from datasets import load_dataset

    ds = load_dataset("json", data_files=str(BUILTIN_DATASETS[name]), split="train")
    assert "messages" in ds.column_names
    assert len(ds) >= 10
    for row in ds:
        roles = [m["role"] for m in row["messages"]]
        assert roles[-1] == "assistant"
        assert set(roles) <= {"system", "user", "assistant"}


MAKER = """
import sys, time
from pathlib import Path
from studio_core.machine.cache import one_maker
made = Path(sys.argv[1])
with one_maker("thing"):
    print("found" if made.exists() else "made", flush=True)
    if not made.exists():
        Path(sys.argv[2]).touch()  # inside: the other may start now
        time.sleep(1.5)
        made.write_text("x")
"""


def test_processes_that_ask_together_for_a_cached_thing_make_it_once(tmp_path):
    """The built-in model, the wide sample and TRL's fields were made by every process that asked
    while none was there yet (a test session's two workers both read TRL at their start)."""
    import subprocess
    import sys
    import time

    from conftest import REPO

    env = {**os.environ, "STUDIO_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    made, inside = tmp_path / "made", tmp_path / "inside"
    first = subprocess.Popen([sys.executable, "-c", MAKER, str(made), str(inside)], env=env, stdout=subprocess.PIPE,
                             text=True)
    deadline = time.monotonic() + 60
    while not inside.exists():
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    second = subprocess.run([sys.executable, "-c", MAKER, str(made), str(inside)], env=env, capture_output=True,
                            text=True, timeout=60)
    assert first.communicate(timeout=60)[0].split() == ["made"]
    assert second.stdout.split() == ["found"], second.stderr
