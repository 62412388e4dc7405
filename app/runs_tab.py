"""The Runs tab: every run in the runs folder (filtered, sorted, with the disk space each
takes), runs compared, and one opened with its plots, log and evaluations, to clone into the
Train tab or delete.
"""

from __future__ import annotations

import time

import gradio as gr
import pandas as pd

from app import compare, run_panel, sweep_panel
from app.train_form import TrainForm, form_values
from studio_core.evaluate import evaluation
from studio_core.runs import history
from studio_core.recipe import trainers
from studio_core.machine.hardware import Hardware
from studio_core.runs.manager import RunManager
from studio_core.runs.view import STATES, RunView, format_loss, format_seconds, format_time
from studio_core.machine.sizes import format_size

# State and steps share a column, so that training and wall time fit beside the rest: with these
# widths and wrapped cells (gr.Dataframe(wrap=True, column_widths=COLUMN_WIDTHS)) the table fits
# a 1200 px wide window without scrolling sideways; in a narrower one it scrolls (main.CSS).
COLUMNS = ["run", "state · steps", "trainer", "model", "dataset", "started", "training", "wall", "final loss", "size"]
COLUMN_WIDTHS = ["19%", "11%", "7%", "12%", "12%", "10%", "8%", "7.5%", "6%", "7.5%"]
ALL = "all"
LIST_EVERY_S = 2.0  # how often an open page's runs table is listed again


def runs_table(views: list[RunView], state: str = ALL, trainer: str = ALL, model: str = ALL,
               sort: str = "newest first") -> pd.DataFrame:
    """One row per run: started is its first start, training its time going (the idle time
    between a stop and a resume left out), wall from its first start to its end; model and
    dataset by their short names (a local path's last part)."""
    def seconds(value: float | None) -> str:
        return "" if value is None else format_seconds(value)

    rows = []
    for view in history.sort_runs(history.filter_runs(views, state, trainer, model), sort):
        rows.append([view.id, f"{view.live_state} {view.step}/{view.max_steps or '?'}", view.trainer,
                     view.short_model, view.short_dataset, format_time(view.first_start),
                     seconds(view.training_seconds()), seconds(view.wall_seconds()),
                     format_loss(view.last_loss()), format_size(view.size())])
    return pd.DataFrame(rows, columns=COLUMNS)


def run_info(manager: RunManager, run_id: str | None) -> str:
    """The opened run's disk space, where its experiment tracking opens, and what is damaged."""
    if not run_id:
        return ""
    try:
        view = manager.view(run_id)
    except KeyError:
        return ""
    lines = [f"**Disk:** {format_size(view.size())} in `{view.dir}`"]
    hint = history.tracking_hint(view)
    lines.append(f"**Experiment tracking:** {hint}" if hint else "**Experiment tracking:** none (report_to)")
    lines += [f"**Damaged:** {problem}" for problem in view.damage()]
    return "  \n".join(lines)


def scores_text(results: dict, metrics) -> str:
    """One model's mean scores, the metrics the evaluation was asked for (or all it has)."""
    names = [m for m in metrics if m in results] or list(results)
    return ", ".join(f"{name} {results[name]:.4g}" for name in names)


