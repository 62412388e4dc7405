"""A trained run in a real browser: chatted with side by side with its base model, then
unloaded; exported with its card and pushed to a stand-in for the Hub, the typed token kept
out of every file.

The Doctor tab runs its checks for real on this machine.

The run is the session's shared full SFT run (conftest's sft_runs), copied into the app's runs
folder. Chromium through Playwright, the app as its own process (tests/studio_browser.py);
skipped, saying so, where Chromium is missing.
"""

from __future__ import annotations

import os
import re

from studio_browser import app, app_env, browser, new_page, page, pytestmark, runs_dir  # noqa: F401 (fixtures)
from studio_browser import App, expect
from studio_core.chat import EMPTY_ANSWER


def test_chat_with_a_trained_run_side_by_side_then_unload(page, app, sft_runs):
    sft_runs.copy_to(app.runs_dir, "full")
    run_id = sft_runs.ids["full"]
    page.get_by_role("tab", name="Chat").click()
    target = page.locator("#chat-target input").first
    target.fill(run_id)
    target.press("Enter")
    page.locator("#chat-load").click()
    page.locator("#chat-status").get_by_text(re.compile(r"^Loaded ")).wait_for(timeout=120_000)
    expect(page.locator("#chat-status")).to_contain_text("The base model is untrained")  # the random built-in
    page.locator("#chat-compare input").check()
    box = page.locator("#chat-input textarea").first
    box.fill("What is the name of the studio cat?")
    box.press("Enter")
    tuned, base = page.locator("#chat-tuned"), page.locator("#chat-base")
    expect(tuned).to_contain_text("The studio cat is called Pixel.", timeout=60_000)
    page.locator("#chat-shapes").get_by_text("distinct input shapes").wait_for(timeout=60_000)
    expect(base).to_contain_text("What is the name of the studio cat?")
    expect(base).to_contain_text(EMPTY_ANSWER)  # it wrote only whitespace: said so, not an empty bubble
    expect(base).to_contain_text("untrained")  # its label
    page.locator("#chat-unload").click()
    page.locator("#chat-status").get_by_text(re.compile(r"^Unloaded: ")).wait_for(timeout=60_000)


def test_export_and_push_to_the_hub_from_the_page(new_page, runs_dir, sft_runs):
    from hub_standin import HubStandIn

    token = "hf_browser_push_token_0123456789"
    sft_runs.copy_to(runs_dir, "full")
    run_id = sft_runs.ids["full"]
    with HubStandIn(tokens={token: {"user": "alice", "orgs": []}}) as standin:
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_TOKEN")}
        server = App(runs_dir, env=env | {"HF_ENDPOINT": standin.url, "HF_HUB_DISABLE_XET": "1"})  # its Hub
        try:
            page = new_page(server.url)
            page.get_by_role("tab", name="Export").click()
            choice = page.locator("#export-run input").first
            choice.click()
            page.get_by_role("option", name=run_id).click()
            expect(page.locator("#export-folder textarea, #export-folder input").first
                   ).to_have_value(re.compile(re.escape(run_id)))
            page.locator("#export-run-button").click()
            page.locator("#export-status").get_by_text("Exported the full model").wait_for(timeout=120_000)
            page.locator("#push-repo input, #push-repo textarea").first.fill("alice/from-the-browser")
            page.locator("#push-token input, #push-token textarea").first.fill(token)
            page.locator("#push").click()
            page.locator("#push-status").get_by_text("Pushed (private)").wait_for(timeout=120_000)
            link = page.locator("#push-status a").first.get_attribute("href")
            assert link == f"{standin.url}/alice/from-the-browser"
            folder = runs_dir / "exports" / run_id
            local = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
            pushed = dict(standin.repos["alice/from-the-browser"]["files"])
            card = pushed.pop("README.md").decode()  # the card pushed names its repo (the local one a placeholder)
            assert 'repo_id = "alice/from-the-browser"' in card and local.pop("README.md") != card.encode()
            assert pushed == local
        finally:
            server.kill()
        # the typed token went nowhere: not in the runs folder (runs, exports), not in the app's log
        for path in [*runs_dir.rglob("*"), server.log_path]:
            assert not path.is_file() or token.encode() not in path.read_bytes(), path


def test_the_doctor_tab_checks_this_machine_as_the_cli_does(page):
    page.get_by_role("tab", name="Doctor").click()
    page.locator("#doctor-run").click()
    results = page.locator("#doctor-results")
    expect(results).to_contain_text("Checking ...", timeout=30_000)  # each check shows as it finishes
    expect(results).to_contain_text("All checks passed.", timeout=300_000)
    text = results.inner_text()
    for name in ("backend", "versions", "torch_xla", "devices", "collective", "compile", "cache", "monitor",
                 "runs folder", "hub"):
        assert re.search(rf"PASS\s+{name}\s", text), f"{name} not shown as passed:\n{text}"
    assert "sum 3.0" in text and "from the cache" in text and "offline (HF_HUB_OFFLINE=1)" in text
    expect(page.locator("#doctor-run")).to_be_enabled()
