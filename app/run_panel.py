"""The live view of one run: state, progress and ETA, compilations, loss and learning-rate
plots, log tail.

Both tabs show runs the same way, so the widgets and the function that fills them live
here. Everything shown is read from the run's folder through the run manager, so a
reload, a second browser or a restarted app show the same thing.
"""

from __future__ import annotations

import html
import time

import gradio as gr
import pandas as pd

from app.hardware_panel import HardwarePanel
from studio_core.runs.manager import RunManager
from studio_core.runs.view import RunView, late_compile_text
from studio_core.sizes import MB

STATE_COLOURS = {"starting": "#b58900", "running": "#268bd2", "finished": "#2aa198",
                 "failed": "#dc322f", "stopped": "#6c71c4"}


class RunPanel:
    """The panel's widgets, made in the current Blocks context; `render` gives their values."""

    def __init__(self):
        self.status = gr.Markdown("No run selected.", elem_classes="run-status")
        self.progress = gr.HTML("")
        self.compiles = gr.HTML("", elem_classes="run-compiles")
        self.error = gr.Code(label="Error", visible=False, language=None, lines=8, elem_classes="run-error")
        with gr.Row():
            self.loss = gr.LinePlot(x="step", y="loss", title="Loss", height=260)
            self.lr = gr.LinePlot(x="step", y="learning_rate", title="Learning rate", height=260)
        self.hardware = HardwarePanel()  # under the loss
        self.log = gr.Textbox(label="Log (tail of train.log)", lines=12, max_lines=12, autoscroll=True,
                              interactive=False, elem_classes="run-log")
        with gr.Accordion("Settings the studio applied, and why", open=False):
            self.applied = gr.Markdown("")

    @property
    def components(self) -> list[gr.Component]:
        return [self.status, self.progress, self.compiles, self.error, self.loss, self.lr, self.log, self.applied,
                *self.hardware.components]

    def follow(self, timer: gr.Timer, manager: RunManager, run_id: gr.Component, pause: bool = False) -> None:
        """Redraw the panel on the ticks of `timer` for the run `run_id` names, but only when what
        it shows can have changed: a going run every tick (its clock moves), an ended run (or
        none) once. With `pause`, the timer stops once the run has ended and been drawn (start
        it again with `gr.Timer(active=True)` when another run is followed): an idle page then
        sends no request at all."""
        shown = gr.State(None)  # what this page shows now (see changes), or None

        def tick(wanted, last):
            update = self.changes(manager, wanted, last, shown)
            return update or ({timer: gr.Timer(active=False)} if pause else {shown: last})

        timer.tick(tick, [run_id, shown], [*self.components, shown, *([timer] if pause else [])],
                   show_progress="hidden")

    def changes(self, manager: RunManager, run_id: str | None, last, shown: gr.State) -> dict:
        """{widget: value} for this run when the page's `shown` state (`last`) is out of date, with
        the new state; {} when nothing changed (Gradio wants at least one output in a dict: a
        caller that sends nothing returns {shown: last}, which stays on the server)."""
        current = _shown_as(manager, run_id)
        if current is not None and current == last:
            return {}
        return {**self.render(manager, run_id), shown: current}

    def render(self, manager: RunManager, run_id: str | None) -> dict:
        """{widget: value} for this run (or for none)."""
        view, message = None, "No run selected."
        if run_id:
            try:
                view = manager.view(run_id)
            except KeyError:
                message = f"Run `{run_id}` not found in {manager.runs_dir}."
        if view is None:
            return {self.status: message, self.progress: "", self.compiles: "", self.error: gr.update(visible=False),
                    self.loss: _frame("loss"), self.lr: _frame("learning_rate"), self.log: "", self.applied: "",
                    **self.hardware.empty()}
        error = _error_text(view)
        return {self.status: status_markdown(view), self.progress: progress_html(view),
                self.compiles: compiles_html(view), self.error: gr.update(value=error, visible=bool(error)),
                self.loss: _frame("loss", view), self.lr: _frame("learning_rate", view), self.log: view.log_tail(),
                self.applied: applied_markdown(view), **self.hardware.render(view)}


def _shown_as(manager: RunManager, run_id: str | None) -> tuple | None:
    """What the panel shows for this run, as a value that changes when the view does; None
    while the run goes (its elapsed time and ETA change every second)."""
    if not run_id:
        return ("none",)
    try:
        view = manager.view(run_id)
    except KeyError:
        return ("missing", run_id)
    return None if view.active else (run_id, *view.version())


def status_markdown(view: RunView) -> str:
    state = view.live_state
    colour = STATE_COLOURS.get(state, "#586e75")
    parts = [f"<span style='color:{colour};font-weight:700'>{state.upper()}</span>", f"run `{view.id}`"]
    where = view.where()
    if where:
        parts.append(f"<span class='run-where'>{html.escape(where)}</span>")
    if state == "stopped" and view.reason:
        parts.append(html.escape(view.reason))
    if view.world_size:
        parts.append(f"{view.world_size} process{'es' if view.world_size > 1 else ''}")
    if view.exit_code is not None and state in ("failed", "stopped", "finished"):
        parts.append(f"exit code {view.exit_code}")
    duration = view.duration()
    if duration is not None:
        parts.append(f"elapsed {format_seconds(duration)}")
    last_loss = view.last_loss()
    if last_loss is not None:
        parts.append(f"loss {last_loss:.4f}")
    return " · ".join(parts)


