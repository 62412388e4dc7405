"""Data and models in a real browser: uploads kept under their own names, a dataset that does
not fit fixed in one click (and trained on), a stray prompt column dropped in one click, and a
model that reaches the Hugging Face cache while the page is open offered at once.

Chromium through Playwright, the app as its own process, one app for this file, with a Hugging
Face cache of its own, empty at first (tests/studio_browser.py); skipped, saying so, where Chromium
is missing.
"""

from __future__ import annotations

import json
import os

import pytest

from studio_browser import app, browser, new_page, page, pytestmark  # noqa: F401 (fixtures)
from studio_browser import check_dataset_in_page, expect, run_state, set_number


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("hub-cache")


@pytest.fixture(scope="module")
def app_env(hub_cache):
    """The app reads this file's own Hugging Face cache, where a test makes a download land."""
    return {**os.environ, "HF_HUB_CACHE": str(hub_cache)}


def test_an_uploaded_dataset_is_kept_and_a_second_one_of_that_name_does_not_replace_it(new_page, app, tmp_path):
    uploads = app.runs_dir / "uploads"  # no other test here uploads
    chat = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    for number, expected in ((1, uploads / "mine.jsonl"), (2, uploads / "mine-1.jsonl")):
        page = new_page(app.url)  # a page of its own: as two people (or two tabs) upload
        page.get_by_text("Dataset: upload, Hub options, preview, column mapping").click()
        dataset = page.locator("#dataset input").first
        (tmp_path / str(number)).mkdir()
        upload = tmp_path / str(number) / "mine.jsonl"
        upload.write_text("".join(json.dumps(chat) + "\n" for _ in range(number)))
        page.locator("#upload input[type=file]").set_input_files(str(upload))
        expect(dataset).to_have_value(str(expected), timeout=30_000)
        assert expected.read_bytes() == upload.read_bytes()
    assert len((uploads / "mine.jsonl").read_text().splitlines()) == 1  # the first upload is unchanged


def test_a_dataset_that_does_not_fit_gets_a_one_click_fix(page, app, tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text('{"question": "What colour is the mascot?", "answer": "Teal."}\n' * 8)
    report = check_dataset_in_page(page, data)
    expect(report).to_contain_text("Does not fit this trainer")
    expect(report).to_contain_text("map question to prompt, answer to completion")
    page.locator("#apply-fix").click()
    expect(report).to_contain_text("Fits SFT")
    set_number(page, "max_steps", 5)
    page.locator("#start").click()
    run_state(page, "FINISHED").wait_for(timeout=120_000)
    [view] = app.new_runs()
    assert view.spec["studio"]["column_map"] == {"question": "prompt", "answer": "completion"}


def test_a_stray_prompt_beside_messages_gets_a_one_click_keep_columns_fix(page, tmp_path):
    # As HuggingFaceH4/ultrachat_200k: a string `prompt` beside `messages` makes TRL read prompts
    chat = [{"role": "user", "content": "What colour is the mascot?"}, {"role": "assistant", "content": "Teal."}]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"prompt": chat[0]["content"], "messages": chat}) + "\n" for _ in range(8)))
    report = check_dataset_in_page(page, data)
    expect(report).to_contain_text("Does not fit this trainer")
    expect(report).to_contain_text("prompt beside messages")
    expect(report).to_contain_text("Suggested fix: keep only messages")
    page.locator("#apply-fix").click()
    keep = page.locator("#keep_columns textarea, #keep_columns input").first
    expect(keep).to_have_value("messages")
    expect(report).to_contain_text("Fits SFT")
    page.locator("#check-dataset").click()  # and checked again by hand: clean, nothing left to apply
    expect(report).to_contain_text("Fits SFT")
    expect(page.locator("#apply-fix")).to_be_hidden()
    assert "Does not fit" not in report.inner_text()


def test_a_model_that_reaches_the_hub_cache_while_the_page_is_open_is_listed(page, hub_cache):
    # the page is open; then a download lands, laid out as huggingface_hub writes it: blob, snapshot link, ref
    repo, revision = hub_cache / "models--alice--tiny-chat", "0123456789abcdef0123456789abcdef01234567"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "c0ffee").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    (repo / "snapshots" / revision).mkdir(parents=True)
    (repo / "snapshots" / revision / "config.json").symlink_to(repo / "blobs" / "c0ffee")
    (repo / "blobs" / "beef").write_bytes(b"")  # its weights: a model whose config alone is cached is not listed
    (repo / "snapshots" / revision / "model.safetensors").symlink_to(repo / "blobs" / "beef")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    page.locator("#model input").first.click()  # opening the list reads the cache again
    page.get_by_role("option", name="alice/tiny-chat").wait_for(timeout=15_000)
