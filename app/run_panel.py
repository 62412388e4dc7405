"""The live view of one run: state, progress and ETA, compilations, loss, learning-rate and
the trainer's own plots, hardware, log tail; and the Stop, Stop and save and Resume buttons,
enabled as they apply to the run shown.

Both tabs show runs the same way, so the widgets and the function that fills them live
here. Everything shown is read from the run's folder through the run manager, so a
reload, a second browser or a restarted app show the same thing.
"""

from __future__ import annotations

import fnmatch
import html
import time
from dataclasses import dataclass

import gradio as gr
import pandas as pd

from app.hardware_panel import AXES, HardwarePanel
from studio_core.backends import StopError
from studio_core.runs import history, queue
from studio_core.training import precompile
from studio_core.recipe import trainers
from studio_core.machine.hardware import Hardware
from studio_core.runs.manager import RunManager
from studio_core.runs.view import (ACTIVE_STATES, RunView, compile_totals_text, compiling_text, format_loss,
                                   format_seconds, late_compile_text, memory_text, short_seconds,
                                   studio_cost_text)
from studio_core.machine.sizes import MB
from studio_core.recipe.spec import SpecError

STATE_COLOURS = {"queued": "#93a1a1", "starting": "#b58900", "running": "#268bd2", "finished": "#2aa198",
                 "failed": "#dc322f", "stopped": "#6c71c4"}
TRAINER_PLOTS = max(len(t.plots) for t in trainers.TRAINERS.values())  # the most plots a trainer has
# How often a page looks at the run it shows: a new event shows within this plus the redraw
# (bench/page_latency.py measures it; the goal is under 1 s). A look that finds nothing new sends
# nothing (RunPanel.changes), and the looks bypass Gradio's queue (queue=False), where an event
# that does nothing costs the app about 10 ms of CPU instead of 3.5 ms.
# the step axis: "~g" writes a long run's ticks as "1e+2" ... "8.4e+2" (Vega rounds them to the tick
# step's precision); "~f" writes them whole ("100" ... "800"), with a fraction only between a short run's steps
STEP_AXES = {**AXES, "x_axis_format": "~f"}
LOOK_EVERY_S = 0.5
# How often a going run's plots are redrawn at most: each redraw of a plot is Vega's whole drawing
# in the page. Redrawn at every look, the four plots of a tiny CPU run that logs every step took
# headless Chromium 38 % of a core while a page followed it; at most every 2 s, 26 % (bench/
# page_cpu.py, 5 alternated rounds). The status, progress bar, compilations and log still show a new
# event at the next look; an ended run is drawn whole at once.
PLOTS_EVERY_S = 2.0


QUEUED_LOOK_S = 2.0  # how often a queued resume's message is looked at again
CANCELS = "Stop cancels it."  # the end of a queued run's message, while it waits


