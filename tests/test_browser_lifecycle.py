"""A run's life beyond the page, in a real browser: it survives the page closing and the app
restarting, and is stopped from a second browser; stop and save, then resume, from the page.

Chromium through Playwright, the app as its own process (tests/studio_browser.py); skipped,
saying so, where Chromium is missing.
"""

from __future__ import annotations

import re

from studio_browser import app, browser, new_page, page, pytestmark, runs_dir  # noqa: F401 (fixtures)
from studio_browser import App, expect, run_state, set_number
from studio_core.runs.manager import RunManager


def test_run_survives_page_close_and_app_restart_and_stops_from_a_second_browser(new_page, runs_dir):
    first_app = App(runs_dir)  # apps of its own: the test kills one
    try:
        page = new_page(first_app.url)
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
        other = new_page(second_app.url)  # a fresh page follows the run still going
        run_state(other, "RUNNING").wait_for(timeout=30_000)
        assert view.id in other.locator(".run-status").first.inner_text()
        other.locator("#stop").click()
        run_state(other, "STOPPED").wait_for(timeout=60_000)
        expect(other.locator("#train-message")).to_contain_text("none of its processes is left")
    finally:
        second_app.kill()
    assert manager.view(view.id).live_state == "stopped"


def test_stop_and_save_then_resume_from_the_page(page):
    set_number(page, "max_steps", 100_000)
    set_number(page, "logging_steps", 50)
    page.locator("#start").click()
    run_state(page, "RUNNING").wait_for(timeout=120_000)
    page.locator("#stop-save").click()
    run_state(page, "STOPPED").wait_for(timeout=120_000)
    resume_point = page.locator(".resume-point")
    expect(resume_point).to_contain_text("Can resume from step")
    step = int(re.search(r"step (\d+)", resume_point.inner_text()).group(1))
    page.locator("#resume").click()
    page.locator("#train-message").get_by_text(f"resumed from step {step}").wait_for(timeout=60_000)
    run_state(page, "RUNNING").wait_for(timeout=120_000)
    progress = page.locator(".run-progress").first
    expect(progress).not_to_have_attribute("data-step", str(step), timeout=60_000)
    assert int(progress.get_attribute("data-step")) > step  # the step count goes on
    page.locator("#stop").click()
    run_state(page, "STOPPED").wait_for(timeout=60_000)
