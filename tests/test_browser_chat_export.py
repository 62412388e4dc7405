"""A trained run in a real browser: chatted with side by side with its base model, then
unloaded, and served to the openai client from the Chat tab; evaluated against its base
(progress, scores, the rows where it got worse, the rows downloaded, bad input refused) and the
evaluation listed in the Runs tab, where the run was open meanwhile; exported with its
card and pushed to a stand-in for the Hub, the typed token kept out of every file.

The Doctor tab runs its checks for real on this machine.

The run is the session's shared full SFT run (conftest's sft_runs), copied into the app's runs
folder. Chromium through Playwright, the app as its own process (tests/studio_browser.py);
skipped, saying so, where Chromium is missing.
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

import pytest

from studio_browser import app, app_env, browser, new_page, page, pytestmark, runs_dir  # noqa: F401 (fixtures)
from studio_browser import App, broken_header_words, expect


def full_run(app, sft_runs) -> str:
    """The shared full SFT run in the app's runs folder (copied by the first test of this file that asks)."""
    run_id = sft_runs.ids["full"]
    if not (app.runs_dir / run_id).exists():
        sft_runs.copy_to(app.runs_dir, "full")
    return run_id


def load_in_chat(page, run_id: str) -> None:
    """The Chat tab opened and `run_id` loaded in it."""
    page.get_by_role("tab", name="Chat").click()
    target = page.locator("#chat-target input").first
    target.fill(run_id)
    target.press("Enter")
    page.locator("#chat-load").click()
    page.locator("#chat-status").get_by_text(re.compile(r"^Loaded ")).wait_for(timeout=120_000)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def pick(page, elem_id: str, option: str) -> None:
    """Choose an option of a dropdown."""
    page.locator(f"#{elem_id} input").first.click()
    page.get_by_role("option", name=option).click()


def frame_cells(table) -> list[dict]:
    """A gr.Dataframe's rows as {header: cell text} (the rows it drew: a long one draws those in view)."""
    return table.evaluate("""el => {
        const heads = [...el.querySelectorAll('[role=columnheader]')].map(th => th.innerText.trim());
        const rows = [...el.querySelectorAll('[role=row]')].filter(row => row.querySelector('[role=gridcell]'));
        return rows.map(row => Object.fromEntries(
            [...row.querySelectorAll('[role=gridcell]')].map((cell, i) => [heads[i], cell.innerText.trim()])));
    }""")


def test_chat_with_a_trained_run_side_by_side_then_unload(page, app, sft_runs):
    import openai

    run_id = full_run(app, sft_runs)
    load_in_chat(page, run_id)
    expect(page.locator("#chat-status")).to_contain_text("The base model is untrained")  # the random built-in
    expect(page.locator("#chat-history-note")).to_contain_text("The model sees the whole conversation; Clear to")
    page.locator("#chat-compare input").check()
    box = page.locator("#chat-input textarea").first
    box.fill("What is the name of the studio cat?")
    box.press("Enter")
    tuned, base = page.locator("#chat-tuned"), page.locator("#chat-base")
    expect(tuned).to_contain_text("The studio cat is called Pixel.", timeout=60_000)
    page.locator("#chat-shapes").get_by_text("distinct input shapes").wait_for(timeout=60_000)
    expect(base).to_contain_text("What is the name of the studio cat?")
    # the random base's answer, or the placeholder if it wrote only whitespace: never an empty bubble
    # (the base side may still be drawing it when the tuned side's shapes show: Playwright waits)
    expect(base).to_contain_text(re.compile(r"What is the name of the studio cat\?\s*\S"), use_inner_text=True,
                                 timeout=60_000)
    expect(base).to_contain_text("untrained")  # its label

    # Serve: the loaded model behind OpenAI's API, asked by the real openai client
    page.locator("#serve-box").get_by_text("Serve: the loaded model").click()
    page.locator("#serve-port input").fill(str(free_port()))
    page.locator("#serve-engine").get_by_text("The studio's engine").click()  # vLLM's: tests/test_vllm.py
    page.locator("#serve-on input").check()
    served = page.locator("#serve-status").get_by_text(re.compile(r"^Serving "))
    served.wait_for(timeout=30_000)
    url = re.search(r"http://127\.0\.0\.1:\d+/v1", served.inner_text()).group(0)
    expect(page.locator("#serve-snippet")).to_contain_text(f'base_url="{url}"')
    reply = openai.OpenAI(base_url=url, api_key="none", max_retries=0).chat.completions.create(
        model=run_id, messages=[{"role": "user", "content": "What is the name of the studio cat?"}], max_tokens=32,
        temperature=0)
    assert reply.choices[0].message.content == "The studio cat is called Pixel."
    page.locator("#chat-unload").click()
    page.locator("#chat-status").get_by_text(re.compile(r"^Unloaded: ")).wait_for(timeout=60_000)
    expect(page.locator("#serve-status")).to_have_text("Not served.")
    with pytest.raises(openai.APIConnectionError):  # unloading ended the endpoint too
        openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=10).models.list()


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


