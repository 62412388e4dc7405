"""Compare runs (Runs tab): their curves of one metric overlaid in one plot, each run's last
value of it, and their settings side by side, only those that differ (from each run's
spec.yaml, keys flattened: `studio.nproc`, `model_init_kwargs.dtype`).

The engine is studio_core.history; this module only lays it out.
"""

from __future__ import annotations

import gradio as gr
import pandas as pd

from studio_core import history
from studio_core.runs.manager import RunManager
from studio_core.runs.view import RunView


def _views(manager: RunManager, run_ids: list[str] | None) -> tuple[list[RunView], list[str]]:
    """The runs still there, and the ids that are not (deleted since they were picked)."""
    views, missing = [], []
    for run_id in run_ids or []:
        try:
            views.append(manager.view(run_id))
        except KeyError:
            missing.append(run_id)
    return views, missing


def curves(views: list[RunView], metric: str | None) -> tuple[gr.LinePlot, str]:
    """The overlaid plot (hidden while there is nothing to overlay), and a table of each run's
    last value of the metric."""
    rows = history.metric_curves(views, metric) if metric and len(views) >= 2 else []
    if not rows:  # hidden, not emptied: Gradio 6's plot draws no lines for data that follows an empty frame
        return gr.LinePlot(value=None, visible=False), ""
    frame = pd.DataFrame(rows, columns=["run", "step", "value"]).astype({"run": str, "step": float, "value": float})
    lines = [f"| run | last {metric} | at step |", "|---|---|---|"]
    for view in views:
        points = [r for r in rows if r["run"] == view.id]
        last = points[-1] if points else None
        lines.append(f"| `{view.id}` | {last['value']:.4g} | {last['step']} |" if last else f"| `{view.id}` | - | - |")
    return gr.LinePlot(value=frame, y_title=metric, visible=True), "\n".join(lines)


def build(manager: RunManager) -> gr.Dropdown:
    """Create the compare section in the current Blocks context; returns its run picker,
    whose choices the Runs tab keeps current."""
    with gr.Accordion("Compare runs", open=False, elem_id="compare-box"):
        with gr.Row():
            # allow_custom_value: a picked run deleted since stays picked without an error
            picked = gr.Dropdown([], multiselect=True, allow_custom_value=True, scale=3, elem_id="compare-runs",
                                 label="Runs to compare (two or more)")
            metric = gr.Dropdown([], label="Metric (those all these runs logged)", scale=1,
                                 elem_id="compare-metric")
        note = gr.Markdown("", elem_id="compare-note")
        plot = gr.LinePlot(x="step", y="value", color="run", height=300, visible=False, elem_id="compare-plot")
        last = gr.Markdown("", elem_id="compare-last")
        gr.Markdown("**Settings that differ** (spec.yaml: the recipe with the defaults the studio applied)")
        diff = gr.Dataframe(interactive=False, wrap=True, elem_id="compare-diff")

    def on_pick(run_ids, current):
        views, missing = _views(manager, run_ids)
        names = history.metric_names(views)
        chosen = current if current in names else (names[0] if names else None)
        rows = history.settings_diff({v.id: v.spec for v in views}) if len(views) >= 2 else []
        shown_plot, table = curves(views, chosen)
        notes = [f"Not found (deleted?): {', '.join(missing)}."] if missing else []
        if len(views) < 2:
            notes.append("Pick two or more runs.")
        elif not rows:
            notes.append("Their settings are the same.")
        elif not names:
            notes.append("These runs have no logged metric in common yet.")
        return {metric: gr.update(choices=names, value=chosen), plot: shown_plot, last: table,
                diff: pd.DataFrame(rows, columns=["setting", *[v.id for v in views]]), note: " ".join(notes)}

    def on_metric(run_ids, name):
        return curves(_views(manager, run_ids)[0], name)

    picked.change(on_pick, [picked, metric], [metric, plot, last, diff, note])
    metric.change(on_metric, [picked, metric], [plot, last])
    return picked