class RunControls:
    """Stop, Stop and save, Resume and, for a queued run, Move to the front, for the run a page
    shows (`prefix` keeps the element ids of two tabs apart), each enabled only when it applies
    to that run. Stop cancels a queued run."""

    def __init__(self, prefix: str = ""):
        with gr.Row():
            self.stop = gr.Button("Stop", variant="stop", interactive=False, elem_id=f"{prefix}stop")
            self.save = gr.Button("Stop and save", interactive=False, elem_id=f"{prefix}stop-save")
            self.resume = gr.Button("Resume", interactive=False, elem_id=f"{prefix}resume")
            self.first = gr.Button("Move to the front of the queue", interactive=False, visible=False,
                                   elem_id=f"{prefix}queue-first")

    @property
    def components(self) -> list[gr.Component]:
        return [self.stop, self.save, self.resume, self.first]

    def states(self, view: RunView | None) -> dict:
        """{button: enabled or not} for this run (or for none)."""
        going = view is not None and view.active
        queued = going and view.live_state == "queued"
        resumable = (view is not None and view.live_state in ("stopped", "failed") and not view.spec_problem
                     and bool(view.saved_checkpoints()))
        return {self.stop: gr.update(interactive=going), self.save: gr.update(interactive=going and not queued),
                self.resume: gr.update(interactive=resumable),
                self.first: gr.update(visible=queued, interactive=queued and queue.place(view.dir)[0] > 1)}

    def wire(self, manager: RunManager, hardware: Hardware, run_id: gr.Component, message: gr.Component,
             queued_by: tuple = ()):
        """The buttons act on the run `run_id` names and say what they did in `message`; returns
        Resume's event (a page that follows the run chains on it). `queued_by`: the page's other
        events that may queue the run `run_id` then names, saying so in `message` (the Train tab's Start)."""
        self.stop.click(lambda r: stop_run(manager, r), run_id, message)
        self.save.click(lambda r: stop_and_save(manager, r), run_id, message)
        self.first.click(lambda r: move_to_front(manager, r), run_id, message)
        resumed = self.resume.click(lambda r: resume_run(manager, hardware, r), run_id, message)
        # a queued run's message ("... Stop cancels it") is looked at again until the run leaves
        # the queue, and then says what became of it
        waiting, waits_for = gr.Timer(QUEUED_LOOK_S, active=False), gr.State(None)
        for queuing in (resumed, *queued_by):
            queuing.then(waiting_for, [run_id, message], [waits_for, waiting], show_progress="hidden")
        waiting.tick(lambda r, said: left_queue(manager, r, said), [waits_for, message], [message, waiting],
                     show_progress="hidden")
        return resumed


def move_to_front(manager: RunManager, run_id: str | None) -> str:
    if not run_id:
        return "No run to move."
    try:
        queue.move(manager.runs_dir, run_id, 1)
    except queue.QueueError as error:
        return f"**Not moved:** {error}"
    return f"Run `{run_id}` is now first in the queue: it starts as soon as its cores are free."


def stop_run(manager: RunManager, run_id: str | None) -> str:
    if not run_id:
        return "No run to stop."
    try:
        queued = manager.view(run_id).live_state == "queued"
        view = manager.stop(run_id)
    except StopError as error:
        return f"**Not stopped:** {error}"
    if view.reason == queue.CANCELLED:
        return f"Run `{run_id}` was cancelled while queued: it never started."
    if queued and view.live_state != "queued":  # a queued resume, called off
        return f"The resume of run `{run_id}` was cancelled while queued: the run is {view.live_state}, as it was."
    return f"Run `{run_id}` is {view.live_state}; none of its processes is left."


def stop_and_save(manager: RunManager, run_id: str | None) -> str:
    if not run_id:
        return "No run to stop."
    try:
        manager.stop_and_save(run_id)
    except SpecError as error:
        return "**Not stopped:** " + "; ".join(error.problems)
    return f"Run `{run_id}` saves a checkpoint at its next step, then stops; Resume goes on from there."


def resume_run(manager: RunManager, hardware: Hardware, run_id: str | None) -> str:
    if not run_id:
        return "No run to resume: open one in the Runs tab."
    try:
        view = manager.resume(run_id, hardware, queue_if_busy=True)
    except (SpecError, KeyError) as error:
        problems = error.problems if isinstance(error, SpecError) else [str(error).strip("'\"")]
        return "**Not resumed:** " + "; ".join(problems)
    if view.live_state == "queued":  # no cores are free: it waits for them, as Start queues a run
        return f"Run `{run_id}` {view.where()}. {CANCELS}"
    return resumed_text(view)


def started_text(view: RunView, from_queue: bool = False) -> str:
    """What Start says of the run it started (`from_queue`: once the run it queued has started)."""
    where = view.where()
    said = f"Run `{view.id}` left the queue and started" if from_queue else f"Started run `{view.id}`"
    return said + (f" ({where})" if where else "") + ". It keeps going if you close this page."


def resumed_text(view: RunView) -> str:
    loads = view.resumed_from()  # the checkpoint it loads, which its launch record names
    return f"Run `{view.id}` resumed from step {view.step}" + (f" ({loads.rstrip('/').rsplit('/', 1)[-1]})." if loads else ".")


