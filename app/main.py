"""The web app: Train, Runs, Chat, Evaluate, Export and Doctor tabs over one run manager.

    python launch.py [--port 7860]

The app holds no run state of its own: every value shown is read from the runs folder,
so closing the page, opening a second browser or restarting the app loses nothing.
"""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from app import cache_panel, chat_tab, doctor_tab, eval_tab, export_tab, runs_tab, sweep_panel, train_tab
from studio_core.machine.hardware import Hardware, detect_hardware
from studio_core.runs import queue
from studio_core.runs.manager import RunManager

# A table's column header wraps between its words, not inside one: Gradio's wrapped Dataframe let a word
# break anywhere (a narrow column's "step" read "ste" over "p"). A column sized by its content is now as
# wide as its header's longest word. The Runs table's columns are fixed shares of its width: in a
# window narrower than about 1200 px they would be too narrow for "trainer" or "started", so the
# table keeps that width and scrolls sideways there.
CSS = (".run-status {font-size: 1.05em} .run-log textarea {font-family: monospace; font-size: 0.8em} "
       ".field-help {font-size: 0.85em; color: var(--block-info-text-color)} "
       "th span.header.text {word-break: normal; overflow-wrap: break-word} "
       "#runs-table table {min-width: 1150px}")
# A log box follows its end as the run writes, and stays where the user scrolled up to read
# (Gradio's own autoscroll left it at the top when its value was replaced by the timer). Each
# box remembers whether it was at its end before new text came.
LOG_FOLLOW_JS = """
<script>
(() => {
  const atEnd = new WeakMap(), seen = new WeakMap(), kept = new WeakMap(), touched = new WeakMap();
  const near = (box) => box.scrollHeight - box.scrollTop - box.clientHeight < 24;
  setInterval(() => {
    for (const box of document.querySelectorAll('.run-log textarea')) {
      if (!seen.has(box)) {
        atEnd.set(box, true);
        for (const kind of ['wheel', 'pointerdown', 'keydown', 'touchstart'])
          box.addEventListener(kind, () => touched.set(box, Date.now()), {passive: true});
        box.addEventListener('scroll', () => {
          // the user's scrolling (a hand on the box just now, or no new value since the last look),
          // not the reflow of a new value, which the check below puts back
          if (Date.now() - (touched.get(box) || 0) < 1000 || seen.get(box) === box.value) {
            atEnd.set(box, near(box)); kept.set(box, box.scrollTop);
          }
        });
      }
      if (seen.get(box) !== box.value) {
        seen.set(box, box.value);
        if (!atEnd.get(box)) box.scrollTop = kept.get(box) || 0;
      }
      // at its end: there again after new text, or once its tab is shown
      if (atEnd.get(box) && box.clientHeight > 0 && !near(box)) box.scrollTop = box.scrollHeight;
    }
  }, 250);
})();
</script>
"""
# Gradio's queue looks for work every 1 ms and for progress to send every 10 ms when idle (its
# Queue.sleep_when_free, progress_update_sleep_when_free on Linux): about 0.05 of a core for an
# app nobody uses. Every 20 ms and 100 ms cost a click 20 ms at most and the app next to nothing.
QUEUE_IDLE_S = 0.02
PROGRESS_IDLE_S = 0.1


def run_to_follow(manager: RunManager) -> str | None:
    """The run a fresh page's Train tab follows: the newest one still going, else the newest
    run if it was stopped (or failed) and can resume, so Resume is at hand after a reload."""
    views = manager.list()
    for view in views:
        if view.active:
            return view.id
    if views and views[0].live_state in ("stopped", "failed") and views[0].saved_checkpoints():
        return views[0].id
    return None


def queued(demo: gr.Blocks) -> gr.Blocks:
    """The app with its queue, which polls at a pace an idle app does not feel."""
    demo.queue()
    demo._queue.sleep_when_free = QUEUE_IDLE_S  # private to Gradio 6; tests/test_structure checks it is there
    demo._queue.progress_update_sleep_when_free = PROGRESS_IDLE_S
    return demo


def launch_settings(runs_dir: Path) -> dict:
    """The settings of Gradio's launch() that are the app's: its style and script, and the one
    folder of ours whose files the page offers (exported launch scripts). Gradio hands out
    only files in its temp folder, the working directory or `allowed_paths`; the default runs
    folder (~/trn-studio/runs) is in none of them."""
    return {"css": CSS, "head": LOG_FOLLOW_JS, "allowed_paths": [str(Path(runs_dir) / "exports")]}


def build_app(runs_dir=None, hardware: Hardware | None = None) -> gr.Blocks:
    manager = RunManager(runs_dir)
    RunManager.fork_runs_from_a_zygote()  # the app starts one run after another: each but the first sooner
    queue.ensure_runner(manager.runs_dir)  # after a reboot: its queued runs start again when their cores are free
    hardware = hardware or detect_hardware()
    with gr.Blocks(title="Trainium fine-tuning studio") as demo:
        gr.Markdown("# Trainium fine-tuning studio")
        selected = gr.State(None)  # the run this page's Train tab follows
        with gr.Tabs() as tabs:
            with gr.Tab("Train", id="train", elem_id="tab-train"):
                form, follow = train_tab.build(manager, hardware, selected)
            with gr.Tab("Runs", id="runs", elem_id="tab-runs"):
                *_, best = runs_tab.build(manager, demo, hardware, form, tabs, train_tab_id="train",
                                          train_follow=(selected, follow))
                cache_panel.build(manager, hardware.backend, demo)
            with gr.Tab("Chat", id="chat", elem_id="tab-chat"):
                to_chat = chat_tab.build(manager, hardware, demo)
            with gr.Tab("Evaluate", id="eval", elem_id="tab-eval"):
                eval_tab.build(manager, hardware, demo)
            with gr.Tab("Export", id="export", elem_id="tab-export"):
                to_export = export_tab.build(manager, hardware, demo)
            with gr.Tab("Doctor", id="doctor", elem_id="tab-doctor"):
                doctor_tab.build(manager, hardware)
        sweep_panel.link(best, tabs, to_chat, to_export)  # a sweep's best run, one click from chat and export
        demo.load(lambda: run_to_follow(manager), None, selected).then(
            lambda: gr.Timer(active=True), None, follow)  # the run found, if any, is followed
    return demo
