"""Compare runs (Runs tab): their curves of one metric overlaid in one plot, each run's last
value of it, their settings side by side, only those that differ (from each run's
spec.yaml, keys flattened: `studio.nproc`, `model_init_kwargs.dtype`), and the tuned model's
mean scores in each run's latest evaluation (the Evaluate tab's), when one has any.

The engine is studio_core.runs.history and studio_core.evaluate.evaluation; this module only lays it out.
"""

from __future__ import annotations

import gradio as gr
import pandas as pd

from app.run_panel import STEP_AXES
from studio_core.evaluate import evaluation
from studio_core.runs import history
from studio_core.runs.manager import RunManager
from studio_core.runs.view import RunView, format_loss, format_time

# A legend label's characters at most: Vega cuts a longer label at 160 px with "…" (about 34 of an
# id's characters), and the runs of one sweep (one recipe, started in the same second) share their
# first 30 or more, so cut ids read the same. 24 characters of the legend's font fit in 160 px, even
# wide ones (w, m).
LEGEND_CHARS = 24


def _views(manager: RunManager, run_ids: list[str] | None) -> tuple[list[RunView], list[str]]:
    """The runs still there, and the ids that are not (deleted since they were picked)."""
    views, missing = [], []
    for run_id in run_ids or []:
        try:
            views.append(manager.view(run_id))
        except KeyError:
            missing.append(run_id)
    return views, missing


def legend_labels(run_ids: list[str]) -> dict[str, str]:
    """Each run's label in the plot's legend, all different: its id, or for a longer one "…" and the
    id's end (its name's end and the random part that tells it from the runs of the same second).
    Runs whose ends are the same are numbered as the table under the plot lists them."""
    def end(run_id: str, room: int) -> str:
        return run_id if len(run_id) <= room else "…" + run_id[len(run_id) - room + 1:]

    labels = [end(run_id, LEGEND_CHARS) for run_id in run_ids]
    if len(set(labels)) < len(labels):
        labels = [f"{n} {end(run_id, LEGEND_CHARS - len(str(n)) - 1)}" for n, run_id in enumerate(run_ids, 1)]
    return dict(zip(run_ids, labels))


def curves(views: list[RunView], metric: str | None) -> tuple[gr.LinePlot, str]:
    """The overlaid plot (hidden while there is nothing to overlay), and a table of each run's
    last value of the metric."""
    rows = history.metric_curves(views, metric) if metric and len(views) >= 2 else []
    if not rows:  # hidden, not emptied: Gradio 6's plot draws no lines for data that follows an empty frame
        return gr.LinePlot(value=None, visible=False), ""
    labels = legend_labels([view.id for view in views])
    frame = pd.DataFrame([{**row, "run": labels[row["run"]]} for row in rows], columns=["run", "step", "value"]
                         ).astype({"run": str, "step": float, "value": float})
    lines = [f"| run | last {metric} | at step |", "|---|---|---|"]
    for view in views:
        points = [r for r in rows if r["run"] == view.id]
        last = points[-1] if points else None
        lines.append(f"| `{view.id}` | {format_loss(last['value'])} | {last['step']} |" if last
                     else f"| `{view.id}` | - | - |")
    return gr.LinePlot(value=frame, y_title=metric, visible=True), "\n".join(lines)


def evaluation_rows(views: list[RunView]) -> pd.DataFrame | None:
    """A row per thing compared (when, on what data, how many rows, then each metric of the tuned
    model), a column per run, from each run's latest evaluation; None when none has one."""
    latest = {}
    for view in views:
        found = evaluation.evaluations(view.dir)
        if found:
            latest[view.id] = found[0]
    if not latest:
        return None
    metrics = list(dict.fromkeys(m for s in latest.values() for m in s.get("results", {}).get("tuned", {})))
    rows = [["evaluated", *[format_time(latest[v.id].get("time")) if v.id in latest else "" for v in views]],
            ["data", *[f"{latest[v.id].get('data')} ({latest[v.id].get('split')})" if v.id in latest else ""
                       for v in views]],
            ["rows", *[str(latest[v.id].get("rows")) if v.id in latest else "" for v in views]]]
    for metric in metrics:
        values = [latest[v.id].get("results", {}).get("tuned", {}).get(metric) if v.id in latest else None
                  for v in views]
        rows.append([f"{metric} (tuned)", *["" if x is None else f"{x:.4g}" for x in values]])
    return pd.DataFrame(rows, columns=["latest evaluation", *[v.id for v in views]])


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
        plot = gr.LinePlot(x="step", y="value", color="run", height=300, visible=False, elem_id="compare-plot",
                           **STEP_AXES)
        last = gr.Markdown("", elem_id="compare-last")
        gr.Markdown("**Settings that differ** (spec.yaml: the recipe with the defaults the studio applied)")
        diff = gr.Dataframe(interactive=False, wrap=True, elem_id="compare-diff")
        scores = gr.Dataframe(interactive=False, wrap=True, visible=False, elem_id="compare-evals",
                              label="Latest evaluation (Evaluate tab): the tuned model's mean scores")

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
        evaluated = evaluation_rows(views) if len(views) >= 2 else None
        return {metric: gr.update(choices=names, value=chosen), plot: shown_plot, last: table,
                diff: pd.DataFrame(rows, columns=["setting", *[v.id for v in views]]), note: " ".join(notes),
                scores: gr.update(value=evaluated, visible=evaluated is not None)}

    def on_metric(run_ids, name):
        return curves(_views(manager, run_ids)[0], name)

    picked.change(on_pick, [picked, metric], [metric, plot, last, diff, note, scores])
    metric.change(on_metric, [picked, metric], [plot, last])
    return picked