def waiting_for(run_id: str | None, said: str | None) -> tuple:
    """(the run a Start or Resume queued, or None; its timer, running while the message says the run
    waits). Read from the message, not the run: on a busy machine the run may have left the queue
    before this is asked, and the next tick still says what became of it."""
    queued = bool(run_id) and bool(said) and f"`{run_id}`" in said and said.endswith(CANCELS)
    return (run_id if queued else None), gr.Timer(active=queued)


def left_queue(manager: RunManager, run_id: str | None, said: str | None) -> tuple:
    """(the message, the timer) once the queued run `run_id` (a Start's or a Resume's) left the queue:
    what became of it in place of "queued ... Stop cancels it" (a message since said of something else
    is kept). A run whose events say it starts is starting, also while it reads as its last attempt
    ended (its processes not there yet: a resumed run reads as stopped until then)."""
    view = manager.view_or_none(run_id) if run_id else None
    if view is not None and view.live_state == "queued":
        return gr.update(), gr.update()
    queued_text = bool(said) and f"`{run_id}`" in said and said.endswith(CANCELS)
    if view is None or not queued_text:
        return gr.update(), gr.Timer(active=False)
    if view.active or view.state in ACTIVE_STATES:
        text = resumed_text(view) if view.attempts > 1 else started_text(view, from_queue=True)
    else:
        text = f"Run `{run_id}` left the queue: it is {view.live_state}."
    return text, gr.Timer(active=False)


