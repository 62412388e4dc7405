"""The Train tab: pick model, dataset, trainer and settings; preview; start; watch; stop.

`spec_from_form` is the one place where widget values become a RunSpec; everything
after that is the engine's (validation, planning, the run folder, the processes).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gradio as gr
import yaml

from app import run_panel
from studio_core.builtin import BUILTIN_DATASETS, BUILTIN_MODEL
from studio_core.hardware import Hardware
from studio_core.runs import RunManager
from studio_core.spec import Layout, RunSpec, SpecError

DATA_FILE_TYPES = [".jsonl", ".json", ".csv", ".parquet"]


def spec_from_form(model, dataset, dataset_config, dataset_split, trainer, max_steps, epochs, learning_rate,
                   batch_size, max_length, logging_steps, nproc, run_name, extra_yaml) -> RunSpec:
    """Widget values -> RunSpec. Raises SpecError for values that are not even well-formed."""
    try:
        extra = yaml.safe_load(extra_yaml or "") or {}
    except yaml.YAMLError as error:
        raise SpecError([f"Other TRL settings: not valid YAML ({error})"]) from error
    if not isinstance(extra, dict):
        raise SpecError(["Other TRL settings: write one `key: value` per line"])
    args = {
        "max_steps": int(max_steps) if max_steps else -1,
        "num_train_epochs": float(epochs or 0),
        "learning_rate": float(learning_rate or 0),
        "per_device_train_batch_size": int(batch_size or 0),
        "max_length": int(max_length) if max_length else None,
        "logging_steps": int(logging_steps or 1),
        **extra,
    }
    return RunSpec(trainer=trainer, model_name_or_path=(model or "").strip(),
                   dataset_name=(dataset or "").strip(), dataset_config=(dataset_config or "").strip() or None,
                   dataset_train_split=(dataset_split or "").strip() or "train",
                   run_name=(run_name or "").strip() or None, args=args, layout=Layout(nproc=int(nproc or 1)))


def problems_markdown(error: SpecError) -> str:
    lines = "\n".join(f"- {p}" for p in error.problems)
    return f"**Nothing was launched. Change these and try again:**\n{lines}"


def build(manager: RunManager, hardware: Hardware, selected: gr.State) -> tuple[gr.Timer, list]:
    gr.Markdown(f"**Hardware:** {hardware.describe()}")
    with gr.Row():
        with gr.Column(scale=3):
            with gr.Row():
                model = gr.Dropdown([BUILTIN_MODEL], value=BUILTIN_MODEL, allow_custom_value=True,
                                    label="Model", info="built-in tiny model, a Hub id (Qwen/Qwen3-0.6B) "
                                    "or a local folder", elem_id="model")
                dataset = gr.Dropdown(list(BUILTIN_DATASETS), value="builtin:qa", allow_custom_value=True,
                                      label="Dataset", info="built-in sample, a local JSONL/JSON/CSV/Parquet "
                                      "file, or a Hub id", elem_id="dataset")
            with gr.Accordion("Upload a dataset file, or Hub dataset options", open=False):
                upload = gr.File(label="Dataset file", file_types=DATA_FILE_TYPES, elem_id="upload")
                with gr.Row():
                    dataset_config = gr.Textbox(label="Config (Hub datasets)", placeholder="default")
                    dataset_split = gr.Textbox(label="Split", value="train")
            trainer = gr.Radio(["sft"], value="sft", label="Trainer",
                               info="SFT (TRL SFTTrainer). DPO and GRPO are not available yet.")
            with gr.Row():
                max_steps = gr.Number(300, label="max_steps", precision=0, info="0: train by epochs",
                                      elem_id="max_steps")
                epochs = gr.Number(3, label="num_train_epochs", info="used when max_steps is 0")
                learning_rate = gr.Number(2e-3, label="learning_rate", elem_id="learning_rate")
            with gr.Row():
                batch_size = gr.Number(4, label="per_device_train_batch_size", precision=0)
                max_length = gr.Number(128, label="max_length", precision=0, info="tokens; 0: no truncation")
                logging_steps = gr.Number(10, label="logging_steps", precision=0, elem_id="logging_steps")
            with gr.Row():
                nproc = gr.Number(1, label="Processes (torchrun nproc)", precision=0, minimum=1,
                                  info=f"up to {hardware.devices if hardware.backend != 'cpu' else hardware.cpu_count}",
                                  elem_id="nproc")
                run_name = gr.Textbox(label="Run name", placeholder="e.g. tiny-sft", elem_id="run_name")
            extra = gr.Code(label="Other TRL settings (YAML, TRL's names), e.g. `warmup_steps: 10`",
                            language="yaml", lines=3, value="", elem_id="extra")
        with gr.Column(scale=2):
            with gr.Row():
                preview_btn = gr.Button("Preview command", elem_id="preview")
                start_btn = gr.Button("Start", variant="primary", elem_id="start")
                stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
            message = gr.Markdown("", elem_id="train-message")
            preview = gr.Code(label="Plan: command, environment, applied defaults", language="shell",
                              visible=False, lines=14, elem_id="plan")
            panel = run_panel.make_panel()

    form = [model, dataset, dataset_config, dataset_split, trainer, max_steps, epochs, learning_rate,
            batch_size, max_length, logging_steps, nproc, run_name, extra]

    def on_upload(file):
        if not file:
            return gr.update()
        source = Path(file if isinstance(file, str) else file.name)
        target = manager.runs_dir / "uploads" / source.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)  # Gradio's temporary copy may be cleaned up; keep our own
        return gr.update(value=str(target))

    def on_preview(*values):
        try:
            launch = manager.plan(spec_from_form(*values), hardware)
        except SpecError as error:
            return problems_markdown(error), gr.update(visible=False)
        return "", gr.update(value=launch.describe(), visible=True)

    def on_start(*values):
        try:
            view = manager.start(spec_from_form(*values), hardware)
        except SpecError as error:
            return problems_markdown(error), gr.update(), None
        return f"Started run `{view.id}`. It keeps going if you close this page.", gr.update(visible=False), view.id

    def on_stop(run_id):
        if not run_id:
            return "No run to stop."
        view = manager.stop(run_id)
        return f"Run `{run_id}` is {view.live_state}; none of its processes is left."

    upload.upload(on_upload, upload, dataset)
    preview_btn.click(on_preview, form, [message, preview])
    start_btn.click(on_start, form, [message, preview, selected])
    stop_btn.click(on_stop, selected, message)
    timer = gr.Timer(1.0)
    timer.tick(lambda run_id: run_panel.render(manager, run_id), selected, panel, show_progress="hidden")
    return timer, panel
