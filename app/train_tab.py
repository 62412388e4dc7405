"""The Train tab: the form, the dataset check, preview, start, the live run, stop.

Widget values become a RunSpec in app.train_form.spec_from_form; everything after that
(validation, the dataset fit check, planning, the run folder, the processes) is the
engine's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gradio as gr
import pandas as pd
import yaml

from app import forecast_panel, run_panel, sweep_panel
from studio_core.runs.sweep import EVAL_LIMIT as sweep_eval_limit
from app.core_map import core_map_html, memory_html
from app.train_form import (TARGET_LABELS, THIS_MACHINE, TINY_LEARNING_RATE, TrainForm, check_extra, export_spec,
                            learning_rate_info, learning_rate_start, parse_number, run_backend, spec_from_form,
                            target_hardware, trainer_info)
from studio_core.recipe import data_check, data_preview, dataset_check, trainers
from studio_core.data import sources
from studio_core.machine.cores import parse_cores
from studio_core.machine.hardware import Hardware
from studio_core.machine.layout import check_layout, pick_cores
from studio_core.runs.manager import RunManager, file_safe
from studio_core.backends import EXPORT
from studio_core.training.scripts import launch_script, submit_script
from studio_core.recipe.spec import SpecError


LAYOUT_PROBLEMS = "**This layout cannot run here; change it:**"
CORE_MAP_EVERY_S = 2.0  # the core map's redraw while the Layout box is open
START, STARTING = "Start", "Starting: checking ..."  # the Start button, and its words while a start is checked
SWEEP, SWEEPING = "Start sweep", "Starting sweep: checking ..."  # the same for Start sweep
THUMBNAILS = 6  # the most images of a vision dataset's first rows that Check dataset shows


def problems_markdown(error: SpecError) -> str:
    lines = "\n".join(f"- {p}" for p in error.problems)
    return f"**Nothing was launched. Change these and try again:**\n{lines}"


def dataset_report(spec) -> tuple[str, pd.DataFrame | None, dict]:
    """What the pre-launch check (dataset_check.check_file, the one Start runs) sees in a local
    dataset: rows, type, fit, bad records further on, and the suggested fix as data
    (data_check.suggest_fix) for the page to apply."""
    return check_report(spec)[:3]


def check_report(spec) -> tuple[str, pd.DataFrame | None, dict, list]:
    """dataset_report's text, preview and fix, and for vision data its first rows' images as
    captioned thumbnails (data_preview.thumbnails; [] for text data)."""
    path = sources.dataset_file(spec.dataset_name)
    if path is None:
        return ("A Hub dataset or a dataset folder is not read before launch: the run downloads its split, "
                "then checks its first rows the same way before it loads the model, and fails at once, "
                "saying what to change, if they do not fit."), None, {}, []
    try:
        check = dataset_check.check_file(spec, path)
        thumbnails = data_preview.thumbnails(spec, Path(path), check.kind.images, THUMBNAILS) \
            if check.kind and check.kind.vision else []
    except (OSError, ValueError) as error:
        return f"**Cannot read the dataset:** {error}", None, {}, []
    text_field = spec.args.get("dataset_text_field", "text")
    fix = data_check.suggest_fix(check.read, spec.trainer, spec.column_map, spec.keep_columns, text_field)
    if check.rows is None:  # the column map or keep-columns do not fit this dataset
        lines = [f"**Column map or kept columns do not fit this dataset:** {'; '.join(check.problems)}"]
        return _paragraphs(lines + [describe_fix(fix)] * bool(fix)), None, fix, []
    kind = check.kind
    named = ", ".join(part for part in (kind.type, kind.format) if part and part != "unknown")
    lines = [f"**Detected:** {kind.description}" + (f" ({named})" if named else "")
             + f"; columns: {', '.join(kind.columns) or 'none'}"]
    if check.scan is None:  # the first rows do not fit the trainer
        lines += ["**Does not fit this trainer:**", *[f"- {p}" for p in check.problems]]
        lines += [describe_fix(fix)] * bool(fix)
    else:
        if check.problems:
            lines += ["**Records to fix before training:**", *[f"- {p}" for p in check.problems]]
        else:
            lines.append(f"**Fits {spec.trainer_entry.name}.**")
        if check.warnings:
            lines += ["**Warnings (these records train, but likely not as meant):**",
                      *[f"- {w}" for w in check.warnings]]
    images = kind.images  # shown as its files' names, not a list's (or an image's bytes') repr
    preview = pd.DataFrame([{k: (", ".join(map(data_preview.image_name, data_preview.image_refs(v))) if k == images
                                 else str(v))[:200]
                             for k, v in row.items()} for row in check.rows])
    return _paragraphs(lines), preview, fix, thumbnails


def _paragraphs(lines: list[str]) -> str:
    """Markdown of report lines: a sentence or heading is a paragraph of its own (one newline
    would run it into the line before), a list's items stay together."""
    text = ""
    for line in lines:
        text += ("\n" if line.startswith("- ") and text else "\n\n" if text else "") + line
    return text