class RunPanel:
    """The panel's widgets, made in the current Blocks context; `render` gives their values.
    The summary (state, progress, compilations, error) is made at once; the details (plots,
    hardware, log, applied settings) too, unless `details=False`: then `build_details()` makes
    them where the page wants them (the Train tab puts them under its form, full width)."""

    def __init__(self, controls: RunControls | None = None, details: bool = True):
        self.controls = controls
        self.status = gr.Markdown("No run selected.", elem_classes="run-status")
        self.progress = gr.HTML("")
        self.compiles = gr.HTML("", elem_classes="run-compiles")
        self.error = gr.Code(label="Error", visible=False, language=None, lines=8, elem_classes="run-error")
        if details:
            self.build_details()

    def build_details(self) -> None:
        with gr.Row():
            # both sets in the colour map from the start: a series that comes later (the first
            # evaluation) would otherwise be outside the colour scale Gradio fixed, and invisible
            # hidden until there is a point to draw (plot_update): an empty plot is an untitled frame
            self.loss = gr.LinePlot(x="step", y="loss", color="set", title="Loss", height=260, visible=False,
                                    color_map={"training": "#268bd2", "evaluation": "#dc322f"},
                                    elem_classes="loss-plot", **STEP_AXES)
            self.lr = gr.LinePlot(x="step", y="learning_rate", title="Learning rate", height=260, visible=False,
                                  **STEP_AXES)
        with gr.Row():  # the trainer's own metrics (trainers.Trainer.plots): rewards, KL, accuracy, ...
            self.trainer_plots = [gr.LinePlot(x="step", y="value", color="metric", height=260, visible=False,
                                              elem_classes="trainer-plot", **STEP_AXES) for _ in range(TRAINER_PLOTS)]
        self.hardware = HardwarePanel()  # under the loss
        self.log = gr.Textbox(label="Log (tail of train.log)", lines=12, max_lines=12, autoscroll=True,
                              interactive=False, elem_classes="run-log")
        with gr.Accordion("Settings the studio applied, and why", open=False):
            self.applied = gr.HTML("", elem_classes="run-applied")

    @property
    def components(self) -> list[gr.Component]:
        return [self.status, self.progress, self.compiles, self.error, self.loss, self.lr, *self.trainer_plots,
                self.log, self.applied, *self.hardware.components,
                *(self.controls.components if self.controls else [])]

    @property
    def plots(self) -> set[gr.Component]:
        return {self.loss, self.lr, *self.trainer_plots, *self.hardware.plots}

    def follow(self, timer: gr.Timer, manager: RunManager, run_id: gr.Component, pause: bool = False) -> None:
        """Redraw the panel on the ticks of `timer` for the run `run_id` names, but only when what
        it shows can have changed: a going run when its files changed (all of it, its plots at most
        every PLOTS_EVERY_S) or its clock moved a second (its times), an ended run (or none) once.
        With `pause`, the timer stops once the run has ended and been drawn (start it again with
        `gr.Timer(active=True)` when another run is followed): an idle page then sends no request."""
        shown = gr.State(None)  # what this page shows now (see changes), or None

        def tick(wanted, last):
            update = self.changes(manager, wanted, last, shown)
            if update or not pause or going(last):  # nothing new (last is current): pause once ended
                return update or {shown: last}
            return {timer: gr.Timer(active=False)}

        timer.tick(tick, [run_id, shown], [*self.components, shown, *([timer] if pause else [])],
                   show_progress="hidden", queue=False)  # see LOOK_EVERY_S

    def changes(self, manager: RunManager, run_id: str | None, last: Shown | None, shown: gr.State) -> dict:
        """{widget: value} for this run when the page's `shown` state (`last`) is out of date, with
        the new state; {} when nothing changed (Gradio wants at least one output in a dict: a
        caller that sends nothing returns {shown: last}, which stays on the server). A going run's
        plots are sent at most every PLOTS_EVERY_S: newer ones wait (`Shown.plots_behind`) for
        the first look after that."""
        current, view = _shown_as(manager, run_id)
        last = last or Shown(None)
        now, plots = time.monotonic(), self.plots
        plots_due = last.plots_behind and now - last.plots_at >= PLOTS_EVERY_S
        if current == last.view and not plots_due:
            return {}
        if going(last) and current[:-1] == last.view[:-1]:  # the clock moved, or plots are due
            update = self.clock(view)
            if plots_due:
                update |= {widget: value for widget, value in self.render(manager, run_id).items() if widget in plots}
        else:
            update = self.render(manager, run_id)
        # the same run, still going, its plots drawn lately: they wait
        held = (going(last) and _is_going(current) and current[0] == last.view[0]
                and now - last.plots_at < PLOTS_EVERY_S and any(widget in plots for widget in update))
        if held:
            update = {widget: value for widget, value in update.items() if widget not in plots}
        drawn = any(widget in plots for widget in update)
        return {**update, shown: Shown(current, now if drawn else last.plots_at,
                                       plots_behind=(last.plots_behind or held) and not drawn)}

    def clock(self, view: RunView) -> dict:
        """{widget: value} of the widgets that show the time (elapsed, compiling for ...): what
        changes in a going run's panel while its files do not."""
        return {self.status: status_markdown(view), self.progress: progress_html(view),
                self.compiles: compiles_html(view)}

    def render(self, manager: RunManager, run_id: str | None) -> dict:
        """{widget: value} for this run (or for none)."""
        view, message = None, "No run selected."
        if run_id:
            try:
                view = manager.view(run_id)
            except KeyError:
                message = f"Run `{run_id}` not found in {manager.runs_dir}."
        controls = self.controls.states(view) if self.controls else {}
        if view is None:
            return {self.status: message, self.progress: "", self.compiles: "", self.error: gr.update(visible=False),
                    self.loss: plot_update(None), self.lr: plot_update(None), self.log: "", self.applied: "",
                    **{plot: gr.update(visible=False) for plot in self.trainer_plots}, **self.hardware.empty(),
                    **controls}
        error = _error_text(view)
        return {self.status: status_markdown(view), self.progress: progress_html(view),
                self.compiles: compiles_html(view), self.error: gr.update(value=error, visible=bool(error)),
                self.loss: plot_update(loss_frame(view)),
                self.lr: plot_update(_frame("learning_rate", view)), self.log: view.log_tail(),
                self.applied: applied_html(view), **self._trainer_plots(view), **self.hardware.render(view),
                **controls}

    def _trainer_plots(self, view: RunView) -> dict:
        """The trainer's plots that have data, titled; the others hidden."""
        try:
            plots = trainers.get(view.trainer).plots
        except KeyError:  # a damaged spec: no trainer known
            plots = ()
        shown = {}
        for index, widget in enumerate(self.trainer_plots):
            title, names = plots[index] if index < len(plots) else (None, None)
            shown[widget] = plot_update(trainer_frame(view, names) if names else None, title=title)
        return shown