def evaluations_text(manager: RunManager, run_id: str | None) -> str:
    """The opened run's evaluations, newest first: when, on what, how many rows, each model's scores."""
    if not run_id:
        return ""
    try:
        found = evaluation.evaluations(manager.view(run_id).dir)
    except KeyError:  # deleted meanwhile
        return ""
    if not found:
        return "**Evaluations:** none yet (the Evaluate tab runs one)."
    note = history.loss_note(manager.view(run_id))  # good scores beside a high training loss, explained
    # the base (before) first, then the tuned (after), as the Evaluate tab shows them
    sides = sorted({side for s in found for side in s.get("results", {})}, key=lambda side: (side != "base", side))
    lines = ["**Evaluations** (newest first; the Evaluate tab shows each in full)", "",
             "| evaluated | on | " + " | ".join(sides) + " |", "|---" * (2 + len(sides)) + "|"]
    for s in found:
        rows = f"{s.get('rows')} of {s.get('of_rows')} rows (stopped)" if s.get("stopped") else f"{s.get('rows')} rows"
        cells = [scores_text(s.get("results", {}).get(side, {}), s.get("metrics") or []) for side in sides]
        lines.append(f"| {format_time(s.get('time'))} | `{s.get('data')}` ({s.get('split')}), {rows} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + (f"\n\n{note}" if note else "")


def build(manager: RunManager, page: gr.Blocks, hardware: Hardware, form: TrainForm | None = None,
          tabs: gr.Tabs | None = None, train_tab_id: str = "train",
          train_follow: tuple[gr.State, gr.Timer] | None = None) -> tuple[gr.Dataframe, gr.Dropdown, gr.Timer,
                                                                          sweep_panel.BestRun]:
    """`form` and `tabs`: the Train tab's form and the app's tabs, for "Clone into Train tab";
    `train_follow`: the run the Train tab follows and its timer, which a run resumed here joins.
    The runs are sent when `page` loads, never as the widgets' first values: those are in the
    page Gradio serves before a login."""
    with gr.Row():
        refresh = gr.Button("Refresh", scale=0)
        state = gr.Dropdown([ALL, *STATES], value=ALL, label="State", elem_id="filter-state")
        trainer = gr.Dropdown([ALL, *trainers.TRAINERS], value=ALL, label="Trainer", elem_id="filter-trainer")
        model = gr.Dropdown([ALL], value=ALL, label="Model", elem_id="filter-model")
        sort = gr.Dropdown(list(history.SORTS), value="newest first", label="Sort", elem_id="sort-runs")
    table = gr.Dataframe(runs_table([]), headers=COLUMNS, interactive=False, wrap=True, column_widths=COLUMN_WIDTHS,
                         elem_id="runs-table")
    picked = compare.build(manager)
    with gr.Row():
        opened = gr.Dropdown([], label="Open run", allow_custom_value=False, elem_id="open-run", scale=3)
        clone = gr.Button("Clone into Train tab", scale=1, elem_id="clone-run", visible=form is not None)
        delete = gr.Button("Delete run", variant="stop", scale=1, elem_id="delete-run")
        confirm = gr.Button("", variant="stop", scale=2, visible=False, elem_id="confirm-delete")
        cancel = gr.Button("Cancel", scale=0, visible=False, elem_id="cancel-delete")
    best = sweep_panel.build(manager, picked, opened)
    controls = run_panel.RunControls(prefix="runs-")  # for the opened run
    message = gr.Markdown("", elem_id="runs-message")
    info = gr.Markdown("", elem_id="run-info")
    evals = gr.Markdown("", elem_id="run-evals")
    pending = gr.State(None)  # the run the confirm button deletes
    panel = run_panel.RunPanel(controls)
    with gr.Accordion("Spec (spec.yaml: the recipe with the applied defaults)", open=False):
        spec_code = gr.Code(language="yaml", lines=16)
    filters = [state, trainer, model, sort]

    def on_refresh(current, state_, trainer_, model_, sort_):
        # Values are set only when theirs is gone (a deleted run, its model's last run): the
        # timer's request can carry a value from before the user's latest pick, and setting
        # that would undo the pick.
        views = manager.list()  # also starts a queue runner where queued runs have none (one was killed)
        frame = runs_table(views, state_, trainer_, model_, sort_)
        ids = [v.id for v in views]
        models = [ALL, *sorted({v.model for v in views})]
        kept = current is None or current in ids
        return (frame, gr.update(choices=ids) if kept else gr.update(choices=ids, value=None),
                gr.update(choices=models) if model_ in models else gr.update(choices=models, value=ALL),
                gr.update(choices=ids))

    def on_open(run_id):
        try:
            spec_text = manager.view(run_id).spec_text() if run_id else ""
        except KeyError:  # deleted meanwhile
            spec_text = ""
        return {**panel.render(manager, run_id), spec_code: spec_text, info: run_info(manager, run_id),
                evals: evaluations_text(manager, run_id)}

    def on_select(frame: pd.DataFrame, event: gr.SelectData):
        return frame.iloc[event.index[0]]["run"]

    def said(text: str) -> dict:
        """The message, and the delete button back in place of its confirmation."""
        return {message: text, pending: None, delete: gr.update(visible=True), confirm: gr.update(visible=False),
                cancel: gr.update(visible=False)}

    def on_delete(run_id):
        if not run_id:
            return said("Open a run first.")
        try:
            view = manager.view(run_id)
        except KeyError as error:
            return said(str(error).strip("'\""))
        if view.active:
            return said(f"Run `{run_id}` is {view.live_state}: stop it before deleting it.")
        size = format_size(view.size())
        return {message: "", pending: run_id, delete: gr.update(visible=False),
                confirm: gr.update(value=f"Really delete {run_id}? Frees {size}", visible=True),
                cancel: gr.update(visible=True)}

    def on_confirm(run_id):
        try:
            freed = history.delete_run(manager, run_id)
        except (history.RunActiveError, KeyError) as error:
            return said(str(error).strip("'\""))
        return said(f"Deleted run `{run_id}` and its files: {format_size(freed)} freed.")

    refresh_io = ([opened, *filters], [table, opened, model, picked])
    refresh.click(on_refresh, *refresh_io)
    page.load(on_refresh, *refresh_io)
    for widget in filters:
        widget.change(on_refresh, *refresh_io)
    table.select(on_select, table, opened)
    opened.change(on_open, opened, [*panel.components, spec_code, info, evals])
    # One queue for these, in the order they were asked: a Delete clicked right after another
    # run was opened is answered after that opening's reset, not hidden by it.
    in_order = {"concurrency_id": "delete-run", "concurrency_limit": 1}
    confirm_io = [message, pending, delete, confirm, cancel]
    # another run opened: no pending deletion (a deleted run closing keeps its message)
    opened.change(lambda run_id: {**said(""), message: gr.update() if run_id is None else ""}, opened,
                  confirm_io, **in_order)
    delete.click(on_delete, opened, confirm_io, **in_order)
    cancel.click(lambda: said(""), None, confirm_io, **in_order)
    confirm.click(on_confirm, pending, confirm_io, **in_order).then(on_refresh, *refresh_io)
    if form is not None:
        _wire_clone(manager, form, tabs, train_tab_id, clone, opened, message)
    resumed = controls.wire(manager, hardware, opened, message)
    if train_follow is not None:  # the Train tab follows the resumed run too
        selected, train_timer = train_follow
        resumed.then(lambda run_id: (run_id, gr.Timer(active=True)), opened, [selected, train_timer])
    timer = gr.Timer(LIST_EVERY_S)
    # the last listing this page was sent and when it was made; the last run view it was sent;
    # the timer's interval now
    listed, shown, pace = gr.State(None), gr.State(None), gr.State(LIST_EVERY_S)
    evals_sent = gr.State(None)  # the opened run's evaluations as last sent (an evaluation may end meanwhile)

    def on_tick(current, state_, trainer_, model_, sort_, last_listing, last_shown, last_pace, last_evals):
        # One request per tick for the table and the opened run, and nothing sent when nothing
        # changed: an idle history of 200 runs is not sent to the page every 2 s. The timer ticks
        # every run_panel.LOOK_EVERY_S while the opened run goes (its new events show at once),
        # else every LIST_EVERY_S; the history is listed every LIST_EVERY_S (listing 200 runs is
        # the tick's dearest part).
        update = {}
        if last_listing is None or time.monotonic() - last_listing[2] >= LIST_EVERY_S - run_panel.LOOK_EVERY_S / 2:
            listing = on_refresh(current, state_, trainer_, model_, sort_)
            now = (listing[0].to_json(), repr(listing[1:]), time.monotonic())
            update = ({listed: now} if last_listing is not None and now[:2] == last_listing[:2]
                      else dict(zip([*refresh_io[1], listed], [*listing, now])))
            found = evaluations_text(manager, current)
            if found != last_evals:
                update |= {evals: found, evals_sent: found}
        update |= panel.changes(manager, current, last_shown, shown)
        wanted = run_panel.LOOK_EVERY_S if run_panel.going(update.get(shown, last_shown)) else LIST_EVERY_S
        if wanted != last_pace:
            update |= {timer: gr.Timer(wanted), pace: wanted}
        return update or {shown: last_shown}

    timer.tick(on_tick, [*refresh_io[0], listed, shown, pace, evals_sent],
               [*refresh_io[1], listed, *panel.components, shown, timer, pace, evals, evals_sent],
               show_progress="hidden", queue=False)  # see run_panel.LOOK_EVERY_S
    return table, opened, timer, best


def _wire_clone(manager: RunManager, form: TrainForm, tabs: gr.Tabs | None, train_tab_id: str,
                button: gr.Button, opened: gr.Dropdown, message: gr.Markdown) -> None:
    """"Clone into Train tab": the run's settings (less what the planner added for this
    machine, and its cores) fill the Train form, and the page switches to it."""
    names = list(form.widgets)
    outputs = [message, *form.widgets.values(), *form.trainer_groups.values(), form.advanced_box]
    outputs += [tabs] if tabs is not None else []

    def on_clone(run_id):
        if not run_id:
            return {message: "Open a run first."}
        try:
            values = form_values(history.clone_spec(manager, run_id))
        except KeyError as error:  # deleted since it was opened
            return {message: str(error).strip("'\"")}
        trainer, extra = values["trainer"], bool(values["extra"])
        note = (f"Loaded run `{run_id}`'s settings into the Train tab"
                + (" (some are in Advanced: Other TRL settings)" if extra else "") + ".")
        shown = {message: note, **{form.widgets[n]: gr.update(value=values[n]) for n in names if n in values},
                 **{group: gr.update(visible=key == trainer) for key, group in form.trainer_groups.items()}}
        shown |= {form.advanced_box: gr.update(open=True)} if extra else {}
        return shown | ({tabs: gr.Tabs(selected=train_tab_id)} if tabs is not None else {})

    button.click(on_clone, opened, outputs)
