"""Runs in a real browser beyond the Train tab: the Runs tab compares two finished runs (curves
overlaid, the settings that differ), clones one into the Train form and deletes one after one
confirmation; a sweep's runs, whose ids begin the same, told apart in the compare plot's legend,
and its tables' headers wrapped between words, never inside one; its compile cache panel shows the
cache, refuses to clear it while a real run goes and clears it once the run has stopped (what a
real compile leaves in the cache is checked in test_compile_cache.py); a run survives the page
closing and the app restarting, and a page of the new app follows it, stops and saves it, and
after a reload resumes it from the Runs tab (its cores held first: the resume is queued, then
cancelled, and the run is as it was).

The compared runs are the session's history_runs (conftest), copied into the app's runs folder, and
a real sweep of two runs made in it. Chromium through Playwright, the app as its own process, one
app for this file, with a compile cache of its own (tests/studio_browser.py); skipped, saying so,
where Chromium is missing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from studio_browser import app, browser, new_page, page, pytestmark, runs_dir  # noqa: F401 (fixtures)
from studio_browser import ROOT, App, broken_header_words, expect, run_state, set_number
from studio_core.machine import leases
from studio_core.machine.hardware import cpu_hardware
from studio_core.runs.manager import RunManager
from studio_core.recipe.spec import RunSpec

SLOW = 30_000  # ms: the page waits on the app, which shares two cores with whatever else runs


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """This file's compile cache, holding one 2 KB Inductor entry before the app starts (the
    panel shows the cache as the app found it at its start, until Refresh)."""
    root = tmp_path_factory.mktemp("compile-cache")
    entry = root / "cpu" / "inductor" / "fxgraph" / "ab" / "key" / "entry"
    entry.parent.mkdir(parents=True)
    entry.write_bytes(b"x" * 2048)
    return root


@pytest.fixture(scope="module")
def app_env(compile_cache):
    """The app (and every run it starts) uses this file's own compile cache."""
    return {**os.environ, "STUDIO_COMPILE_CACHE": str(compile_cache)}


def pick(page, elem_id: str, option: str) -> None:
    page.locator(f"#{elem_id} input").first.click()
    page.get_by_role("option", name=option, exact=True).click(timeout=SLOW)


