"""The Export tab: a finished run becomes a model folder with a model card, then one click
puts it on the Hugging Face Hub.

The export is the engine's (studio_core.export.export, in a child process) and so is the push
(studio_core.export.hub). The token field is a password field whose value is used for one push
and never stored; empty, the push uses HF_TOKEN or the saved Hugging Face login.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import gradio as gr

from studio_core.export import hub
from studio_core.export.export import ExportError, export_run, read_output_info
from studio_core.machine.hardware import Hardware
from studio_core.runs.history import runs_with_a_model
from studio_core.runs.manager import RunManager, RunNotFound


def finished_export(manager: RunManager, hardware: Hardware, run_id: str, out, merge_it: bool) -> tuple:
    """(the status, the files' listing, the export's folder or None) of exporting the run."""
    try:
        result = export_run(manager.view(run_id).dir, out, merge_it, hardware=hardware)
    except RunNotFound as error:
        return f"**Cannot export:** {error.args[0]}", "", None
    except ExportError as error:
        return f"**Not exported:** {error}", "", None
    listing = "\n".join(f"- `{name}`" for name in result["files"])
    return f"Exported the {result['kind']} model to `{result['folder']}`.", listing, result["folder"]


def build(manager: RunManager, hardware: Hardware, page: gr.Blocks) -> tuple[gr.Dropdown, Callable]:
    """The Export tab, in the current Blocks context; its run pick and that pick's choices now, for
    another tab to hand it a run (the Sweeps section's "Export it")."""
    with gr.Row():
        run = gr.Dropdown([], value=None, label="Finished run", scale=3, elem_id="export-run")
        folder = gr.Textbox(label="Export folder", scale=3, elem_id="export-folder",
                            info="a new or empty folder; default: exports/<run> in the runs folder")
        merge = gr.Checkbox(False, label="Merge the LoRA adapter into its base", interactive=False,
                            elem_id="export-merge")
    export = gr.Button("Export", variant="primary", elem_id="export-run-button")
    status = gr.Markdown("", elem_id="export-status")
    files = gr.Markdown("", elem_id="export-files")
    with gr.Accordion("Push to the Hugging Face Hub", open=True):
        with gr.Row():
            repo = gr.Textbox(label="Repo id", placeholder="your-name/model-name", scale=3, elem_id="push-repo")
            private = gr.Checkbox(True, label="Private", elem_id="push-private")
            update = gr.Checkbox(False, label="Update if it exists (a new commit)", elem_id="push-update")
        token = gr.Textbox(label="Token (optional)", type="password", elem_id="push-token",
                           placeholder="empty: HF_TOKEN or your saved login; typed: used for this push only")
        push = gr.Button("Push to the Hub", elem_id="push")
        pushed = gr.Markdown("", elem_id="push-status")
    exported = gr.State(None)  # the folder of the last export on this page

    def on_run(run_id):
        if not run_id:
            return gr.update(interactive=False, value=False), gr.update()
        info = read_output_info(manager.view(run_id).dir)
        default = str(manager.runs_dir / "exports" / run_id)
        return (gr.update(interactive=info["kind"] == "adapter", value=False,
                          label="Merge the LoRA adapter into its base" if info["kind"] == "adapter"
                          else "Merge (only for LoRA runs: this run trained the full model)"),
                gr.update(value=default))

    def on_export(run_id, out, merge_it, progress=gr.Progress()):
        """Says at once that it exports (loading and saving the model takes seconds), then what it did."""
        if not run_id:
            yield "**Pick a finished run.**", "", None
            return
        out = out or manager.runs_dir / "exports" / run_id
        yield f"Exporting run `{run_id}` to `{out}`: loading the model, saving it, writing its card ...", "", None
        progress(0, desc="exporting (loading, saving, writing the card)")
        yield finished_export(manager, hardware, run_id, out, merge_it)

    def on_push(last, repo_id, is_private, is_update, typed, progress=gr.Progress(track_tqdm=True)):
        if not last or not Path(last).exists():
            return "**Export a run first**: the push uploads the export folder."
        progress(0, desc="checking the token")
        try:
            secret, source = hub.resolve_token(typed)
            url = hub.push(last, repo_id or "", secret, source, private=is_private, update=is_update)
        except hub.HubError as error:
            return f"**Not pushed:** {error}"
        return f"Pushed ({'private' if is_private else 'public'}): [{url}]({url})"

    run.change(on_run, run, [merge, folder])
    run.focus(lambda: gr.update(choices=runs_with_a_model(manager)), None, run)
    page.load(lambda: gr.update(choices=runs_with_a_model(manager)), None, run)  # after a login, not before
    export.click(on_export, [run, folder, merge], [status, files, exported])
    push.click(on_push, [exported, repo, private, update, token], pushed)
    return run, lambda: runs_with_a_model(manager)