def describe_fix(fix: dict) -> str:
    """data_check.suggest_fix's data, in words."""
    parts = []
    if "column_map" in fix:
        renames = ", ".join(f"`{old}` to `{new}`" for old, new in fix["column_map"].items())
        parts.append(f"rename {renames}" if renames else "clear the column map")
    if "keep_columns" in fix:
        keep = ", ".join(f"`{c}`" for c in fix["keep_columns"])
        parts.append(f"keep only {keep}" if keep else "keep every column")
    return f"**Suggested fix:** {'; '.join(parts)} (Apply the suggested fix does it)."


def fix_values(fix: dict) -> tuple:
    """The column-map and keep-columns widget values a suggested fix sets (gr.update() for neither)."""
    column_map, keep = fix.get("column_map"), fix.get("keep_columns")
    map_text = yaml.safe_dump(column_map, sort_keys=False) if column_map else ""
    return (gr.update() if column_map is None else map_text, gr.update() if keep is None else ", ".join(keep))


def keep_upload(source: Path, folder: Path) -> Path:
    """Our own copy of an uploaded file (Gradio's temporary one may be cleaned up). A different
    file of the same name gets a new name: earlier runs keep reading the data they trained on."""
    folder.mkdir(parents=True, exist_ok=True)
    target, number = folder / source.name, 1
    while target.exists() and target.read_bytes() != source.read_bytes():
        target, number = folder / f"{source.stem}-{number}{source.suffix}", number + 1
    shutil.copyfile(source, target)
    return target


def hardware_text(hardware: Hardware) -> str:
    """The machine, and what detection found wrong with it (with the fix)."""
    problems = [f"**Warning:** {problem}" for problem in hardware.problems]
    if problems:
        problems.append("The Doctor tab (or `launch.py doctor`) checks the rest of this machine.")
    return "\n\n".join([f"**Hardware:** {hardware.describe()}", *problems])


def wire_core_map_timer(form: TrainForm, on_layout, message: gr.Markdown) -> gr.Timer:
    """While the Layout box is open, the core map is drawn again every CORE_MAP_EVERY_S from the
    leases at that moment (other runs, a chat, take and free cores while the form stays as it is);
    a tick sends nothing while the map would show what it shows."""
    timer = gr.Timer(CORE_MAP_EVERY_S, active=False)

    def on_core_tick(values):
        core_map, text = on_layout(values)
        if core_map == values[form.core_map]:
            return gr.update(), gr.update()
        return core_map, text

    timer.tick(on_core_tick, form.components() | {message, form.core_map}, [form.core_map, message],
               show_progress="hidden", concurrency_id="core-map")
    form.layout_box.expand(lambda: gr.Timer(active=True), None, timer, show_progress="hidden")
    form.layout_box.collapse(lambda: gr.Timer(active=False), None, timer, show_progress="hidden")
    return timer