def test_the_runs_tab_shows_and_clears_the_compile_cache(page, app, compile_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("STUDIO_COMPILE_CACHE", str(compile_cache))  # the run started below uses it too
    entry = compile_cache / "cpu" / "inductor" / "fxgraph" / "ab" / "key" / "entry"
    page.get_by_role("tab", name="Runs").click()
    page.get_by_text("Compile cache").click()
    panel = page.locator("#compile-cache")
    expect(panel).to_contain_text(str(compile_cache / "cpu"))
    expect(panel).to_contain_text("Inductor FX graphs")
    expect(panel).to_contain_text("2.0 KB")
    page.screenshot(path=str(tmp_path / "compile-cache.png"), full_page=True)

    spec = RunSpec.load(ROOT / "recipes" / "tiny-sft.yaml").with_overrides(["max_steps=3000"])
    manager = RunManager(app.runs_dir)
    view = manager.start(spec, cpu_hardware())
    page.locator("#clear-compile-cache").click()
    expect(panel).to_contain_text("Not cleared")
    expect(panel).to_contain_text(view.id)
    assert entry.exists()

    manager.stop(view.id)
    page.locator("#clear-compile-cache").click()
    expect(panel).to_contain_text("Cleared.")
    expect(panel).to_contain_text("0 B")
    assert not entry.exists()


def test_compare_clone_and_delete_runs(new_page, app, history_runs, tmp_path):
    history_runs.copy_to(app.runs_dir, "sft-a", "sft-b")  # they differ in learning rate, run name, max_grad_norm
    a, b = history_runs.ids["sft-a"], history_runs.ids["sft-b"]
    page = new_page(app.url)
    page.get_by_role("tab", name="Runs").click()
    table = page.locator("#runs-table")
    expect(table).to_contain_text(a, timeout=SLOW)
    expect(table).to_contain_text(b, timeout=SLOW)
    expect(table).to_contain_text("KB", timeout=SLOW)  # the size column

    # filters: no run is running, then every run again
    pick(page, "filter-state", "running")
    expect(table).not_to_contain_text(a, timeout=SLOW)
    pick(page, "filter-state", "all")
    expect(table).to_contain_text(a, timeout=SLOW)

    # compare: both curves in one plot, each run's last loss, only the settings that differ
    page.get_by_text("Compare runs").click()
    pick(page, "compare-runs", a)
    pick(page, "compare-runs", b)
    last = page.locator("#compare-last")
    expect(last).to_contain_text("last loss", timeout=SLOW)
    expect(last).to_contain_text(a, timeout=SLOW)
    expect(last).to_contain_text(b, timeout=SLOW)
    plot = page.locator("#compare-plot")
    expect(plot.locator("svg").first).to_be_visible(timeout=SLOW)
    expect(plot).to_contain_text(a[-20:], timeout=SLOW)  # the legend: one line per run, its id's end
    expect(plot).to_contain_text(b[-20:], timeout=SLOW)
    diff = page.locator("#compare-diff")
    for setting in ("learning_rate", "max_grad_norm", "run_name"):
        expect(diff).to_contain_text(setting, timeout=SLOW)
    assert "model_name_or_path" not in diff.inner_text() and "use_cpu" not in diff.inner_text()
    page.screenshot(path=str(tmp_path / "compare.png"), full_page=True)
    pick(page, "compare-metric", "learning_rate")
    expect(last).to_contain_text("last learning_rate", timeout=SLOW)

    # clone: the run's settings land in the Train form, and the Train tab opens
    pick(page, "open-run", b)
    page.locator("#clone-run").click()
    expect(page.locator("#run_name input, #run_name textarea").first).to_have_value("tiny-sft-b", timeout=SLOW)
    expect(page.locator("#max_steps input").first).to_have_value("20", timeout=SLOW)
    expect(page.locator("#learning_rate input").first).to_have_value("0.0001", timeout=SLOW)
    expect(page.locator("#logging_steps input").first).to_have_value("5", timeout=SLOW)
    expect(page.locator("#extra .cm-content")).to_contain_text("max_grad_norm: 0.5", timeout=SLOW)
    assert page.locator("#start").is_visible()
    page.screenshot(path=str(tmp_path / "clone.png"), full_page=True)

    # delete: asked once, with the space it frees, then gone from the page and the disk
    page.get_by_role("tab", name="Runs").click()
    pick(page, "open-run", a)
    expect(page.locator("#run-info")).to_contain_text(f"{a}", timeout=SLOW)  # its disk space and folder
    expect(page.locator("#run-info")).to_contain_text("KB")
    page.locator("#delete-run").click()
    confirm = page.locator("#confirm-delete")
    expect(confirm).to_contain_text(f"Really delete {a}? Frees", timeout=SLOW)
    assert (app.runs_dir / a).is_dir()  # nothing is deleted before the confirmation
    confirm.click()
    expect(page.locator("#runs-message")).to_contain_text(f"Deleted run {a}", timeout=SLOW)
    expect(table).not_to_contain_text(a, timeout=SLOW)
    assert not (app.runs_dir / a).exists() and (app.runs_dir / b).is_dir()
    expect(page.locator("#delete-run")).to_be_visible(timeout=SLOW)
    expect(page.locator("#runs-message")).to_contain_text("freed")  # still there once the table refreshed


@pytest.fixture(scope="module")
def sweep_of_two(app):
    """A real sweep of two runs of the tiny model in the app's runs folder, finished: (its id, the runs'
    ids). Their ids are long and, made in the same second, share their first 38 characters."""
    from studio_core.runs import sweep

    manager = RunManager(app.runs_dir)
    spec = RunSpec.load(ROOT / "recipes" / "tiny-sft.yaml").with_overrides(["max_steps=4", "logging_steps=1"])
    started = sweep.start(manager, spec, sweep.parse_grid(["learning_rate=1e-3,3e-3"]), cpu_hardware())
    ids = [entry["id"] for entry in started.record["runs"]]
    assert [manager.wait(run_id).live_state for run_id in ids] == ["finished", "finished"]
    return started.id, ids


def open_sweep(page, sweep_id: str) -> None:
    """The Runs tab with the sweep picked in its Sweeps section (which puts its runs in Compare runs)."""
    page.get_by_role("tab", name="Runs").click()
    page.locator("#sweeps-box").get_by_text("Sweeps").first.click()
    pick(page, "sweep-pick", sweep_id)
    page.locator("#compare-box").get_by_text("Compare runs").first.click()


def test_compare_tells_apart_runs_whose_ids_begin_the_same(page, sweep_of_two):
    """Issue 47: the plot's legend cut both ids of a sweep's runs to the same 34 characters."""
    sweep_id, ids = sweep_of_two
    open_sweep(page, sweep_id)
    labels = page.locator("#compare-plot .role-legend-label text")
    expect(labels).to_have_count(2, timeout=SLOW)
    shown = [label.text_content() for label in labels.all()]
    # each label whole (Vega ends a label it cuts with "…"): the end of its own run's id
    assert len(set(shown)) == 2 and all(text.startswith("…") and not text.endswith("…") for text in shown), shown
    assert sorted(next(i for i, run_id in enumerate(ids) if run_id.endswith(text[1:])) for text in shown) == [0, 1]


def test_table_headers_break_between_words_never_inside_one(page, sweep_of_two):
    """Issue 47: a narrow column's header broke inside its word, "step" read "ste" over "p"."""
    sweep_id, ids = sweep_of_two
    open_sweep(page, sweep_id)
    expect(page.locator("#sweep-table")).to_contain_text(ids[1], timeout=SLOW)
    expect(page.locator("#compare-diff")).to_contain_text("learning_rate", timeout=SLOW)
    expect(page.locator("#runs-table")).to_contain_text(ids[1], timeout=SLOW)
    for width in (1400, 1000):  # a narrow window: the Runs table scrolls sideways, its words stay whole
        page.set_viewport_size({"width": width, "height": 900})
        deadline = time.monotonic() + 10  # the tables size their columns once drawn
        while True:
            broken = {table: broken_header_words(page.locator(table))
                      for table in ("#sweep-table", "#compare-diff", "#runs-table")}
            if not any(broken.values()) or time.monotonic() > deadline:
                break
            page.wait_for_timeout(250)
        assert not any(broken.values()), (width, broken)
    # and the narrow window's Runs table can be scrolled to its last column, not cut off
    scrolls = page.locator("#runs-table table").evaluate("""el => {
        for (let box = el.parentElement; box; box = box.parentElement) {
            const style = getComputedStyle(box).overflowX;
            if (box.scrollWidth > box.clientWidth + 1) return ['auto', 'scroll'].includes(style);
        }
        return false;
    }""")
    assert scrolls


def test_ctrl_c_with_a_page_open_closes_the_server_without_a_traceback(new_page, runs_dir):
    """Issue 47: the app ignored Ctrl-C for 5-10 s with a page open: Gradio gave uvicorn 5 s to
    stop, uvicorn waited for the page's event streams, which never end, and the process exited
    with its server still up. Now the streams are cancelled after a second and the server ends.
    The app starts as a script's `launch.py &` starts it, with SIGINT ignored (so CI's runner
    started it once): it hears SIGINT all the same."""
    server = App(runs_dir, sigint_ignored=True)
    try:
        page = new_page(server.url)
        expect(page.locator("#start")).to_be_visible()
        page.wait_for_timeout(1500)  # the page's streams open
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(timeout=60) == 0
        said = server.log_path.read_text()
    finally:
        server.kill()
    assert "Ctrl-C: closing the studio" in said and "Studio closed." in said, said[-2000:]
    assert "Traceback" not in said and "ERROR" not in said, said[-2000:]


def test_a_run_survives_page_and_app_then_is_stopped_saved_and_resumed_from_the_page(new_page, runs_dir):
    first_app = App(runs_dir)  # apps of its own: the test kills them
    try:
        page = new_page(first_app.url)
        for button in ("#stop", "#stop-save", "#resume"):  # no run followed: nothing to stop or resume
            expect(page.locator(button)).to_be_disabled()
        set_number(page, "max_steps", 100_000)
        set_number(page, "logging_steps", 50)
        page.locator("#start").click()
        run_state(page, "RUNNING").wait_for(timeout=120_000)
        page.close()  # closing the browser changes nothing for the run
    finally:
        first_app.kill()  # and neither does the app dying

    manager = RunManager(runs_dir)
    [view] = manager.list()
    step = view.step  # a number: the manager keeps one view per run and updates it
    went_on = manager.wait(view.id, lambda v: v.step > step or not v.active, timeout=60)
    assert went_on.step > step, f"the run stopped progressing with the app gone: {went_on.live_state}"

    second_app = App(runs_dir)
    try:
        page = new_page(second_app.url)  # a fresh page of a new app follows the run still going
        run_state(page, "RUNNING").wait_for(timeout=30_000)
        assert view.id in page.locator(".run-status").first.inner_text()
        expect(page.locator("#resume")).to_be_disabled()  # a going run: stop it, not resume it
        check_the_log_follows_its_end(page)
        page.locator("#stop-save").click()
        run_state(page, "STOPPED").wait_for(timeout=120_000)
        expect(page.locator("#stop")).to_be_disabled()
        resume_point = page.locator(".resume-point")
        expect(resume_point).to_contain_text("Can resume from step")
        step = int(re.search(r"step (\d+)", resume_point.inner_text()).group(1))

        page.reload()  # a reloaded page follows the stopped run, whose Resume is at hand
        run_state(page, "STOPPED").wait_for(timeout=SLOW)
        assert view.id in page.locator(".run-status").first.inner_text()
        expect(page.locator("#resume")).to_be_enabled()
        # and the Runs tab resumes any run it opens
        page.get_by_role("tab", name="Runs").click()
        pick(page, "open-run", view.id)
        expect(page.locator("#runs-resume")).to_be_enabled(timeout=SLOW)
        with leases.acquire(runs_dir, "cpu", [0, 1], holder="chat-holding-both", kind="chat"):  # no core free
            page.locator("#runs-resume").click()  # it waits in the queue, and Stop calls it off
            expect(page.locator("#runs-message")).to_contain_text(f"queued to resume from step {step}, 1st of 1",
                                                                  timeout=60_000)
            expect(page.locator("#runs-stop")).to_be_enabled(timeout=SLOW)
            page.locator("#runs-stop").click()
            expect(page.locator("#runs-message")).to_contain_text("cancelled while queued: the run is stopped, as it "
                                                                  "was", timeout=SLOW)
        expect(page.locator("#runs-resume")).to_be_enabled(timeout=SLOW)
        page.locator("#runs-resume").click()
        expect(page.locator("#runs-message")).to_contain_text(f"resumed from step {step}", timeout=60_000)
        expect(page.locator("#runs-stop")).to_be_enabled(timeout=SLOW)
        page.get_by_role("tab", name="Train").click()  # which the Train tab follows
        run_state(page, "RUNNING").wait_for(timeout=120_000)
        progress = page.locator(".run-progress").first
        expect(progress).not_to_have_attribute("data-step", str(step), timeout=60_000)
        assert int(progress.get_attribute("data-step")) > step  # the step count goes on
        page.locator("#stop").click()
        run_state(page, "STOPPED").wait_for(timeout=60_000)
        expect(page.locator("#train-message")).to_contain_text("none of its processes is left")
        # the Runs tab: started is the first start, the training time leaves out the stopped time
        page.get_by_role("tab", name="Runs").click()
        row = page.locator("#runs-table tr").filter(has_text=view.id).first
        expect(row).to_contain_text("stopped", timeout=SLOW)
        cells = [c.strip() for c in row.locator("td").all_text_contents()]
        first_event = json.loads((view.dir / "events.jsonl").read_text().splitlines()[0])
        assert cells[5] == time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(first_event["time"])), cells
        seconds = [int(m) * 60 + int(s) for m, s in (cell.split(":")[-2:] for cell in cells[6:8])]
        assert 0 < seconds[0] < seconds[1], cells  # training < wall: the reload and the Runs tab took a while
    finally:
        second_app.kill()
    assert manager.view(view.id).live_state == "stopped"