def _shown_as(manager: RunManager, run_id: str | None) -> tuple[tuple, RunView | None]:
    """What the panel shows for this run, as a value that changes when the view does: its files
    (events, log) and, while the run goes, the clock's second too (its elapsed time moves); and
    the view. So a page may look several times a second, to show a new event at once, and is
    sent a going run's times about once a second when nothing else changed."""
    if not run_id:
        return ("none",), None
    try:
        view = manager.view(run_id)
    except KeyError:
        return ("missing", run_id), None
    version = view.version()  # its state first
    return (run_id, *version, int(time.time()) if version[0] in ACTIVE_STATES else None), view


@dataclass(frozen=True)
class Shown:
    """What a page's run panel shows: `view` (a value of _shown_as), when its plots were last sent
    (time.monotonic()), and whether newer plots wait to be sent."""
    view: tuple | None
    plots_at: float = 0.0
    plots_behind: bool = False


def going(shown: Shown | None) -> bool:
    """Whether a page's panel shows a going run."""
    return shown is not None and _is_going(shown.view)


def _is_going(view: tuple | None) -> bool:
    """Whether a value of _shown_as is a going run's (run id, state, ...)."""
    return view is not None and len(view) > 2 and view[1] in ACTIVE_STATES


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
        parts.append(f"training {format_seconds(duration)}")
    last_loss = view.last_loss()
    if last_loss is not None:
        parts.append(f"loss {format_loss(last_loss)}")
    hints = [history.tracking_hint(view),  # TensorBoard, Trackio: where to look (TRL's report_to)
             history.loss_note(view)]  # a high loss beside right answers, explained
    return " · ".join(parts) + "".join(f"  \n{hint}" for hint in hints if hint)


def progress_html(view: RunView) -> str:
    total = view.max_steps or 0
    fraction = min(1.0, view.step / total) if total else 0.0
    eta = view.eta_seconds()
    label = f"step {view.step} / {total or '?'}"
    if eta is not None:
        label += f" · ETA {format_seconds(eta)} (compilation left out)"
    elif view.live_state == "starting":
        label = "starting: loading the model and data, building the trainer ..."
    elif view.live_state == "queued":  # no step yet, nor a known count of them: it waits for its cores
        label = "queued: it starts when its cores are free"
    download = view.download
    if download and view.live_state == "starting" and download["done_bytes"] < download["total_bytes"]:
        what = download.get("model") or f"dataset {download.get('dataset')}"
        fraction = download["done_bytes"] / download["total_bytes"]  # the bar shows the download meanwhile
        label = (f"downloading {what} (first use): {download['done_bytes'] / MB:,.1f} of "
                 f"{download['total_bytes'] / MB:,.1f} MB")
    pre = view.precompile
    if pre and view.live_state == "starting" and pre["seconds"] is None:  # the bar shows the precompile meanwhile
        fraction = len(pre["done"]) / pre["total"] if pre["total"] else 0.0
        label = precompile.describe(pre)
    return (f"<div class='run-progress' data-step='{view.step}' data-total='{total}'>"
            f"<div style='background:#eee8d5;border-radius:4px;height:14px'>"
            f"<div style='background:#268bd2;width:{fraction * 100:.1f}%;height:14px;border-radius:4px'></div>"
            f"</div><div style='font-size:0.9em;margin-top:4px'>{html.escape(label)}</div></div>"
            + precompile_html(view) + line_html("studio-cost", studio_cost_text(view.studio_cost))
            + line_html("run-memory", memory_text(view)) + checkpoints_html(view))