def build(manager: RunManager, hardware: Hardware, selected: gr.State) -> tuple[TrainForm, gr.Timer]:
    """The tab, in the current Blocks context; its form, and the timer that redraws the run it
    follows (`selected`): start it again (gr.Timer(active=True)) when `selected` changes."""
    gr.Markdown(hardware_text(hardware))
    suggested_fix = gr.State({})
    lr_start = gr.State(TINY_LEARNING_RATE)  # the learning rate the form last set by itself
    with gr.Row():
        with gr.Column(scale=3):
            form = TrainForm(hardware)
        with gr.Column(scale=2):
            with gr.Row():
                preview_btn = gr.Button("Preview command", elem_id="preview")
                start_btn = gr.Button(START, variant="primary", elem_id="start")
            controls = run_panel.RunControls()
            export_btn = gr.Button("Export launch script", elem_id="export")
            message = gr.Markdown("", elem_id="train-message")
            exports = gr.File(label="Launch scripts", file_count="multiple", visible=False, elem_id="exports")
            plan_box = gr.Code(label="Plan: command, environment, applied defaults", language="shell",
                               visible=False, lines=14, elem_id="plan")
            plan_of = gr.State(None)  # the form's values (by name) the plan shown was made from
            forecast_panel.build(form, manager, hardware)
            with gr.Accordion("Sweep: a run for each combination of values", open=False, elem_id="sweep-box"):
                sweep_grid = gr.Textbox(label="Grid: a recipe key and its values a line (keys as --set writes them)",
                                        info=sweep_panel.GRID_HELP, lines=3,
                                        placeholder="learning_rate=1e-3,3e-3\nmax_steps=20,40", elem_id="sweep-grid")
                with gr.Row():
                    sweep_parallel = gr.Number(0, label="At most this many runs at once (0: as many as the free "
                                               "cores allow)", precision=0, minimum=0, elem_id="sweep-parallel")
                    sweep_eval = gr.Checkbox(False, label=f"Evaluate each run when it ends (the tuned model against "
                                             f"its base, {sweep_eval_limit} rows); the table ranks by it",
                                             elem_id="sweep-eval")
                sweep_btn = gr.Button(SWEEP, elem_id="sweep-start")
            panel = run_panel.RunPanel(controls, details=False)
    panel.build_details()  # plots, hardware, log and applied settings: under the form, the page's full width
    inputs = form.components()
    w = form.widgets

    def on_upload(file):
        if not file:
            return gr.update()
        source = Path(file if isinstance(file, str) else file.name)
        return gr.update(value=str(keep_upload(source, manager.runs_dir / "uploads")))

    def on_trainer(trainer, dataset):
        entry = trainers.get(trainer)
        sample = dataset if not str(dataset).startswith("builtin:") else entry.sample
        return {**{group: gr.update(visible=key == trainer) for key, group in form.trainer_groups.items()},
                w["trainer"]: gr.update(info=trainer_info(trainer)), w["dataset"]: gr.update(value=sample),
                w["max_length"]: gr.update(interactive=entry.uses_max_length),
                w["run_name"]: gr.update(placeholder=f"e.g. tiny-{trainer}")}

    def on_starting_values(trainer, model, learning_rate, start):
        # A value other than the one the form set is the user's own (typed, or a cloned run's): kept.
        if parse_number(learning_rate) != start:
            return gr.update(info=learning_rate_info(trainer, model, own=True)), start
        value = learning_rate_start(trainer, model)
        return gr.update(value=value, info=learning_rate_info(trainer, model)), value

    def on_check(values):
        try:
            spec = spec_from_form(form.named(values))
        except SpecError as error:
            return (problems_markdown(error), gr.update(visible=False), {}, gr.update(visible=False),
                    gr.update(value=None, visible=False))
        text, preview, fix, thumbnails = check_report(spec)
        return (text, gr.update(value=preview, visible=preview is not None), fix,
                gr.update(visible=bool(fix)), gr.update(value=thumbnails or None, visible=bool(thumbnails)))

    def on_check_rewards(values):
        """The one place in the form, besides Start, where a user's reward files run."""
        try:
            manager.check(spec_from_form(form.named(values)), run_user_code=True)
        except SpecError as error:
            return problems_markdown(error)
        return "Every reward function was built and called on the dataset's first rows: no problem found."

    def planned(values, whole: bool = False):
        """The form's values (by name), the hardware it plans for, and the plan Preview shows;
        with `whole`, a plan with errors is refused (SpecError), as an export needs it whole."""
        v = form.named(values)
        target = target_hardware(v, hardware)
        launch = manager.plan(spec_from_form(v), target, this_machine=target is hardware,
                              elsewhere=target is not hardware, queue_if_busy=bool(v.get("queue_if_busy")))
        if whole and launch.errors:
            raise SpecError(launch.errors)
        return v, target, launch

    def on_preview(values):
        try:
            v, _, launch = planned(values)
        except SpecError as error:
            return problems_markdown(error), gr.update(visible=False), None
        return "", gr.update(value=launch.describe(), visible=True), v

    def on_form_change(values):
        """The plan shown goes once the form no longer holds what it was made from (another
        trainer, another Run on, any other value): a plan must not seem to be the form's."""
        made = values[plan_of]
        if made is None or form.named(values) == made:
            return gr.update(), gr.update()
        return gr.update(visible=False), None

    def on_export(values):
        try:
            v, target, launch = planned(values, whole=True)
        except SpecError as error:
            return problems_markdown(error), gr.update(visible=False)
        try:  # the batch script Start would submit to the cluster, for a run of its own (a new id), on the form's Nodes
            job = manager.export_plan(export_spec(v), target, elsewhere=target is not hardware)
            texts = (launch_script(launch), submit_script(job))
        except SpecError as error:
            return problems_markdown(error), gr.update(visible=False)
        except ValueError as error:  # a runs folder whose path no script can name
            return problems_markdown(SpecError([str(error)])), gr.update(visible=False)
        folder = manager.runs_dir / "exports"
        folder.mkdir(exist_ok=True)
        name = file_safe(launch.spec.display_name)
        paths = [folder / f"{name}-launch.sh", folder / f"{name}-{EXPORT.name}.sh"]
        for path, text in zip(paths, texts):
            path.write_text(text)
            path.chmod(0o755)
        run_id, nodes = Path(job.argv[-1]).name, job.spec.layout.nodes
        # the cluster's Nodes and settings show under Layout only while Run on names it
        where = "" if run_backend(v) is EXPORT else f"; Run on {EXPORT.label} shows its Nodes and settings"
        return (f"Exported `{paths[0]}` (this machine) and `{paths[1]}` ({EXPORT.label}, {nodes} node(s), "
                f"run `{run_id}`: `sbatch` it on the cluster and the Runs tab lists the run, as if Start had "
                f"submitted it{where})."), \
            gr.update(value=[str(p) for p in paths], visible=True)

    def layout_problems(v) -> tuple[str, list[str]]:
        """The core map of the form's layout, and what makes the layout unable to run."""
        try:
            target, spec = target_hardware(v, hardware), spec_from_form(v, complete=False)
        except SpecError as error:
            return "", error.problems
        except (ValueError, TypeError) as error:
            return "", [str(error)]
        backend = run_backend(v)
        nodes = 0 if backend.local_cores else spec.layout.nodes
        held = manager.core_holders(target) if target is hardware and not nodes else {}
        try:
            cores = parse_cores(spec.layout.cores) if spec.layout.cores else pick_cores(
                spec.layout.nproc, set(range(target.cores)) - set(held), target)
        except ValueError as error:
            return "", [f"studio.cores: {error}"]
        problems = check_layout(spec.layout.nproc, spec.layout.tp_size, spec.layout.fsdp_size, cores, target)
        if not v.get("queue_if_busy"):  # else Start queues the run until they are free (the map shows them held)
            problems += [f"core {c} is held by {held[c]}: choose free cores, stop it first, or queue the run"
                         for c in cores or [] if c in held]
        # the run's memory per core: the plan's estimate (its defaults for the target applied); too much is said there
        estimate, too_big = manager.memory(spec, target, cores or None)
        return (core_map_html(target, cores or [], spec.layout.tp_size, held, nodes, backend.label)
                + memory_html(estimate, spec.layout.nproc)), problems + too_big

    def on_layout(values):
        """The core map; the layout's problems go to the message area, as Start's refusals do
        (and leave it once fixed)."""
        said = values.get(message) or ""
        core_map, problems = layout_problems(form.named(values))
        if problems:
            text = LAYOUT_PROBLEMS + "\n" + "\n".join(f"- {p}" for p in problems)
        else:
            text = "" if said.startswith(LAYOUT_PROBLEMS) else gr.update()
        return core_map or "<div class='core-map'>See the message above.</div>", text

    def on_start(values):
        """Says at once what Start does before the run exists (the checks can take seconds:
        reward functions are built and called in a process of their own), then starts it. Start
        is disabled meanwhile, saying so (a second press was dropped without a word); the event's
        `then` gives it back, also when this fails."""
        v = form.named(values)
        try:
            spec = spec_from_form(v)
        except SpecError as error:
            yield problems_markdown(error), gr.update(), gr.update(), gr.update()
            return
        checks = "the dataset and the reward functions (on its first rows)" if spec.trainer_entry.rewards \
            else "the dataset"
        yield (f"Starting: checking the settings, {checks}, and planning the cores ...", gr.update(), gr.update(),
               gr.update(interactive=False, value=STARTING))
        try:
            if v["target"] != THIS_MACHINE and run_backend(v).local_cores:
                raise SpecError([f"{TARGET_LABELS['instance']}: {v['target']} is not this machine "
                                 f"({hardware.describe()}); Preview or Export the launch script for it, or plan "
                                 "for this machine"])
            view = manager.start(spec, target_hardware(v, hardware), queue_if_busy=bool(v.get("queue_if_busy")))
        except SpecError as error:
            yield problems_markdown(error), gr.update(), gr.update(), gr.update()
            return
        if view.live_state == "queued":
            yield (f"Queued run `{view.id}` ({view.where()}). It starts when its cores are free; the Runs tab shows "
                   f"its place, {run_panel.CANCELS}", gr.update(visible=False), view.id, gr.update())
            return
        yield run_panel.started_text(view), gr.update(visible=False), view.id, gr.update()

    def on_sweep(values):
        """Every run of the grid checked and planned, then started through the queue (a few seconds a
        run). Start sweep is disabled meanwhile, saying so, as Start is; the event's `then` gives it back."""
        v = form.named(values)
        try:
            spec, target = spec_from_form(v), target_hardware(v, hardware)
            if v["target"] != THIS_MACHINE and run_backend(v).local_cores:
                raise SpecError([f"{TARGET_LABELS['instance']}: {v['target']} is not this machine: a sweep runs "
                                 "here; plan for this machine"])
        except SpecError as error:
            yield problems_markdown(error), gr.update()
            return
        yield ("Sweep: checking and planning every run of the grid, then starting them ...",
               gr.update(interactive=False, value=SWEEPING))
        yield sweep_panel.start_sweep(manager, spec, values[sweep_grid], target, parallel=values[sweep_parallel],
                                      evaluate=values[sweep_eval]), gr.update()

    sweep_btn.click(on_sweep, inputs | {sweep_grid, sweep_parallel, sweep_eval}, [message, sweep_btn]).then(
        lambda: gr.update(interactive=True, value=SWEEP), None, sweep_btn, show_progress="hidden")
    form.upload.upload(on_upload, form.upload, w["dataset"])
    # models downloaded since the page was built show up when the list is opened
    w["model"].focus(lambda: gr.update(choices=[*sources.BUILTIN_MODELS, *sources.cached_models()]), None, w["model"],
                     show_progress="hidden")
    w["trainer"].input(on_trainer, [w["trainer"], w["dataset"]],
                        [*form.trainer_groups.values(), w["trainer"], w["dataset"], w["max_length"], w["run_name"]])
    for picked in (w["trainer"].input, w["model"].input):  # the user's picks only, not a clone's
        picked(on_starting_values, [w["trainer"], w["model"], w["learning_rate"], lr_start],
               [w["learning_rate"], lr_start], show_progress="hidden")
    checked = [form.data_report, form.preview, suggested_fix, form.fix_button, form.images]
    form.check_button.click(on_check, inputs, checked)
    for button, report in form.reward_checks.values():
        button.click(on_check_rewards, inputs, report)
    form.fix_button.click(fix_values, suggested_fix, [w["column_map"], w["keep_columns"]]).then(
        on_check, inputs, checked)
    for name in ("extra", "trainer"):
        w[name].change(check_extra, [w["trainer"], w["extra"]], form.extra_check, show_progress="hidden")
    preview_btn.click(on_preview, inputs, [message, plan_box, plan_of], concurrency_id="plan")
    gr.on([widget.change for widget in form.widgets.values()], on_form_change, inputs | {plan_of},
          [plan_box, plan_of], show_progress="hidden", concurrency_id="plan", trigger_mode="always_last")
    export_btn.click(on_export, inputs, [message, exports])
    def on_run_on(run_on):
        backend = run_backend({"run_on": run_on})
        return [*(gr.update(visible=run_on == name) for name in form.option_boxes),
                gr.update(visible=backend.max_nodes != 1), gr.update(interactive=backend.local_cores)]

    w["run_on"].change(on_run_on, w["run_on"], [*form.option_boxes.values(), form.nodes_box, w["cores"]],
                       show_progress="hidden")
    layout_io = (on_layout, inputs | {message}, [form.core_map, message])
    for name in ("nproc", "tp_size", "fsdp_size", "cores", "target", "lnc", "run_on", "nodes", "queue_if_busy",
                 "model", "trainer", "use_peft", "per_device_train_batch_size", "max_length"):  # these: its memory
        w[name].change(*layout_io, show_progress="hidden", concurrency_id="core-map")
    # one queue for every redraw, so an older one (the accordion opening) never lands after a newer one
    form.layout_box.expand(*layout_io, show_progress="hidden", concurrency_id="core-map")
    wire_core_map_timer(form, on_layout, message)
    start_event = start_btn.click(on_start, inputs, [message, plan_box, selected, start_btn])
    start_event.then(lambda: gr.update(interactive=True, value=START), None, start_btn, show_progress="hidden")
    resume_event = controls.wire(manager, hardware, selected, message, queued_by=(start_event,))
    # a tick sends nothing unless the run's files changed or its clock moved a second (see
    # RunPanel.changes), so it may come often: a new event shows within about half a second
    timer = gr.Timer(run_panel.LOOK_EVERY_S)
    panel.follow(timer, manager, selected, pause=True)
    for started in (start_event, resume_event):  # the panel follows a run again
        started.then(lambda: gr.Timer(active=True), None, timer)
    return form, timer
