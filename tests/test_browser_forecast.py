"""The shape forecast in a real browser: the forecast, its best suggestion applied in one click
and forecast again, then a compiled run whose compilations show live, with totals and a timeline.

Chromium through Playwright, the app as its own process (tests/studio_browser.py); skipped,
saying so, where Chromium is missing.
"""

from __future__ import annotations

import os

from studio_browser import app, browser, new_page, page, pytestmark  # noqa: F401 (fixtures)
from studio_browser import expect, run_state, set_number


def test_shape_forecast_suggestion_and_live_compilations(page, app, tmp_path):
    report = page.locator("#forecast-report")
    page.locator("#forecast").click()
    report.get_by_text("distinct batch shape").wait_for(timeout=120_000)
    assert "padding waste" in report.inner_text()
    assert page.locator("#length-histogram").is_visible()
    # the best suggestion goes into "Other TRL settings" and the forecast is made again with it
    suggestions = page.locator("#suggestions")
    best = suggestions.locator("label").first.inner_text()
    assert "shape(s)" in best and "->" in best
    page.locator("#apply-suggestion").click()
    page.get_by_text("Advanced").click()
    setting = best.split(":")[0].strip()  # e.g. "packing" or "pad_to_multiple_of"
    expect(page.locator("#extra .cm-content")).to_contain_text(setting)
    shapes = int(best.split("->")[1].split("shape")[0])
    report.get_by_text(f"{shapes} distinct batch shape").wait_for(timeout=120_000)

    # a compiled run: its compilations show as they happen, with totals and a timeline
    editor = page.locator("#extra .cm-content").first
    editor.fill(editor.inner_text() + "\ntorch_compile: true\ntorch_compile_backend: eager")
    page.locator("#extra-check").get_by_text("recognised").wait_for()
    set_number(page, "max_steps", 6)
    page.locator("#start").click()
    compiles = page.locator(".compiles .compile-totals")
    compiles.get_by_text("batch shape(s) reached the model").wait_for(timeout=120_000)
    run_state(page, "FINISHED").wait_for(timeout=120_000)
    assert page.locator(".compile-timeline .compile-span").count() > 0
    text = compiles.inner_text()
    assert f"{shapes} batch shape(s)" in text and "compilation(s)" in text
    page.screenshot(path=str(tmp_path / "compiles.png"), full_page=True)
    if os.environ.get("STUDIO_SCREENSHOTS"):
        page.screenshot(path=os.environ["STUDIO_SCREENSHOTS"] + "/compiles.png", full_page=True)
    [view] = app.new_runs()
    assert len({tuple(e["shape"]) for e in view.shapes}) == shapes
