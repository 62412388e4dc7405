"""The web app: Train, Runs, Chat, Export and Doctor tabs over one run manager.

    python launch.py [--port 7860]

The app holds no run state of its own: every value shown is read from the runs folder,
so closing the page, opening a second browser or restarting the app loses nothing.
"""

from __future__ import annotations

import gradio as gr

from app import cache_panel, chat_tab, doctor_tab, export_tab, runs_tab, train_tab
from studio_core.hardware import Hardware, detect_hardware
from studio_core.runs.manager import RunManager

CSS = ".run-status {font-size: 1.05em} .run-log textarea {font-family: monospace; font-size: 0.8em}"
# Gradio's queue looks for work every 1 ms and for progress to send every 10 ms when idle (its
# Queue.sleep_when_free, progress_update_sleep_when_free on Linux): about 0.05 of a core for an
# app nobody uses. Every 20 ms and 100 ms cost a click 20 ms at most and the app next to nothing.
QUEUE_IDLE_S = 0.02
PROGRESS_IDLE_S = 0.1


def latest_active_run(manager: RunManager) -> str | None:
    """The run a fresh page should follow: the newest one still going, if any."""
    for view in manager.list():
        if view.active:
            return view.id
    return None


def queued(demo: gr.Blocks) -> gr.Blocks:
    """The app with its queue, which polls at a pace an idle app does not feel."""
    demo.queue()
    demo._queue.sleep_when_free = QUEUE_IDLE_S  # private to Gradio 6; tests/test_structure checks it is there
    demo._queue.progress_update_sleep_when_free = PROGRESS_IDLE_S
    return demo


def build_app(runs_dir=None, hardware: Hardware | None = None) -> gr.Blocks:
    manager = RunManager(runs_dir)
    hardware = hardware or detect_hardware()
    with gr.Blocks(title="Trainium fine-tuning studio") as demo:
        gr.Markdown("# Trainium fine-tuning studio")
        selected = gr.State(None)  # the run this page's Train tab follows
        with gr.Tabs() as tabs:
            with gr.Tab("Train", id="train", elem_id="tab-train"):
                form, follow = train_tab.build(manager, hardware, selected)
            with gr.Tab("Runs", id="runs", elem_id="tab-runs"):
                runs_tab.build(manager, demo, form, tabs, train_tab_id="train")
                cache_panel.build(manager, hardware.backend, demo)
            with gr.Tab("Chat", id="chat", elem_id="tab-chat"):
                chat_tab.build(manager, hardware, demo)
            with gr.Tab("Export", id="export", elem_id="tab-export"):
                export_tab.build(manager, hardware, demo)
            with gr.Tab("Doctor", id="doctor", elem_id="tab-doctor"):
                doctor_tab.build(manager, hardware)
        demo.load(lambda: latest_active_run(manager), None, selected).then(
            lambda: gr.Timer(active=True), None, follow)  # the run found, if any, is followed
    return demo