def line_html(css_class: str, text: str | None) -> str:
    """A summary line under the bar (the studio's own time per step, memory per core), once known."""
    return f"<div class='{css_class}' style='font-size:0.85em'>{html.escape(text[0].upper() + text[1:])}</div>" \
        if text else ""


def precompile_html(view: RunView) -> str:
    """The run's precompile once it has ended: shapes, time, what the cache already had."""
    if not view.precompile or view.precompile["seconds"] is None:
        return ""
    return f"<div class='precompile' style='font-size:0.85em'>{html.escape(precompile.describe(view.precompile))}</div>"


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
    for number, ((graph, phase), event) in enumerate(view.compiling.items(), len(view.compiles) + 1):
        if view.ended is None:
            parts.append(f"<div class='compile-now'>{html.escape(compiling_text(graph, phase, number))} for "
                         f"{format_seconds(time.time() - event['time'])}</div>")
    totals = compile_totals_text(view)
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


def applied_html(view: RunView) -> str:
    """The settings the planner applied, each with its value and why, in a table whose columns
    keep their widths (long values and reasons wrap), then the plan's warnings."""
    launch = view.launch()
    if not launch:
        return ""
    cell = "style='padding:2px 6px;vertical-align:top;overflow-wrap:anywhere'"
    rows = "".join(f"<tr><td {cell}><code>{html.escape(str(key))}</code></td><td {cell}><code>"
                   f"{html.escape(repr(value))}</code></td><td {cell}>{html.escape(str(reason))}</td></tr>"
                   for key, value, reason in launch.get("applied", []))
    table = ("<table class='applied' style='table-layout:fixed;width:100%;font-size:0.9em'><colgroup>"
             "<col style='width:25%'><col style='width:20%'><col style='width:55%'></colgroup>"
             "<tr><th>setting</th><th>value</th><th>why</th></tr>" + rows + "</table>") if rows else "<p>None.</p>"
    warnings = "".join(f"<li>{html.escape(w)}</li>" for w in launch.get("warnings", []))
    return table + (f"<p><b>Warnings</b></p><ul>{warnings}</ul>" if warnings else "")


def _error_text(view: RunView) -> str:
    if view.live_state != "failed":
        return ""
    last = view.errors[-1] if view.errors else {}
    return "\n".join(filter(None, [view.error_text, last.get("traceback", "")]))


def trainer_frame(view: RunView, patterns: tuple[str, ...]) -> pd.DataFrame:
    """Rows (step, value, metric) of the logged metrics whose names match `patterns`
    (fnmatch: `rewards/*/mean` is each reward function's mean), the evaluation's (`eval_`
    and the same name) beside the training's."""
    rows = [(m["step"], float(value), name) for m in view.metrics if "step" in m
            for name, value in m.items() if isinstance(value, (int, float)) and not isinstance(value, bool)
            and any(fnmatch.fnmatchcase(name.removeprefix("eval_"), p) for p in patterns)]
    return pd.DataFrame(rows, columns=["step", "value", "metric"])


def loss_frame(view: RunView) -> pd.DataFrame | None:
    """Rows (step, loss, set) of the training loss and the evaluation set's; None for none (a plot
    coloured by a column must not be sent an empty frame: hardware_panel._plotted says why)."""
    rows = [(m["step"], float(m[key]), label) for m in view.metrics if "step" in m
            for key, label in (("loss", "training"), ("eval_loss", "evaluation"))
            if isinstance(m.get(key), (int, float)) and not isinstance(m.get(key), bool)]
    return pd.DataFrame(rows, columns=["step", "loss", "set"]) if rows else None


def plot_update(frame: pd.DataFrame | None, **more) -> dict:
    """A step plot's update: hidden without a row (an empty plot is an untitled frame)."""
    if frame is None or not len(frame):
        return gr.update(value=None, visible=False)
    return gr.update(value=frame, visible=True, **more)


def _frame(metric: str, view: RunView | None = None) -> pd.DataFrame:
    rows = [(m["step"], m[metric]) for m in (view.metrics if view else []) if metric in m and "step" in m]
    return pd.DataFrame(rows, columns=["step", metric], dtype=float)
