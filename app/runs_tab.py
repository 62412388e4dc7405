"""The Runs tab: every run in the runs folder, and one opened with its plots and log."""

from __future__ import annotations

import gradio as gr
import pandas as pd

from app import run_panel
from studio_core.runs import RunManager

COLUMNS = ["run", "state", "trainer", "model", "dataset", "started", "duration", "steps", "final loss"]


def runs_table(manager: RunManager) -> pd.DataFrame:
    rows = []
    for view in manager.list():
        spec = view.spec
        loss = next((m["loss"] for m in reversed(view.metrics) if "loss" in m), None)
        duration = view.duration()
        rows.append([view.id, view.live_state, spec.get("studio", {}).get("trainer", ""),
                     spec.get("model_name_or_path", ""), spec.get("dataset_name", ""),
                     run_panel.format_time(view.created),
                     run_panel.format_seconds(duration) if duration is not None else "",
                     f"{view.step}/{view.max_steps or '?'}", "" if loss is None else round(loss, 4)])
    return pd.DataFrame(rows, columns=COLUMNS)


def build(manager: RunManager) -> tuple[gr.Dataframe, gr.Dropdown, gr.Timer]:
    with gr.Row():
        refresh = gr.Button("Refresh", scale=0)
        opened = gr.Dropdown([], label="Open run", allow_custom_value=False, elem_id="open-run", scale=3)
    table = gr.Dataframe(runs_table(manager), headers=COLUMNS, interactive=False, elem_id="runs-table")
    panel = run_panel.make_panel()
    with gr.Accordion("Spec (spec.yaml: the recipe with the applied defaults)", open=False):
        spec_code = gr.Code(language="yaml", lines=16)

    def on_refresh(current):
        frame = runs_table(manager)
        ids = frame["run"].tolist()
        return frame, gr.update(choices=ids, value=current if current in ids else None)

    def on_open(run_id):
        spec_text = (manager.runs_dir / run_id / "spec.yaml").read_text() if run_id else ""
        return [*run_panel.render(manager, run_id), spec_text]

    def on_select(frame: pd.DataFrame, event: gr.SelectData):
        return frame.iloc[event.index[0]]["run"]

    refresh.click(on_refresh, opened, [table, opened])
    table.select(on_select, table, opened)
    opened.change(on_open, opened, [*panel, spec_code])
    timer = gr.Timer(2.0)
    timer.tick(lambda run_id: run_panel.render(manager, run_id), opened, panel, show_progress="hidden")
    timer.tick(on_refresh, opened, [table, opened], show_progress="hidden")
    return table, opened, timer
