"""The Evaluate tab: did the fine-tune help? A finished run's tuned model and its base answer
the same prompts (the run's own data, or an evaluation set), and the page shows each model's
mean scores, the answers side by side, the rows where the tuned model got worse, and offers
the rows as JSONL.

The evaluation is the engine's (studio_core.evaluate.evaluation: a child process on a leased core);
this module turns the widgets into an EvalRequest, shows its events as they come, and reads
saved evaluations only through studio_core.evaluate.evaluation. Metrics are shown as the results name
them, so a metric the engine adds appears here without a change.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import gradio as gr
import pandas as pd

from studio_core.serve.images import is_image, text_of
from studio_core.evaluate import evaluation

from studio_core.machine.cores import format_cores
from studio_core.evaluate.evaluation import EvalError, EvalProcess, EvalRequest
from studio_core.machine.hardware import Hardware
from studio_core.runs.history import runs_with_a_model
from studio_core.runs.manager import RunManager, file_safe
from studio_core.runs.view import format_time

# The rows table: the texts first, in columns wide enough to read (px), then a score column per
# metric and model, as wide as its metric's name: a table wider than the page scrolls sideways,
# the prompt pinned, rather than squeezing every header into broken words.
TEXT_COLUMNS = ["prompt", "reference", "base answer", "tuned answer"]
TEXT_WIDTHS = [210, 180, 200, 200]
CHAR_PX = 8  # a header character in the table's font
# An empty answer said so, as chat says it (studio_core.serve.chat.EMPTY_ANSWER), short enough for a cell:
# an empty cell would look like missing data. The untrained built-in base writes only whitespace.
EMPTY = "(empty answer)"


def side_order(sides) -> list[str]:
    """The models as the page shows them: the base (before) first, then the tuned (after)."""
    return sorted(sides, key=lambda side: side != "base")


def lower_is_better(metric: str) -> bool:
    """A loss (or perplexity) is better low; every other score is better high."""
    return "loss" in metric or "perplexity" in metric


def describe(metric: str) -> str:
    """What a metric of the results measures: METRICS says, and for what the engine adds beside
    them, the perplexity next to eval_loss and each reward function's own mean (`reward/NAME`)."""
    if metric in evaluation.METRICS:
        return evaluation.METRICS[metric][0]
    if metric == "perplexity":
        return "exp of eval_loss: the reference answer's perplexity under the model"
    if metric.startswith("reward/"):
        return f"the reward function {metric.removeprefix('reward/')} on the answer (its mean)"
    return ""


def summary_frame(summary: dict) -> pd.DataFrame:
    """Metric x model: each model's mean score, the change from base to tuned, what it measures."""
    results = summary.get("results", {})
    sides = side_order(results)
    metrics = list(dict.fromkeys(m for side in results.values() for m in side))
    change = {"base", "tuned"} <= set(sides)
    columns = ["metric", *sides, *(["change"] if change else []), "what it measures"]
    rows = []
    for metric in metrics:
        values = [results[side].get(metric) for side in sides]
        delta = ([round(results["tuned"][metric] - results["base"][metric], 4)
                  if metric in results["tuned"] and metric in results["base"] else None] if change else [])
        rows.append([metric, *values, *delta, describe(metric)])
    return pd.DataFrame(rows, columns=columns)


def about(summary: dict) -> str:
    """What was evaluated and how: the data, rows, settings, input shapes, and the note."""
    rows = f"{summary['rows']} of {summary['of_rows']} rows (stopped)" if summary.get("stopped") \
        else f"{summary['rows']} rows"
    shapes = summary.get("shapes") or []
    lines = [f"**{rows}** of `{summary.get('data')}` (split {summary.get('split')}), at most "
             f"{summary.get('max_new_tokens')} new tokens, {'greedy' if summary.get('greedy') else 'sampled'}, "
             f"{summary.get('seconds', 0):.1f} s.",
             f"**{len(shapes)} distinct input shapes** (on Neuron, each one is a compilation): "
             + ", ".join("x".join(map(str, s)) for s in shapes)
             + f"; prompt buckets: {', '.join(map(str, summary.get('buckets') or [])) or '-'}."]
    if summary.get("skipped"):
        lines.append(f"**Skipped:** {summary['skipped']['message']}.")
    if summary.get("exact_match_compares"):
        lines.append(f"exact_match compares: {summary['exact_match_compares']}.")
    if summary.get("note"):
        lines.append(f"**Note:** {summary['note']}.")
    return "  \n".join(lines)


