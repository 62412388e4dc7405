"""The shape forecast in the Train tab: the graphs a run will compile and its padding waste,
before launch, with suggested settings applied in one click (into "Other TRL settings").

The forecast itself is the engine's (studio_core.training.forecast, in a child process); this only
turns the form into a planned spec and the result into Markdown, a histogram and choices. The
plan's padding (pad_to_multiple_of as TRL resolves it on the target, and the sequence lengths it
allows) heads the report, also when the forecast cannot run (the data not on this machine).
"""

from __future__ import annotations

import gradio as gr
import pandas as pd
import yaml

from app.train_form import TrainForm, spec_from_form, target_hardware
from studio_core.data import sources
from studio_core.training.forecast import Forecast, forecast_in_subprocess
from studio_core.machine.hardware import Hardware
from studio_core.runs.manager import RunManager
from studio_core.recipe.spec import SpecError


STALE = ("**The form changed since this forecast:** press Forecast compilations for the run it holds now "
         "(the one shown was for other settings).")


def forecast_markdown(f: Forecast, backend: str) -> str:
    # the run page counts each piece Dynamo compiles (a forward, a backward, per graph break): more
    # than the shapes, which this must not seem to promise as the count
    cost = ("each one compiles the training step again, its forward and backward (the run page counts those "
            "pieces one by one)" + (", minutes per piece on Trainium" if backend == "neuron" else ""))
    lines = [f"**{f.graphs} distinct batch shape(s)** reach the model in {f.steps} steps ({cost}); "
             f"**padding waste {f.waste:.1%}** of the tokens computed."]
    if f.capped:
        lines.append(f"Forecast from the first {f.micro_batches} batches only.")
    shapes = ", ".join(f"{b}x{length} ({n})" for b, length, n in f.shapes[:10])
    lines.append(f"Shapes (batches): {shapes}{' ...' if len(f.shapes) > 10 else ''}")
    if f.data_parallel > 1:
        lines.append(f"{f.data_parallel} data-parallel processes; the busiest compiles {f.busiest_rank_shapes}.")
    if f.max_length and f.truncated:
        lines.append(f"**{f.truncated} of {len(f.lengths)} samples are cut** at max_length {f.max_length}.")
    if not f.suggestions:
        lines.append("No setting would cut the shapes or the waste much.")
    return "\n\n".join(lines)


def plan_and_forecast(v: dict, manager: RunManager, hardware: Hardware) -> tuple[str, Forecast | None]:
    """The report's Markdown and the forecast (None when it cannot run) of the form's values (by
    name), planned for the form's target as Preview plans it. SpecError when the form cannot be
    planned at all; else the plan's padding comes first, forecast or not."""
    target = target_hardware(v, hardware)
    elsewhere = target is not hardware
    launch = manager.plan(spec_from_form(v), target, elsewhere=elsewhere)
    head = [f"**Padding:** {launch.padding}"] if launch.padding else []
    # as `launch.py plan --instance`: a plan for another machine downloads nothing to walk its data
    missing = sources.not_here(launch.spec.model_name_or_path, launch.spec.dataset_name) if elsewhere else []
    try:
        if launch.errors:
            raise SpecError(launch.errors)
        if missing:
            raise SpecError([f"{' and '.join(missing)} not on this machine, and a plan for another one downloads "
                             "nothing; forecast where they are (or with them in the Hugging Face cache)"])
        result = forecast_in_subprocess(launch.spec, target.backend)
    except SpecError as error:
        return "\n\n".join(head + ["**No forecast:**\n" + "\n".join(f"- {p}" for p in error.problems)]), None
    return "\n\n".join(head + [forecast_markdown(result, target.backend)]), result


def suggestion_label(s: dict) -> str:
    settings = ", ".join(f"{k}: {v}" for k, v in s["set"].items())
    return f"{settings} -> {s['graphs']} shape(s), waste {s['waste']:.1%} ({s['why']}); costs the data: {s['cost']}"


def build(form: TrainForm, manager: RunManager, hardware: Hardware) -> None:
    with gr.Accordion("Shape forecast: what this run will compile", open=True):
        button = gr.Button("Forecast compilations", elem_id="forecast")
        report = gr.Markdown("Tokenizes the dataset as the trainer will and counts the batch shapes "
                             "(each distinct shape is a compilation on Trainium).", elem_id="forecast-report")
        histogram = gr.BarPlot(x="tokens", y="samples", title="Sequence lengths (before truncation)",
                               x_label_angle=-30, height=220, visible=False, elem_id="length-histogram")
        choice = gr.Radio([], label="Suggested settings, best first (little padding, samples kept whole, fewest "
                                    "shapes), each with what it costs the data", visible=False, elem_id="suggestions")
        apply = gr.Button("Apply suggestion", visible=False, elem_id="apply-suggestion")
        offered = gr.State({})
        made_of = gr.State(None)  # the form's values (by name) the report shown was made from
    inputs, extra = form.components(), form.widgets["extra"]

    def hidden() -> dict:
        return {histogram: gr.update(visible=False), choice: gr.update(visible=False, choices=[]),
                apply: gr.update(visible=False), offered: {}}

    def on_forecast(values):
        v = form.named(values)
        try:
            text, result = plan_and_forecast(v, manager, hardware)
        except SpecError as error:
            return {report: "**No forecast:**\n" + "\n".join(f"- {p}" for p in error.problems), **hidden(),
                    made_of: v}
        if result is None:
            return {report: text, **hidden(), made_of: v}
        bars = pd.DataFrame(result.histogram(), columns=["tokens", "samples"])
        labels = {suggestion_label(s): s["set"] for s in result.suggestions}
        return {report: text,
                histogram: gr.update(value=bars, visible=True, sort=list(bars["tokens"])),  # buckets in length order
                choice: gr.update(choices=list(labels), value=next(iter(labels), None), visible=bool(labels)),
                apply: gr.update(visible=bool(labels)), offered: labels, made_of: v}

    def on_form_change(values):
        """A report of values the form no longer holds (another trainer, another Run on...) says so,
        and its suggestions go: they were for those values."""
        made = values[made_of]
        if made is None or form.named(values) == made:
            return {report: gr.update(), made_of: gr.update()}
        return {report: STALE, **hidden(), made_of: None}

    def on_apply(label, labels, text):
        if label not in labels:
            return gr.update()
        current = yaml.safe_load(text or "") or {}
        if not isinstance(current, dict):
            return gr.update()
        return yaml.safe_dump({**current, **labels[label]}, sort_keys=False)

    outputs = [report, histogram, choice, apply, offered, made_of]
    # one queue: a change made before a forecast is never marked after it
    button.click(on_forecast, inputs, outputs, concurrency_id="forecast")
    apply.click(on_apply, [choice, offered, extra], extra).then(on_forecast, inputs, outputs,
                                                                concurrency_id="forecast")
    gr.on([widget.change for widget in form.widgets.values()], on_form_change, inputs | {made_of}, outputs,
          show_progress="hidden", concurrency_id="forecast", trigger_mode="always_last")