def check_the_log_follows_its_end(page) -> None:
    """The log box follows its end as it grows, and stays where the user scrolled up to."""
    log = page.locator(".run-log textarea").first
    page.wait_for_function("() => { const t = document.querySelector('.run-log textarea');"
                           " return t.scrollHeight > t.clientHeight + 40 && t.scrollHeight - t.scrollTop - "
                           "t.clientHeight < 24; }", timeout=SLOW)
    log.hover()
    page.mouse.wheel(0, -30)  # up, by hand: however close to the next new text, it is kept
    page.wait_for_function("() => { const t = document.querySelector('.run-log textarea');"
                           " return t.scrollHeight - t.scrollTop - t.clientHeight >= 24; }", timeout=SLOW)
    page.wait_for_timeout(300)  # a smooth scroll comes to rest
    where = log.evaluate("t => t.scrollTop")
    before = log.input_value()
    page.wait_for_function("old => document.querySelector('.run-log textarea').value !== old", arg=before,
                           timeout=SLOW)
    page.wait_for_timeout(600)  # the page's follower looks every 250 ms
    assert log.evaluate("t => t.scrollTop") == where


def test_delete_without_an_opened_run_says_what_to_do(page):
    page.get_by_role("tab", name="Runs").click()
    page.locator("#delete-run").click()
    expect(page.locator("#runs-message")).to_contain_text("Open a run first.")
    expect(page.locator("#confirm-delete")).to_be_hidden()
