"""Sweeps in the app: the Train tab's section that starts one (a grid of values over the form's
settings), and the Runs tab's sweep view: its runs ranked in a table, their curves overlaid and
their differing settings (the compare section, given the sweep's runs), the best run one click
from being opened here, chatted with in the Chat tab or exported in the Export tab.

The engine is studio_core.runs.sweep; this module only lays it out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import gradio as gr
import pandas as pd

from studio_core.evaluate.evaluation import check_run_evaluation
from studio_core.recipe.spec import RunSpec, SpecError
from studio_core.runs import sweep
from studio_core.runs.manager import RunManager, RunNotFound
from studio_core.runs.view import format_loss

# How to write the Train tab's grid box (sweep.parse_grid's forms, as `launch.py sweep --grid` takes them)
GRID_HELP = ("One key a line, a run for each combination: KEY=V1,V2,... e.g. learning_rate=1e-4,3e-4. Values that "
             "hold commas go in a YAML (or JSON) list: KEY=[V1, V2] e.g. lora_target_modules=[[q_proj, v_proj], "
             "[q_proj, k_proj, v_proj]]; a text with a comma quoted: KEY=[\"a,b\", c].")
COLUMNS = ["#", "run", "state", "step", "loss", "eval_loss", "evaluation", "values", "why it did not finish"]


def parse_lines(text: str) -> dict[str, list[str]]:
    """The grid box's lines (`KEY=V1,V2` or `KEY=[V1, V2]`, one key a line) as sweep.parse_grid reads them."""
    return sweep.parse_grid([line.strip() for line in (text or "").splitlines() if line.strip()])


def start_sweep(manager: RunManager, spec: RunSpec, grid_text: str, hardware, parallel: float | None = None,
                evaluate: bool = False) -> str:
    """Start the sweep (`parallel`: at most this many runs at once, 0 or None: as the cores allow;
    `evaluate`: each run when it ends); what happened, in words (a refusal lists every problem,
    nothing started)."""
    try:
        started = sweep.start(manager, spec, parse_lines(grid_text), hardware, parallel=int(parallel or 0) or None,
                              evaluate={"limit": sweep.EVAL_LIMIT, "metrics": []} if evaluate else None,
                              check_evaluation=check_run_evaluation)
    except SpecError as error:
        return "**Sweep not started:**\n" + "\n".join(f"- {problem}" for problem in error.problems)
    runs = started.record["runs"]
    listed = "\n".join(f"- `{entry['id']}`: {sweep.label(entry['params'])}" + (
        f" (shares the precompile of `{entry['precompiled_by']}`)" if entry.get("precompiled_by") else "")
        for entry in runs)
    where = f"as {started.record['group']['label']}" if started.record.get("group") else (
        f"through the queue, at most {started.record['parallel']} at once" if started.record.get("parallel") else
        "through the queue (as many at once as there are free cores)")
    evaluated = " Each run is evaluated when it ends." if evaluate else ""
    return (f"Sweep `{started.id}`: {len(runs)} runs, {where}:\n{listed}\n\nThe Runs tab's Sweeps section ranks "
            f"them and overlays their curves.{evaluated}")


def sweep_frame(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([[n, row["id"], row["state"], row["step"], format_loss(row["loss"]) or "-",
                          format_loss(row["eval_loss"]) or "-", sweep.scores_text(row["evaluation"]),
                          sweep.label(row["params"]), row["why"] or ""] for n, row in enumerate(rows, 1)],
                        columns=COLUMNS)


@dataclass
class BestRun:
    """The Sweeps section's buttons that hand its best run to the Chat and Export tabs (`link`)."""
    run_id: gr.State
    chat: gr.Button
    export: gr.Button


def build(manager: RunManager, compared: gr.Dropdown, opened: gr.Dropdown) -> BestRun:
    """The Runs tab's Sweeps section, in the current Blocks context: picking a sweep fills the
    compare section with its runs (`compared`); Open the best run sets `opened`; the buttons that
    take it to the Chat and Export tabs are returned, for `link` once those tabs are built."""
    with gr.Accordion("Sweeps", open=False, elem_id="sweeps-box"):
        with gr.Row():
            picked = gr.Dropdown([], label="Sweep", elem_id="sweep-pick", scale=3)
            best = gr.Button("Open the best run", interactive=False, elem_id="sweep-best", scale=1)
            chat = gr.Button("Chat with it", interactive=False, elem_id="sweep-chat", scale=1)
            export = gr.Button("Export it", interactive=False, elem_id="sweep-export", scale=1)
        ranked = gr.Markdown("", elem_id="sweep-ranked")
        table = gr.Dataframe(pd.DataFrame(columns=COLUMNS), interactive=False, wrap=True, elem_id="sweep-table")
        best_id = gr.State(None)

    def on_focus():
        return gr.update(choices=sweep.listed(manager.runs_dir))

    def on_pick(sweep_id):
        off = [gr.update(interactive=False)] * 3
        if not sweep_id:
            return pd.DataFrame(columns=COLUMNS), "", gr.update(), *off, None
        try:
            rows = sweep.table(manager, sweep_id)
        except RunNotFound as error:
            return pd.DataFrame(columns=COLUMNS), str(error), gr.update(), *off, None
        top = next((row["id"] for row in rows if row["state"] == "finished"), None)
        said = f"Best first by {sweep.ranked_by(rows)}; its runs' curves are in Compare runs above."
        present = [row["id"] for row in rows if row["state"] != "deleted"]
        return sweep_frame(rows), said, gr.update(value=present), *[gr.update(interactive=top is not None)] * 3, top

    picked.focus(on_focus, None, picked, show_progress="hidden")
    picked.change(on_pick, picked, [table, ranked, compared, best, chat, export, best_id])
    # with the runs listed now: the Runs tab lists new runs every few seconds, and a value not among
    # the choices would be dropped
    best.click(lambda run_id: gr.update(choices=[view.id for view in manager.list()], value=run_id), best_id,
               opened)
    return BestRun(best_id, chat, export)


def link(best: BestRun, tabs: gr.Tabs, to_chat: tuple[gr.Dropdown, Callable], to_export: tuple[gr.Dropdown, Callable],
         chat_tab: str = "chat", export_tab: str = "export") -> None:
    """The best run, one click from the Chat tab's and the Export tab's pick: each (dropdown, its
    choices now), the tab switched to."""
    for button, (pick, choices), tab in ((best.chat, to_chat, chat_tab), (best.export, to_export, export_tab)):
        button.click(lambda run_id, choices=choices, tab=tab: (gr.update(choices=choices(), value=run_id),
                                                                gr.Tabs(selected=tab)), best.run_id, [pick, tabs])
