"""The Runs tab in a real browser: two finished runs compared (curves overlaid, the settings
that differ), one cloned into the Train form, one deleted after one confirmation.

Chromium through Playwright, the app as its own process (tests/studio_browser.py); skipped,
saying so, where Chromium is missing.
"""

from __future__ import annotations

from studio_core.hardware import cpu_hardware
from studio_core.runs.manager import RunManager
from studio_core.spec import RunSpec
from studio_browser import app, browser, new_page, pytestmark  # noqa: F401 (fixtures)
from studio_browser import ROOT, expect

SLOW = 30_000  # ms: the page waits on the app, which shares two cores with whatever else runs


def finished_runs(runs: RunManager, *specs: RunSpec) -> list[str]:
    ids = [runs.start(spec, cpu_hardware()).id for spec in specs]  # side by side: one core each
    for run_id in ids:
        view = runs.wait(run_id)
        assert view.live_state == "finished", view.error_text
    return ids


def pick(page, elem_id: str, option: str) -> None:
    page.locator(f"#{elem_id} input").first.click()
    page.get_by_role("option", name=option, exact=True).click(timeout=SLOW)


def test_compare_clone_and_delete_runs(new_page, app, tmp_path):  # noqa: F811 (fixtures)
    tiny = RunSpec.load(ROOT / "recipes" / "tiny-sft.yaml")
    a, b = finished_runs(RunManager(app.runs_dir),
                         tiny.with_overrides(["max_steps=20", "logging_steps=5"]),
                         tiny.with_overrides(["max_steps=20", "logging_steps=5", "learning_rate=1.0e-4",
                                              "run_name=tiny-sft-b", "max_grad_norm=0.5"]))
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
    expect(plot).to_contain_text(a, timeout=SLOW)  # the legend: one line per run
    expect(plot).to_contain_text(b, timeout=SLOW)
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
