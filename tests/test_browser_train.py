"""The Train tab in a real browser: a run clicked through on the built-in default, bad input refused
before anything starts (a number said as typed, a Ray run without its address under the form's field),
a plan and a forecast of other settings dropped, Start disabled while it checks, a failed run explained, a two-process layout with its core map and
exported scripts, a Ray run planned and refused when its cluster does not answer, the memory bar
and a run too big for it refused, cores others hold (a run queued for them, then cancelled; a queued
run's message once it has started), the learning rate's starting value, Start sweep disabled while
it checks, a sweep started from the page and ranked in the Runs tab, and the
shape forecast with a suggestion applied and a compiled run's compilations shown live.

Chromium through Playwright, the app as its own process, one app for this file
(tests/studio_browser.py); skipped, saying so, where Chromium is missing.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from studio_browser import app, app_env, browser, new_page, page, pytestmark  # noqa: F401 (fixtures)
from studio_browser import CHECKED_MS, code_text, drawn_lines, expect, log_at_end, record_texts, run_state, set_number, stop_runs, texts_shown

# This file's app keeps its runs where a user's are by default (~/trn-studio/runs), outside the
# temp folder: the exported scripts must still be offered for download.
APP_DEFAULT_LOCATION = True


def test_click_through_sft_on_the_builtin_default(page, app, tmp_path):
    assert page.locator("#model input").first.input_value() == "builtin:tiny-qwen3"
    assert page.locator("#dataset input").first.input_value() == "builtin:qa"
    page.locator("#run_name textarea, #run_name input").first.fill("browser-sft")
    set_number(page, "max_steps", 40)
    page.locator("#dataset-box").get_by_text("Dataset: upload, Hub options").first.click()
    set_number(page, "eval_fraction", 0.25)  # 3 of the 12 facts held out, their loss plotted

    page.locator("#preview").click()
    page.locator("#plan").get_by_text("torch.distributed.run").first.wait_for(timeout=CHECKED_MS)
    planned = code_text(page, "plan")  # its whole text, whatever lines the page has drawn yet
    assert "use_cpu = True" in planned and "eval_strategy = 'steps'" in planned
    assert app.new_runs() == []  # a preview launches nothing

    for button in ("#stop", "#stop-save", "#resume"):  # no run followed: nothing to stop or resume
        expect(page.locator(button)).to_be_disabled()
    page.locator("#start").click()
    expect(page.locator("#stop")).to_be_enabled(timeout=60_000)  # while it goes
    run_state(page, "FINISHED").wait_for(timeout=120_000)
    status = page.locator(".run-status").first.inner_text()
    assert "browser-sft" in status and "loss" in status
    assert page.locator(".run-progress[data-step='40'][data-total='40']").first.is_visible()
    for button in ("#stop", "#stop-save", "#resume"):  # a finished run: nothing to stop or resume
        expect(page.locator(button)).to_be_disabled()
    page.wait_for_function("() => { const t = document.querySelector('.run-log textarea'); return t.value.includes("
                           "'train_runtime') && t.scrollHeight - t.scrollTop - t.clientHeight < 24; }")
    assert log_at_end(page)  # the log box shows its last lines, not its top
    # the plots are drawn, the hardware ones (coloured by node) too, with their titles whole
    train_tab = page.locator("#tab-train")
    for title in ("Loss", "Token accuracy", "CPU of the run's processes (%, 100 = one core)"):
        plot = train_tab.locator(".block").filter(has=page.get_by_text(title, exact=True)).last
        expect(drawn_lines(plot).first).to_be_attached(timeout=30_000)
    loss = train_tab.locator(".loss-plot").first
    expect(drawn_lines(loss)).to_have_count(2)  # the training loss and the held-out set's
    expect(loss).to_contain_text("evaluation")  # its legend
    page.get_by_text("Settings the studio applied, and why").click()
    why = page.locator("table.applied th").nth(2)
    expect(why).to_be_visible()
    assert why.bounding_box()["width"] > 300  # the reasons have room (they were 3 characters wide)
    assert page.evaluate("document.body.scrollHeight") < 4000
    page.screenshot(path=str(tmp_path / "train-finished.png"), full_page=True)

    [view] = app.new_runs()
    assert view.live_state == "finished" and any("loss" in m for m in view.metrics[-3:])
    assert view.spec["studio"]["eval_fraction"] == 0.25 and len([m for m in view.metrics if "eval_loss" in m]) >= 5
    # the status's first "loss N" (4 significant digits: run_panel.format_loss); a note on a loss that stays
    # high may follow it (history.loss_note), as the tiny model's short run here can end with
    shown_loss = float(re.search(r"\bloss ([0-9.]+(?:e[-+]?[0-9]+)?)", status).group(1))
    assert shown_loss == pytest.approx(next(m["loss"] for m in reversed(view.metrics) if "loss" in m), rel=5e-4)

    page.get_by_role("tab", name="Runs").click()
    table = page.locator("#runs-table")
    expect(table).to_contain_text(view.id)
    expect(table).to_contain_text("finished")


def test_bad_input_is_refused_in_the_page_and_launches_nothing(page, app):
    dataset = page.locator("#dataset input").first
    dataset.fill("/no/such/data.jsonl")
    dataset.press("Enter")
    page.get_by_text("Advanced").click()
    page.locator("#extra .cm-content").first.fill("max_step: 5")
    # checked as it is typed, before anything is started
    page.locator("#extra-check").get_by_text("did you mean max_steps").wait_for()
    page.locator("#start").click()
    message = page.locator("#train-message")
    message.get_by_text("Nothing was launched").wait_for()
    text = message.inner_text()
    assert "/no/such/data.jsonl" in text and "did you mean max_steps" in text
    assert app.new_runs() == []
    # the form keeps what the user typed, so they can correct it
    assert page.locator("#dataset input").first.input_value() == "/no/such/data.jsonl"


def test_a_number_is_said_as_typed_and_a_plan_or_forecast_of_other_settings_goes(page, app):
    """Issue 47: `1e999` blanked its box and Start said "must be above 0, got 0.0"; a plan and a
    forecast stayed shown for another trainer and another Run on; a Ray run without its address
    was refused under studio.ray.address and --ray, its core map saying Slurm picks the nodes."""
    message, plan, report = page.locator("#train-message"), page.locator("#plan"), page.locator("#forecast-report")
    box = page.locator("#learning_rate input").first
    box.fill("1e999")
    page.locator("#start").click()
    expect(message).to_contain_text("learning_rate: '1e999' reads as infinity (too large to hold); write a number")
    expect(box).to_have_value("1e999")  # kept, to be corrected
    set_number(page, "learning_rate", "2e-3")
    page.locator("#preview").click()
    expect(plan).to_contain_text("torch.distributed.run", timeout=CHECKED_MS)
    page.locator("#forecast").click()
    report.get_by_text("distinct batch shape").wait_for(timeout=120_000)
    page.get_by_label("DPO (preference pairs)").check()  # another trainer: neither is this form's any more
    expect(plan).to_be_hidden()
    expect(report).to_contain_text("The form changed since this forecast")
    expect(page.locator("#length-histogram")).to_be_hidden()

    page.get_by_text("Layout: processes, parallelism, cores").click()
    page.locator("#preview").click()
    expect(plan).to_contain_text("reference model", timeout=CHECKED_MS)  # DPO's
    page.locator("#run_on").get_by_label("Ray").check()  # another place: the plan goes
    expect(plan).to_be_hidden()
    set_number(page, "nodes", 2)
    expect(page.locator("#core-map")).to_contain_text("x 2 nodes (Ray picks them)", timeout=30_000)
    page.locator("#start").click()
    message.get_by_text("Nothing was launched").wait_for()
    expect(message).to_contain_text("Ray address: empty, and a run on Ray needs it: write the head's dashboard")
    assert "--ray" not in message.inner_text() and "studio.ray.address" not in message.inner_text()
    assert app.new_runs() == []


def grpo_with_a_slow_failing_reward(page, folder: Path) -> None:
    """GRPO picked on the page with one reward function, which the checks call on the first rows:
    it sleeps 4 s, then fails (no run starts), so the checking state lasts long enough to see."""
    slow = folder / "slow_reward.py"
    slow.write_text("import time\n\n\ndef reward(completions, **kwargs):\n    time.sleep(4)\n"
                    "    raise ValueError('a slow reward that fails')\n")
    page.get_by_label("GRPO (online RL with reward functions)").check()
    page.locator("#grpo-rewards .cm-content").first.fill(f"- {{file: {slow}, function: reward}}")


def test_start_is_disabled_and_says_so_while_its_checks_run(page, app, tmp_path):
    """A second Start pressed while the first was checking was dropped without a word."""
    grpo_with_a_slow_failing_reward(page, tmp_path)
    start = page.locator("#start")
    start.click()
    expect(start).to_be_disabled()
    expect(start).to_have_text("Starting: checking ...")
    message = page.locator("#train-message")
    message.get_by_text("Nothing was launched").wait_for(timeout=60_000)
    assert "a slow reward that fails" in message.inner_text()
    expect(start).to_be_enabled()  # Start again, for the corrected form
    expect(start).to_have_text("Start")
    assert app.new_runs() == []


def test_start_sweep_is_disabled_and_says_so_while_its_checks_run(page, app, tmp_path):
    """Issue 47: Start sweep pressed again while the first press was checking the grid was dropped
    without a word (Start said so; Start sweep did not). The grid box says how to write values.
    The checks are made slow (a reward function that sleeps, called on the first rows), so that the
    disabled button is there to see: a refusal of the values alone can come back within the page's
    frame, and a CI run under load never showed it."""
    grpo_with_a_slow_failing_reward(page, tmp_path)
    page.get_by_text("Sweep: a run for each combination of values").click()
    grid = page.locator("#sweep-grid")
    expect(grid).to_contain_text("lora_target_modules=[[q_proj, v_proj], [q_proj, k_proj, v_proj]]")  # commas
    grid.locator("textarea").fill("learning_rate=1e-3,2e-3")
    button, message = page.locator("#sweep-start"), page.locator("#train-message")
    button.click()
    expect(button).to_be_disabled()
    expect(button).to_have_text("Starting sweep: checking ...")
    expect(message).to_contain_text("Sweep not started", timeout=60_000)
    expect(message).to_contain_text("a slow reward that fails")
    expect(button).to_be_enabled()  # given back, for the corrected grid
    expect(button).to_have_text("Start sweep")
    grid.locator("textarea").fill("learning_rate=1e-3,-1")  # checked and planned, then refused
    button.click()
    expect(message).to_contain_text("learning_rate: must be above 0, got -1", timeout=60_000)
    expect(button).to_be_enabled()
    assert app.new_runs() == []


def test_a_queued_runs_message_says_it_started_once_it_leaves_the_queue(new_page, app):
    """Issue 47: "Queued run X ... Stop cancels it." stayed after the run had started."""
    from studio_core.machine import leases

    app.mark()  # new_page does not: the runs of the tests before are not this test's
    try:
        with leases.acquire(app.runs_dir, "cpu", [0, 1], holder="chat-holding-both", kind="chat"):
            page = new_page(app.url)
            set_number(page, "max_steps", 3)
            page.locator("#start").click()
            message = page.locator("#train-message")
            expect(message).to_contain_text("Queued run", timeout=60_000)
            expect(message).to_contain_text("Stop cancels it.")
            [view] = app.new_runs()
        expect(message).to_contain_text(f"Run {view.id} left the queue and started", timeout=60_000)
        expect(message).not_to_contain_text("Stop cancels it")
        expect(message).not_to_contain_text("stopped")
    finally:
        stop_runs(app.runs_dir)


def test_a_failed_run_shows_failed_its_exit_code_and_the_error(page, app, tmp_path):
    """A model folder whose config.json is fine (so it passes the checks) but whose weights are
    cut short: the worker fails loading it, and the page says so."""
    from test_runs import broken_model

    model = page.locator("#model input").first
    model.fill(str(broken_model(tmp_path)))
    model.press("Enter")
    page.locator("#start").click()
    run_state(page, "FAILED").wait_for(timeout=120_000)
    [view] = app.new_runs()
    assert view.live_state == "failed" and view.exit_code not in (0, None)
    expect(page.locator(".run-status").first).to_contain_text(f"exit code {view.exit_code}")
    error = page.locator(".run-error").first
    expect(error).to_contain_text(view.error_text.splitlines()[0][:60])
    expect(error).to_contain_text("Traceback")


def test_a_two_process_layout_from_the_page(page, app):
    page.get_by_text("Layout: processes, parallelism, cores").click()
    core_map = page.locator("#core-map")
    core_map.locator(".core").first.wait_for()  # drawn for the opened accordion before nproc changes
    set_number(page, "nproc", 2)
    # the map is redrawn by the server: allow for a machine busy with another test worker's run
    expect(core_map.locator(".core[data-state='r1']")).to_have_count(1, timeout=30_000)
    expect(core_map).to_contain_text("2 of 2 CPU cores for this run", timeout=30_000)
    set_number(page, "max_steps", 10)
    page.locator("#export").click()
    expect(page.locator("#train-message")).to_contain_text("launch.sh", timeout=30_000)
    # offered for download from the default runs folder (Gradio refused it with a red toast)
    for name in ("sft-builtin-tiny-qwen3-launch.sh", "sft-builtin-tiny-qwen3-slurm.sh"):
        expect(page.locator("#exports").get_by_role("cell", name=name, exact=True)).to_be_visible(timeout=30_000)
    exported = sorted(p.name for p in (app.runs_dir / "exports").iterdir())  # no other test here exports
    assert exported == ["sft-builtin-tiny-qwen3-launch.sh", "sft-builtin-tiny-qwen3-slurm.sh"]
    assert "--nproc-per-node=2" in (app.runs_dir / "exports" / exported[0]).read_text()
    page.locator("#preview").click()  # what Start would launch (the session's two_process_runs trained it)
    expect(page.locator("#plan")).to_contain_text("--nproc-per-node=2", timeout=CHECKED_MS)
    expect(page.locator("#plan")).to_contain_text("studio.cores = '0-1'")


def test_a_ray_run_from_the_page_is_planned_and_refused_when_its_cluster_does_not_answer(page, app):
    from ray_cluster import free_port

    page.get_by_text("Layout: processes, parallelism, cores").click()
    page.locator("#run_on").get_by_label("Ray").check()
    expect(page.locator("#ray-box")).to_be_visible(timeout=30_000)
    expect(page.locator("#cores input, #cores textarea").first).to_be_disabled()  # Ray picks the nodes' cores
    address = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    box = page.locator("#address input, #address textarea").first
    box.fill(address)
    box.press("Tab")
    set_number(page, "nodes", 2)
    page.locator("#preview").click()  # the plan reads the form; it does not ask the cluster
    plan = page.locator("#plan")
    expect(plan).to_contain_text("2 x {CPU: 1}, STRICT_SPREAD", timeout=CHECKED_MS)
    expect(plan).to_contain_text(f"Submitted to Ray at {address}")
    page.locator("#start").click()  # Start asks it first
    message = page.locator("#train-message")
    message.get_by_text("Nothing was launched").wait_for(timeout=CHECKED_MS)
    assert f"no Ray cluster answers at {address}" in message.inner_text()
    assert "Traceback" not in message.inner_text() and app.new_runs() == []


def test_the_memory_bar_shows_the_estimate_and_a_run_too_big_is_refused(page, app):
    page.get_by_text("Layout: processes, parallelism, cores").click()
    bar = page.locator("#core-map .memory-bar").first
    expect(bar).to_contain_text("Device memory, each of the run's 1 core(s): about", timeout=30_000)
    assert float(bar.get_attribute("data-fraction")) < 0.9
    expect(bar.locator(".memory-part[data-part='weights']")).to_have_count(1)
    set_number(page, "batch_size", 65536)  # 65536 x 4096 tokens: their activations alone need a terabyte
    set_number(page, "max_length", 4096)
    page.wait_for_function("() => { const bar = document.querySelector('#core-map .memory-bar');"
                           " return bar !== null && parseFloat(bar.dataset.fraction) > 1; }", timeout=30_000)
    message = page.locator("#train-message")
    expect(message).to_contain_text("device memory: the run needs about", timeout=30_000)
    record_texts(page, "#train-message")  # the core map's redraw may say the layout's problem over it after
    page.locator("#start").click()  # Start's checks run first (seconds; a minute on a loaded machine)
    page.wait_for_function("() => window.__shown.some(t => t.includes('Nothing was launched'))", timeout=120_000)
    [refusal] = [text for text in texts_shown(page) if "Nothing was launched" in text][:1]
    assert "It fits with any one of: per_device_train_batch_size: " in refusal
    assert app.new_runs() == []


def test_every_element_id_in_the_page_is_unique_with_every_part_shown(page):
    page.get_by_text("Layout: processes, parallelism, cores").click()
    page.locator("#run_on").get_by_label("Slurm").check()
    expect(page.locator("#slurm-box")).to_be_visible(timeout=30_000)  # one element: strict, two would fail
    for tab, shown in (("Runs", "#tab-runs"), ("Chat", "#tab-chat"), ("Evaluate", "#tab-eval"),
                       ("Export", "#tab-export"), ("Doctor", "#tab-doctor")):  # each tab's widgets in the page
        page.get_by_role("tab", name=tab).click()
        expect(page.locator(shown)).to_be_visible()
    counts = page.evaluate("() => { const c = {}; for (const e of document.querySelectorAll('[id]')) "
                           "if (e.id) c[e.id] = (c[e.id] || 0) + 1; return c; }")
    assert {key: n for key, n in counts.items() if n > 1} == {}


def test_the_core_map_marks_the_cores_others_hold_and_names_them(new_page, app):
    from studio_core.machine import leases

    holder = "20261130-000000-other-abcdef"
    with leases.acquire(app.runs_dir, "cpu", [0], holder=holder, kind="run"):  # as a run's supervisor does
        page = new_page(app.url)
        page.get_by_text("Layout: processes, parallelism, cores").click()
        core_map = page.locator("#core-map")
        expect(core_map.locator(".core[data-state='busy']")).to_have_count(1, timeout=30_000)
        expect(core_map.locator(".core[data-core='1']")).to_have_attribute("data-state", "r0")
        page.locator("#queue_if_busy input").uncheck()  # refused, not queued
        cores = page.locator("#cores input, #cores textarea").first
        cores.fill("0")
        cores.press("Tab")
        message = page.locator("#train-message")  # said where refusals are, whole (the map's box cut it)
        expect(message).to_contain_text("This layout cannot run here", timeout=30_000)
        expect(message).to_contain_text(f"core 0 is held by run {holder}")
        cores.fill("1")
        cores.press("Tab")
        expect(message).not_to_contain_text("This layout cannot run here", timeout=30_000)  # fixed: gone
        cores.fill("0")
        cores.press("Tab")
        page.locator("#preview").click()  # and the preview refuses it the same way
        expect(page.locator("#train-message")).to_contain_text(f"core 0 is held by run {holder}")


def test_runs_whose_cores_are_busy_are_queued_from_the_page_moved_and_cancelled(new_page, app):
    from studio_core.machine import leases
    from studio_core.runs import queue
    from studio_core.runs.manager import RunManager

    app.mark()  # new_page does not: the runs of the tests before are not this test's
    with leases.acquire(app.runs_dir, "cpu", [0, 1], holder="chat-holding-both", kind="chat"):
        page = new_page(app.url)
        set_number(page, "max_steps", 3)
        page.locator("#start").click()
        message = page.locator("#train-message")
        expect(message).to_contain_text("Queued run", timeout=60_000)
        expect(message).to_contain_text("queued, 1st of 1: waits for 1 free cpu core(s)")
        [first] = app.new_runs()
        page.locator("#start").click()
        expect(message).to_contain_text(f"queued, 2nd of 2: after run {first.id}", timeout=60_000)
        second = next(view for view in app.new_runs() if view.id != first.id)
        run_state(page, "QUEUED").wait_for(timeout=30_000)  # the Train tab follows the second
        expect(page.locator("#stop")).to_be_enabled()
        expect(page.locator("#stop-save")).to_be_disabled()  # nothing to save: it has not started

        page.get_by_role("tab", name="Runs").click()
        page.locator("#open-run input").first.click()
        page.get_by_role("option", name=second.id, exact=True).click(timeout=30_000)
        expect(page.locator("#runs-queue-first")).to_be_enabled(timeout=30_000)
        page.locator("#runs-queue-first").click()
        expect(page.locator("#runs-message")).to_contain_text("is now first in the queue", timeout=30_000)
        assert [path.name for path in queue.queued(app.runs_dir)] == [second.id, first.id]
        page.locator("#runs-stop").click()
        expect(page.locator("#runs-message")).to_contain_text("cancelled while queued: it never started",
                                                              timeout=30_000)
        RunManager(app.runs_dir).stop(first.id)
    assert [view.live_state for view in app.new_runs()] == ["stopped", "stopped"]
    assert queue.queued(app.runs_dir) == []


def test_a_sweep_from_the_page_is_ranked_its_curves_overlaid_and_its_best_run_opened(page, app):
    import re

    from studio_core.runs import sweep
    from studio_core.runs.manager import RunManager

    set_number(page, "max_steps", 10)
    page.get_by_text("Sweep: a run for each combination of values").click()
    page.locator("#sweep-grid textarea").fill("learning_rate=1e-3,3e-3")
    set_number(page, "sweep-parallel", 1)
    page.locator("#sweep-eval input").check()
    page.locator("#sweep-start").click()
    message = page.locator("#train-message")
    expect(message).to_contain_text("2 runs, through the queue, at most 1 at once", timeout=120_000)
    expect(message).to_contain_text("Each run is evaluated when it ends")
    sweep_id = re.search(r"Sweep (\S+): 2 runs", message.inner_text()).group(1)
    manager = RunManager(app.runs_dir)
    assert sorted(manager.wait(view.id).live_state for view in app.new_runs()) == ["finished", "finished"]
    deadline = time.monotonic() + 300  # the queue runner evaluates each run once it has finished
    while not all(isinstance(row["evaluation"], dict) for row in sweep.table(manager, sweep_id)):
        assert time.monotonic() < deadline, sweep.table(manager, sweep_id)
        time.sleep(1)
    rows = sweep.table(manager, sweep_id)

    page.get_by_role("tab", name="Runs").click()
    page.locator("#sweeps-box").get_by_text("Sweeps").first.click()
    page.locator("#sweep-pick input").first.click()
    page.get_by_role("option", name=sweep_id, exact=True).click(timeout=30_000)
    table = page.locator("#sweep-table")
    expect(table.locator("tbody tr").first).to_contain_text(rows[0]["id"], timeout=30_000)
    expect(table).to_contain_text("learning_rate=3e-3")
    expect(page.locator("#sweep-ranked")).to_contain_text("Best first by the evaluation's eval_loss")
    expect(table).to_contain_text("rouge_l")  # each run's evaluation, in its row
    page.locator("#compare-box").get_by_text("Compare runs").first.click()
    expect(page.locator("#compare-plot")).to_be_visible(timeout=30_000)  # both runs' curves, overlaid
    expect(page.locator("#compare-diff")).to_contain_text("learning_rate")  # the setting that differs
    page.locator("#sweep-best").click()
    expect(page.locator("#open-run input").first).to_have_value(rows[0]["id"], timeout=30_000)
    expect(page.locator("#runs-tab-status, .run-status").last).to_contain_text(rows[0]["id"], timeout=30_000)
    page.locator("#sweep-chat").click()  # one click: the Chat tab, the best run picked
    expect(page.locator("#chat-target input").first).to_have_value(rows[0]["id"], timeout=30_000)
    page.get_by_role("tab", name="Runs").click()
    page.locator("#sweep-export").click()  # and the Export tab
    expect(page.locator("#export-run input").first).to_have_value(rows[0]["id"], timeout=30_000)


def test_learning_rate_starts_at_trls_default_for_another_model_unless_typed(page):
    from studio_core.recipe.trl_schema import trainer_fields

    def shown(trainer_text: str) -> float:
        expect(box).to_contain_text(trainer_text)
        return float(page.locator("#learning_rate input").first.input_value())

    box = page.locator("#learning_rate")
    assert shown("suit the built-in tiny model") == 2e-3  # seconds on a CPU
    model = page.locator("#model input").first
    model.fill("Qwen/Qwen3-0.6B")
    model.press("Enter")
    assert shown("TRL's default for SFT (SFTConfig) is 2e-05;") == trainer_fields("sft")["learning_rate"]["default"]
    page.get_by_label("DPO (preference pairs)").check()
    assert shown("TRL's default for DPO (DPOConfig) is 1e-06;") == trainer_fields("dpo")["learning_rate"]["default"]
    set_number(page, "learning_rate", 5e-5)  # the user's own value stays
    page.get_by_label("GRPO (online RL with reward functions)").check()
    assert shown("your value; TRL's default for GRPO (GRPOConfig) is 1e-06") == 5e-5


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


def test_a_forecast_that_cannot_be_made_says_why(page, tmp_path):
    dataset = page.locator("#dataset input").first
    dataset.fill(str(tmp_path / "missing.jsonl"))
    dataset.press("Enter")
    page.locator("#forecast").click()
    report = page.locator("#forecast-report")
    expect(report).to_contain_text("No forecast:", timeout=60_000)
    expect(report).to_contain_text("missing.jsonl")
    expect(page.locator("#suggestions")).to_be_hidden()