def test_evaluate_a_trained_run_against_its_base(page, app, sft_runs, tmp_path):
    run_id = full_run(app, sft_runs)
    evals = app.runs_dir / run_id / "eval"
    page.get_by_role("tab", name="Runs").click()  # opened there before it is evaluated
    pick(page, "open-run", run_id)
    expect(page.locator("#run-evals")).to_contain_text("none yet")
    page.get_by_role("tab", name="Evaluate").click()
    pick(page, "eval-run", run_id)
    message, progress = page.locator("#eval-message"), page.locator("#eval-progress")
    expect(message).to_contain_text("No evaluation of this run yet")
    # bad input: said in the tab, and nothing started (exact_match asked for: it needs a reference)
    page.locator("#eval-metric-exact_match input").check()
    no_reference = tmp_path / "prompts.jsonl"
    no_reference.write_text(json.dumps({"prompt": "What is the name of the studio cat?"}) + "\n")
    data = page.locator("#eval-data textarea, #eval-data input").first
    for bad, said in ((no_reference, "compare with a reference answer"), (tmp_path / "none.jsonl", "not found")):
        data.fill(str(bad))
        page.locator("#eval-start").click()
        expect(message).to_contain_text("Not started", timeout=30_000)
        expect(message).to_contain_text(said)
        expect(progress).to_have_text("")
        expect(page.locator("#eval-stop")).to_be_disabled()
        assert not evals.exists()
    data.fill("")
    page.locator("#eval-metric-exact_match input").uncheck()

    # one evaluation of 4 rows on the run's own data, every metric that applies: progress, then the scores
    page.locator("#eval-limit input").fill("4")
    page.locator("#eval-start").click()
    # counted in rows, each answered by both models (it said "8 of 8 answers (base)" for 4 rows)
    expect(progress).to_contain_text(re.compile(r"Rows answered: tuned model \d of 4"), timeout=120_000)
    expect(progress).to_contain_text("Rows answered: tuned model 4 of 4, base model 4 of 4: done", timeout=120_000)
    expect(page.locator("#eval-start")).to_be_enabled()
    expect(page.locator("#eval-stop")).to_be_disabled()
    expect(message).to_have_text("")
    scores = {row["metric"]: row for row in frame_cells(page.locator("#eval-summary"))}
    assert float(scores["exact_match"]["tuned"]) >= 0.75 and float(scores["exact_match"]["base"]) <= 0.25, scores
    expect(page.locator("#eval-info")).to_contain_text("the run's training data")
    expect(page.locator("#eval-info")).to_contain_text("distinct input shapes")
    rows = frame_cells(page.locator("#eval-rows"))
    assert len(rows) == 4 and all(row["prompt"] and row["reference"] for row in rows), rows
    for table in ("#eval-summary", "#eval-rows"):  # a header wraps between its words, never inside one
        assert broken_header_words(page.locator(table)) == [], table
    assert {"exact_match (base)", "exact_match (tuned)", "rouge_l (tuned)"} <= set(rows[0]), rows[0]
    page.locator("#eval-worse input").check()
    expect(page.locator("#eval-count")).to_contain_text("0 of 4 rows")
    assert frame_cells(page.locator("#eval-rows")) == []
    page.locator("#eval-worse input").uncheck()
    expect(page.locator("#eval-count")).to_have_text("4 rows.")
    if os.environ.get("STUDIO_SCREENSHOTS"):
        page.set_viewport_size({"width": 1400, "height": 900})
        page.locator("#eval-start").evaluate("e => e.scrollIntoView({block: 'start'})")
        page.screenshot(path=os.environ["STUDIO_SCREENSHOTS"] + "/eval.png")
    with page.expect_download() as download:
        page.locator("#eval-download").click()
    lines = Path(download.value.path()).read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(line)["tuned"]["answer"] and "answer" in json.loads(line)["base"]
                                   for line in lines)
    [saved] = list(evals.iterdir())

    # the Runs tab, where the run was open all along, lists it (its timer); a fresh page shows it
    # without running anything
    page.get_by_role("tab", name="Runs").click()
    listing = page.locator("#run-evals")
    expect(listing).to_contain_text("builtin:qa")
    tuned = json.loads((saved / "summary.json").read_text())["results"]["tuned"]["exact_match"]
    expect(listing).to_contain_text(f"exact_match {tuned:.4g}")
    page.reload()
    page.locator("#start").wait_for()
    page.get_by_role("tab", name="Evaluate").click()
    pick(page, "eval-run", run_id)
    expect(page.locator("#eval-count")).to_have_text("4 rows.")
    assert list(evals.iterdir()) == [saved]


def test_the_chat_tab_serves_two_lora_runs_of_one_base_together(page, app, sft_runs):
    import openai

    from test_serve_adapters import blank_copy

    sft_runs.copy_to(app.runs_dir, "lora")
    lora = sft_runs.ids["lora"]
    blank = blank_copy(app.runs_dir, lora)
    load_in_chat(page, lora)
    page.locator("#serve-box").get_by_text("Serve: the loaded model").click()
    page.locator("#serve-port input").fill(str(free_port()))
    page.locator("#serve-engine").get_by_text("The studio's engine").click()  # vLLM's: tests/test_vllm.py
    also = page.locator("#serve-also input").first
    also.click()
    page.get_by_role("option", name=blank, exact=True).click(timeout=30_000)
    page.locator("#serve-on input").check()
    served = page.locator("#serve-status").get_by_text(re.compile(r"^Serving "))
    served.wait_for(timeout=120_000)
    expect(served).to_contain_text("2 runs on one base")
    url = re.search(r"http://127\.0\.0\.1:\d+/v1", served.inner_text()).group(0)
    api = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    assert [m.id for m in api.models.list().data] == [lora, blank]
    answers = {model: api.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is the "
               "name of the studio cat?"}], max_tokens=32, temperature=0).choices[0].message.content
               for model in (lora, blank)}
    assert answers[lora] == "The studio cat is called Pixel." and answers[blank] != answers[lora]
    page.locator("#serve-on input").uncheck()
    expect(page.locator("#serve-status")).to_have_text("Not served.", timeout=60_000)
    with pytest.raises(openai.APIConnectionError):  # the server and its process have ended
        openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=10).models.list()