def answered_text(rows: int, sides: list[str], done: int) -> str:
    """How far an evaluation of `rows` rows is after `done` answers, in rows per model: each model
    (`sides`, in the order they answer) answers every row, one after the other; a count of answers
    ("12 of 12" for a limit of 6) read as a count of rows."""
    counts = [min(max(done - n * rows, 0), rows) for n in range(len(sides))]
    return "Rows answered: " + ", ".join(f"{side} model {count} of {rows}" for side, count in zip(sides, counts))


def prompt_text(prompt) -> str:
    """A prompt as the table shows it: its last user message, each of its images as "[image]"."""
    if isinstance(prompt, str):
        return prompt
    content = next((m.get("content") for m in reversed(prompt or []) if m.get("role") == "user"), "")
    images = sum(map(is_image, content)) if isinstance(content, list) else 0
    return "[image] " * images + text_of(content)


def row_metrics(rows: list[dict], sides) -> list[str]:
    """The metrics the rows were scored on, in the order they were scored."""
    return list(dict.fromkeys(m for row in rows for side in sides for m in row.get(side, {}).get("scores", {})))


def got_worse(row: dict, metric: str) -> bool:
    """Whether the tuned model scored worse than its base on this row."""
    tuned, base = (row.get(side, {}).get("scores", {}).get(metric) for side in ("tuned", "base"))
    if tuned is None or base is None:
        return False
    return tuned > base if lower_is_better(metric) else tuned < base


def rows_frame(rows: list[dict], sides, worse_on: str | None = None) -> pd.DataFrame:
    """A row per prompt: its text, the reference, each model's answer and scores; with
    `worse_on`, only the rows where the tuned model did worse on that metric."""
    sides = side_order(sides)
    metrics = row_metrics(rows, sides)
    columns = [*TEXT_COLUMNS, *[f"{metric} ({side})" for metric in metrics for side in sides]]
    table = []
    for row in rows:
        if worse_on and not got_worse(row, worse_on):
            continue
        answers = [(row[side].get("answer") or EMPTY) if side in row else "" for side in ("base", "tuned")]
        scores = [row.get(side, {}).get("scores", {}).get(metric) for metric in metrics for side in sides]
        table.append([prompt_text(row.get("prompt")), row.get("reference") or "", *answers,
                      *[None if s is None else round(s, 4) for s in scores]])
    return pd.DataFrame(table, columns=columns)


def column_widths(frame: pd.DataFrame) -> list[int]:
    """The rows table's column widths in px: the texts', then each score's, its metric's name
    ("exact_match" of "exact_match (tuned)") on one line."""
    scores = [max(len(column.rsplit(" (", 1)[0]), 8) * CHAR_PX + 36 for column in frame.columns[len(TEXT_COLUMNS):]]
    return [*TEXT_WIDTHS, *scores]


def summary_widths(frame: pd.DataFrame) -> list[str]:
    """The numbers 10% each, the metric's name 18% (preference_accuracy on one line) and what it
    measures the rest."""
    numbers = len(frame.columns) - 2
    return ["18%", *["10%"] * numbers, f"{82 - 10 * numbers}%"]


def evaluation_choices(summaries: list[dict]) -> list[tuple[str, str]]:
    """The run's evaluations for the picker: (when, on what, how many rows) -> its folder's name."""
    return [(f"{format_time(s.get('time')) or Path(s['dir']).name} · {s.get('data')} · {s.get('rows')} "
             f"row{'' if s.get('rows') == 1 else 's'}",
             Path(s["dir"]).name) for s in summaries]


