"""Every trainer of the registry from the page, in a real browser: picked, its own settings
shown, its sample data checked, trained to its end; a reward model is offered for export and
not for chat.

Chromium through Playwright, the app as its own process, one app for this file
(tests/studio_browser.py); skipped, saying so, where Chromium is missing.
"""

from __future__ import annotations

import pytest

from studio_browser import app, app_env, browser, new_page, page, pytestmark  # noqa: F401 (fixtures)
from studio_browser import drawn_lines, expect, record_texts, run_state, set_number, texts_shown
from studio_core.recipe import trainers
from test_trainers import STEPS, check_trained


@pytest.mark.parametrize(("trainer", "steps"), [(key, STEPS[key]) for key in trainers.TRAINERS if key != "sft"])
def test_each_trainer_from_the_page(page, app, trainer, steps, tmp_path):
    """Also the full training of each (test_trainers trains their LoRA recipes), checked as there."""
    from app.run_panel import trainer_frame

    entry = trainers.get(trainer)
    page.get_by_label(entry.label).check()
    expect(page.locator("#dataset input").first).to_have_value(entry.sample)
    for field in entry.fields:  # the trainer's own settings show, and only for it
        expect(page.locator(f"#{trainer}-{field.name}")).to_be_visible()
    page.get_by_text("Dataset: upload, Hub options").click()
    page.locator("#check-dataset").click()
    expect(page.locator("#data-report")).to_contain_text(f"Fits {entry.name}")
    set_number(page, "max_steps", steps)
    set_number(page, "logging_steps", 2)
    record_texts(page, "#train-message")
    page.locator("#start").click()
    run_state(page, "FINISHED").wait_for(timeout=180_000)
    if entry.rewards:  # said at once, before the reward functions are checked in a process of their own
        said = [text for text in texts_shown(page) if "Starting: checking" in text]
        assert said and "reward functions" in said[0], texts_shown(page)
    [view] = app.new_runs()
    assert view.trainer == trainer and view.live_state == "finished" and view.step == steps
    # the trainer's own metrics are plotted (GRPO's rewards per function, DPO's margins, ...)
    series = {title: trainer_frame(view, names)["metric"].nunique() for title, names in entry.plots}
    assert any(series.values()), f"{trainer} logged none of {entry.plots}"
    for title, count in series.items():  # a line per metric logged (per reward function, ...)
        plot = page.locator("#tab-train .trainer-plot").filter(has=page.get_by_text(title, exact=True))
        expect(drawn_lines(plot)).to_have_count(count, timeout=30_000)
    check_trained(view, trainer, lora=False, tmp_path=tmp_path)
    if not entry.chats:  # a reward model: offered for export, not for chat
        page.get_by_role("tab", name="Chat").click()
        page.locator("#chat-target input").first.click()
        expect(page.get_by_role("option", name="builtin:tiny-qwen3")).to_be_visible()
        assert page.get_by_role("option", name=view.id).count() == 0
        page.get_by_role("tab", name="Export").click()
        page.locator("#export-run input").first.click()
        expect(page.get_by_role("option", name=view.id)).to_be_visible()