def progress_html(view: RunView) -> str:
    total = view.max_steps or 0
    fraction = min(1.0, view.step / total) if total else 0.0
    eta = view.eta_seconds()
    label = f"step {view.step} / {total or '?'}"
    if eta is not None:
        label += f" · ETA {format_seconds(eta)} (compilation left out)"
    elif view.live_state == "starting":
        label = "starting: loading the model and data, building the trainer ..."
    download = view.download
    if download and view.live_state == "starting" and download["done_bytes"] < download["total_bytes"]:
        what = download.get("model") or f"dataset {download.get('dataset')}"
        fraction = download["done_bytes"] / download["total_bytes"]  # the bar shows the download meanwhile
        label = (f"downloading {what} (first use): {download['done_bytes'] / MB:,.1f} of "
                 f"{download['total_bytes'] / MB:,.1f} MB")
    return (f"<div class='run-progress' data-step='{view.step}' data-total='{total}'>"
            f"<div style='background:#eee8d5;border-radius:4px;height:14px'>"
            f"<div style='background:#268bd2;width:{fraction * 100:.1f}%;height:14px;border-radius:4px'></div>"
            f"</div><div style='font-size:0.9em;margin-top:4px'>{html.escape(label)}</div></div>"
            + checkpoints_html(view))


def checkpoints_html(view: RunView) -> str:
    """The run's checkpoints with step and size, and whether (and from where) it can resume."""
    found = view.saved_checkpoints()
    parts = []
    if found:
        listed = ", ".join(f"step {c['step']} ({c['size_bytes'] / MB:,.1f} MB)" for c in found)
        parts.append(f"<div class='checkpoint-list' data-count='{len(found)}'>Checkpoints: {listed}</div>")
    if view.live_state in ("stopped", "failed"):
        parts.append(f"<div class='resume-point'>Can resume from step {found[-1]['step']} (Resume).</div>"
                     if found else "<div class='resume-point'>Cannot resume: no checkpoint was saved (set "
                     "save_steps, or use Stop and save next time).</div>")
    return f"<div style='font-size:0.85em;margin-top:4px'>{''.join(parts)}</div>" if parts else ""


def compiles_html(view: RunView) -> str:
    """What is compiling now, the totals, a timeline of compile time against training time,
    and a warning for each compilation after the warm-up."""
    if not view.compiles and not view.compiling:
        return ""
    parts = []
    for (graph, phase), event in view.compiling.items():
        if view.ended is None:
            parts.append(f"<div class='compile-now'>Compiling now: graph {graph} ({phase}) for "
                         f"{format_seconds(time.time() - event['time'])}</div>")
    seconds = view.compile_seconds()
    wall = view.duration() or 0
    totals = (f"{len(view.compiles)} compilation(s) in {short_seconds(seconds)}"
              + (f" ({seconds / wall:.0%} of the run's time so far)" if wall > 0 else "")
              + f"; {len(view.shapes)} batch shape(s) reached the model")
    rate = view.tokens_per_second()
    if view.step_seconds:
        totals += f"; training {short_seconds(sum(view.step_seconds))} without compilation"
    if rate:
        totals += f", {rate:,.0f} tokens/s"
    parts.append(f"<div class='compile-totals'>{html.escape(totals)}</div>")
    parts.append(_timeline(view))
    for late in view.late_compiles()[-5:]:
        parts.append(f"<div class='compile-warning' style='color:#cb4b16'>{html.escape(late_compile_text(late))}"
                     "</div>")
    return f"<div class='compiles' data-compiles='{len(view.compiles)}'>{''.join(parts)}</div>"


def _timeline(view: RunView) -> str:
    """A bar from the first step's start to now (or the end): compile time in orange."""
    begin = view.started or (min(c["started"] for c in view.compiles) if view.compiles else None)
    end = view.ended or time.time()
    if not begin or end <= begin:
        return ""
    spans = [(c["started"], c["time"]) for c in view.compiles]
    spans += [(e["time"], end) for e in view.compiling.values()] if view.ended is None else []
    segments = "".join(
        f"<div class='compile-span' style='position:absolute;left:{(a - begin) / (end - begin) * 100:.2f}%;"
        f"width:{max(0.3, (b - a) / (end - begin) * 100):.2f}%;height:100%;background:#cb4b16'></div>"
        for a, b in spans if b >= begin)
    return ("<div class='compile-timeline' title='compile time (orange) against training time (blue)' "
            "style='position:relative;background:#268bd2;height:10px;border-radius:3px;margin:4px 0'>"
            f"{segments}</div><div style='font-size:0.8em'>timeline: compiling (orange), training (blue)</div>")


def applied_markdown(view: RunView) -> str:
    launch = view.launch()
    if not launch:
        return ""
    rows = [f"| `{key}` | `{value!r}` | {reason} |" for key, value, reason in launch.get("applied", [])]
    warnings = [f"- {w}" for w in launch.get("warnings", [])]
    table = "| setting | value | why |\n|---|---|---|\n" + "\n".join(rows) if rows else "None."
    return table + ("\n\n**Warnings**\n" + "\n".join(warnings) if warnings else "")


def _error_text(view: RunView) -> str:
    if view.live_state != "failed":
        return ""
    last = view.errors[-1] if view.errors else {}
    return "\n".join(filter(None, [view.error_text, last.get("traceback", "")]))


def _frame(metric: str, view: RunView | None = None) -> pd.DataFrame:
    rows = [(m["step"], m[metric]) for m in (view.metrics if view else []) if metric in m and "step" in m]
    return pd.DataFrame(rows, columns=["step", metric], dtype=float)


def format_seconds(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def short_seconds(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 60 else format_seconds(seconds)


def format_time(timestamp: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp)) if timestamp else ""