def targets(manager: RunManager) -> list:
    """What the Evaluate tab offers: finished runs with a model, newest first, then the models
    that are not runs but were evaluated in this runs folder (by `launch.py eval`)."""
    return [*runs_with_a_model(manager, chats=True),
            *[(f"{model} (a model, not a run)", model) for model in evaluation.evaluated_models(manager.runs_dir)]]


def download_folder(runs_dir: Path) -> Path:
    """Where the page's row downloads go. Gradio hands out only files in its temp folder, the working
    directory or allowed_paths (the runs folder's exports/), and a run's eval/ folder is in none of
    them: a download is a copy of rows.jsonl there, named after its evaluation (showing it again
    writes the same file). The folder is emptied when the app starts, so the copies of an app that
    was killed go with the next start."""
    path = Path(runs_dir) / "exports" / "eval-downloads"
    if path.exists():
        shutil.rmtree(path)
    return path  # made by the first download


def download_copy(folder: Path, run_id: str, summary: dict, rows: list[dict]) -> str:
    """The rows as a JSONL file in `folder`, which the page may hand out."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{file_safe(run_id)}-eval-{Path(summary['dir']).name}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


class Running:
    """The evaluation each page is running (by Gradio session), for its Stop button."""

    def __init__(self):
        self.by_session: dict[str, EvalProcess] = {}
        self.lock = threading.Lock()

    def put(self, session: str, process: EvalProcess | None) -> None:
        with self.lock:
            if process is None:
                self.by_session.pop(session, None)
            else:
                self.by_session[session] = process

    def get(self, session: str) -> EvalProcess | None:
        with self.lock:
            return self.by_session.get(session)


def build(manager: RunManager, hardware: Hardware, page: gr.Blocks) -> None:
    running = Running()
    downloads = download_folder(manager.runs_dir)
    with gr.Row():
        run = gr.Dropdown([], value=None, label="Finished run (or a model evaluated before)", scale=3,
                          elem_id="eval-run", info="a run's tuned model and the base it started from answer the "
                          "same prompts; a model evaluated from `launch.py eval` is listed with its evaluations")
        earlier = gr.Dropdown([], value=None, label="Its evaluations (newest first)", scale=2,
                              elem_id="eval-earlier", info="shown without running anything")
    with gr.Row():
        data = gr.Textbox(label="Evaluation set", scale=3, elem_id="eval-data",
                          placeholder="empty: the run's held-out (else its own) data",
                          info="a file (JSONL, JSON, CSV, Parquet), builtin:NAME or a Hub dataset id")
        split = gr.Textbox(label="Split", scale=1, elem_id="eval-split", placeholder="empty: the default",
                           info="a Hub dataset's; a file has only train")
        # no minimum or maximum here: the engine's check says what to change, in the message area
        limit = gr.Number(None, label="Limit (rows)", precision=0, scale=1, elem_id="eval-limit",
                          info="the first N rows; empty or 0: all")
        max_new = gr.Number(evaluation.MAX_NEW_TOKENS, label="Max new tokens", precision=0, scale=1,
                            elem_id="eval-max-new-tokens", info="per answer, 1 to 512")
        cache_len = gr.Number(evaluation.MAX_CACHE_LEN, label="Cache length", precision=0, scale=1,
                              elem_id="eval-max-cache-len", info="tokens: prompt + answer; a longer prompt is skipped")
    gr.Markdown("**Metrics** (none checked: every one that applies to the data and the run)",
                elem_classes="field-help")
    with gr.Row():
        metric_boxes = [gr.Checkbox(False, label=name, info=description, elem_id=f"eval-metric-{name}")
                        for name, (description, _) in evaluation.METRICS.items()]
    with gr.Row():
        start = gr.Button("Evaluate", variant="primary", interactive=False, elem_id="eval-start")
        stop = gr.Button("Stop", variant="stop", interactive=False, elem_id="eval-stop")
    message = gr.Markdown("", elem_id="eval-message")
    progress = gr.Markdown("", elem_id="eval-progress")
    summary_table = gr.Dataframe(interactive=False, wrap=True, label="Mean scores", visible=False,
                                 elem_id="eval-summary")
    info = gr.Markdown("", elem_id="eval-info")
    with gr.Row():
        worse = gr.Checkbox(False, label="Where the tuned model got worse", scale=2, elem_id="eval-worse",
                            info="only the rows where it scored worse than its base (a loss: higher)")
        worse_metric = gr.Dropdown([], value=None, label="on", scale=1, elem_id="eval-worse-metric")
    with gr.Row():
        count = gr.Markdown("", elem_id="eval-count")
        download = gr.DownloadButton("Download rows (JSONL)", visible=False, size="md", scale=0, min_width=220,
                                     elem_id="eval-download")
    table = gr.Dataframe(interactive=False, wrap=True, visible=False, label="Answers side by side (click a "
                         "header to sort)", max_height=600, pinned_columns=1, elem_id="eval-rows")
    shown = gr.State(None)  # the rows of the evaluation on show, and its models: {"rows", "sides"}

    def rows_view(kept: dict | None, only_worse: bool, metric: str | None) -> dict:
        if not kept:
            return {table: gr.update(visible=False), count: ""}
        frame = rows_frame(kept["rows"], kept["sides"], metric if only_worse and metric else None)
        said = (f"{len(frame)} of {len(kept['rows'])} rows: where the tuned model did worse than its base on "
                f"{metric}." if only_worse and metric else f"{len(frame)} rows.")
        return {table: gr.update(value=frame, visible=True, column_widths=column_widths(frame)), count: said}

    def cleared() -> dict:
        return {summary_table: gr.update(visible=False), info: "", shown: None, table: gr.update(visible=False),
                count: "", download: gr.update(visible=False, value=None),
                worse_metric: gr.update(choices=[], value=None)}

    def showing(run_id: str, summary: dict, only_worse: bool, metric: str | None) -> dict:
        """A saved evaluation on the page: its summary, its rows, the filter and the download."""
        try:
            rows = evaluation.read_rows_file(Path(summary["dir"]))
        except (OSError, ValueError) as error:
            return {**cleared(), message: f"**Cannot read this evaluation's rows:** {error}"}
        sides = side_order(summary.get("results") or {})
        kept = {"rows": rows, "sides": sides}
        # the filter compares the two models: no choice when only one answered
        both = row_metrics(rows, sides) if {"tuned", "base"} <= set(sides) else []
        metric = metric if metric in both else (both[0] if both else None)
        means = summary_frame(summary)
        return {summary_table: gr.update(value=means, visible=True, column_widths=summary_widths(means)),
                info: about(summary),
                shown: kept, worse_metric: gr.update(choices=both, value=metric),
                download: gr.update(value=download_copy(downloads, run_id, summary, rows), visible=True),
                **rows_view(kept, only_worse, metric)}

    def summaries_of(run_id: str | None) -> list[dict]:
        return evaluation.evaluations_of(run_id, manager.runs_dir) if run_id else []

    def on_run(run_id, only_worse, metric, request: gr.Request):
        found = summaries_of(run_id)
        out = {start: gr.update(interactive=bool(run_id) and running.get(request.session_hash) is None),
               earlier: gr.update(choices=evaluation_choices(found), value=Path(found[0]["dir"]).name if found
                                  else None), message: "" if found or not run_id else
               "No evaluation of this run yet: choose the settings and click **Evaluate**.", progress: ""}
        return out | (showing(run_id, found[0], only_worse, metric) if found else cleared())

    def on_earlier(run_id, name, only_worse, metric):
        picked = next((s for s in summaries_of(run_id) if Path(s["dir"]).name == name), None)
        return {message: ""} | (showing(run_id, picked, only_worse, metric) if picked else cleared())

    def request_from(run_id, data_, split_, limit_, max_new_, cache_, chosen) -> EvalRequest:
        metrics = tuple(name for name, on in zip(evaluation.METRICS, chosen) if on) or None  # None: all that apply
        return EvalRequest(run_id, data=(data_ or "").strip() or None, split=(split_ or "").strip() or None,
                           metrics=metrics, limit=int(limit_) if limit_ else None,
                           max_new_tokens=int(max_new_) if max_new_ is not None else evaluation.MAX_NEW_TOKENS,
                           max_cache_len=int(cache_) if cache_ is not None else evaluation.MAX_CACHE_LEN)

    def going(on: bool) -> dict:
        """The buttons and the run picker while an evaluation runs (on) and after."""
        return {start: gr.update(interactive=not on), stop: gr.update(interactive=on),
                run: gr.update(interactive=not on)}

    # the request first: Gradio passes it by its annotation, which it does not find after *chosen
    def on_start(request: gr.Request, run_id, data_, split_, limit_, max_new_, cache_, only_worse, metric, *chosen):
        if not run_id:
            yield {message: "**Pick a finished run.**"}
            return
        try:
            process = EvalProcess.start(request_from(run_id, data_, split_, limit_, max_new_, cache_, chosen),
                                        manager.runs_dir, hardware)
        except EvalError as error:
            yield {message: f"**Not started:**\n\n{error}", progress: ""}
            return
        session = request.session_hash
        running.put(session, process)
        line = f"Loading the tuned model (and its base) on {hardware.backend} core {format_cores(process.cores)} ..."
        yield {message: "", progress: line, **going(True)}
        skipped, rows, sides = "", 0, []
        try:
            for event in process.events():
                if event["type"] == "loaded":
                    rows, sides = event["rows"], event["sides"]
                    skipped = f"; {event['skipped']} prompts too long, skipped" if event.get("skipped") else ""
                    line = answered_text(rows, sides, 0) + skipped
                    yield {progress: line}
                elif event["type"] == "progress":
                    line = answered_text(rows, sides, event["done"]) + skipped
                    yield {progress: line}
                elif event["type"] == "done":
                    summary = {**event["summary"], "dir": event["dir"]}
                    found = summaries_of(run_id)
                    ending = "stopped" if summary.get("stopped") else "done"
                    yield {progress: f"{line}: {ending} in {summary['seconds']:.1f} s.",
                           message: "Stopped: the answers so far are saved and shown." if summary.get("stopped")
                           else "",
                           earlier: gr.update(choices=evaluation_choices(found), value=Path(event["dir"]).name),
                           **showing(run_id, summary, only_worse, metric), **going(False)}
                    return
        except EvalError as error:
            yield {message: f"**Evaluation failed:** {error}", progress: "", **going(False)}
        finally:  # also when the page went away mid-way: stopped, and what is done is saved
            process.stop()
            running.put(session, None)

    def on_stop(request: gr.Request):
        process = running.get(request.session_hash)
        if process is None:
            return "Nothing is being evaluated."
        process.stop()
        return "Stopping after the answer in progress; what is done is saved."

    start_inputs = [run, data, split, limit, max_new, cache_len, worse, worse_metric, *metric_boxes]
    result_outputs = [summary_table, info, shown, table, count, download, worse_metric, message]
    start.click(on_start, start_inputs, [*result_outputs, progress, earlier, start, stop, run],
                show_progress="hidden")
    stop.click(on_stop, None, message)
    run.change(on_run, [run, worse, worse_metric], [*result_outputs, progress, earlier, start])
    earlier.input(on_earlier, [run, earlier, worse, worse_metric], result_outputs)
    for widget in (worse, worse_metric):
        widget.change(rows_view, [shown, worse, worse_metric], [table, count], show_progress="hidden")
    run.focus(lambda: gr.update(choices=targets(manager)), None, run)
    page.load(lambda: gr.update(choices=targets(manager)), None, run)  # after a login
