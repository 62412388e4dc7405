"""A page that follows a going run redraws its plots at most every run_panel.PLOTS_EVERY_S: each
redraw is Vega's whole drawing in the browser, and a tiny run that logs every step had them redrawn
twice a second. The status, progress and log still show a new event at the next look, and a run
that ended is drawn whole at once. Real run folders (events written with the project's own event
constructors), read through the run manager as the page reads them.
"""

from __future__ import annotations

import time

import pytest

from studio_core.rundir import events as ev
from studio_core.runs.manager import RunManager
from test_hardening_ui import RUN, T0, at, going, write_run

pytestmark = pytest.mark.fast
WAIT_S = 0.4  # the plots' wait in this test: shorter than the app's, the same rule


def add(run_dir, *events) -> None:
    for event in events:
        ev.append(run_dir / "events.jsonl", {**event, "time": T0 + event["time"]})


def loss_rows(update: dict, panel) -> int:
    return len(update[panel.loss]["value"])


def test_a_going_runs_plots_are_redrawn_at_most_every_few_seconds_and_an_ended_run_at_once(tmp_path, monkeypatch):
    import gradio as gr
    from app import run_panel

    monkeypatch.setattr(run_panel, "PLOTS_EVERY_S", WAIT_S)
    runs = tmp_path / "runs"
    run_dir = write_run(runs, [at(0, ev.status("starting")), at(1, ev.status("running", world_size=1, max_steps=8)),
                               at(2, ev.metrics(1, 0.1, {"loss": 2.5, "learning_rate": 1e-3}))])
    going(run_dir)
    manager = RunManager(runs)
    with gr.Blocks():
        panel = run_panel.RunPanel()
        shown = gr.State(None)

    def look(last):
        update = panel.changes(manager, RUN, last, shown)
        return update, update.get(shown, last)

    first, state = look(None)
    assert panel.plots <= set(first) and loss_rows(first, panel) == 1 and run_panel.going(state)
    # a new loss at once after: the status says it at the next look, the plots wait their turn
    add(run_dir, at(3, ev.metrics(2, 0.2, {"loss": 1.75, "learning_rate": 1e-3})))
    update, state = look(state)
    assert "loss 1.75" in update[panel.status] and not panel.plots & set(update), update.keys()
    assert state.plots_behind
    update, state = look(state)  # nothing new and the plots not due: at most the clock
    assert not panel.plots & set(update) and set(update) <= {*panel.clock(manager.view(RUN)), shown}
    time.sleep(WAIT_S)
    update, state = look(state)  # due: the plots with the new loss
    assert panel.plots <= set(update) and loss_rows(update, panel) == 2 and not state.plots_behind
    # the run ends right after a redraw: drawn whole at once, its last loss in the plot
    (run_dir / "supervisor.json").unlink()
    add(run_dir, at(4, ev.metrics(3, 0.3, {"loss": 1.25, "learning_rate": 1e-3})),
        at(5, ev.status("finished", exit_code=0)))
    update, state = look(state)
    assert panel.plots <= set(update) and loss_rows(update, panel) == 3 and not run_panel.going(state)
    assert look(state)[0] == {}  # and nothing more
