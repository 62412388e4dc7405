"""The compile cache panel (bottom of the Runs tab): this backend's cache folder, its size
and entries, and a button that clears it (refused while a run is active)."""

from __future__ import annotations

import time

import gradio as gr

from studio_core.machine import compile_cache
from studio_core.runs.manager import RunManager
from studio_core.machine.sizes import format_size

REUSE = {
    "neuron": "NEFFs are reused by later steps and runs whose graphs are identical (same model, shapes, "
              "dtype, layout and compiler version). Not yet verified on Trainium by this studio.",
    "cuda": "Inductor's FX graph and AOTAutograd caches are reused when torch.compile's backend is "
            "inductor; Dynamo traces again in every new process.",
    "cpu": "Inductor's FX graph and AOTAutograd caches are reused when torch.compile's backend is "
           "inductor; Dynamo traces again in every new process.",
}


def cache_text(backend: str, note: str = "") -> str:
    cache = compile_cache.summary(compile_cache.compile_cache_dir(backend))
    rows = [("folder", f"`{cache.path}`"), ("size", format_size(cache.size_bytes))]
    rows += [(kind, str(count)) for kind, count in cache.entries.items()]
    if cache.newest:
        rows.append(("last written", time.strftime("%Y-%m-%d %H:%M", time.localtime(cache.newest))))
    if not cache.exists:
        rows.append(("entries", "none: nothing compiled yet"))
    listing = "\n".join(f"- **{name}**: {value}" for name, value in rows)
    return "\n\n".join(part for part in (note, listing, f"Shared by every {backend} run. {REUSE[backend]}") if part)


def build(manager: RunManager, backend: str, page: gr.Blocks) -> gr.Markdown:
    with gr.Accordion("Compile cache", open=False, elem_id="compile-cache"):
        shown = gr.Markdown("")
        with gr.Row():
            refresh = gr.Button("Refresh", scale=0, min_width=120)
            clear = gr.Button("Clear compile cache", variant="stop", scale=0, min_width=220,
                              elem_id="clear-compile-cache")

    def on_clear() -> str:
        try:
            compile_cache.clear(compile_cache.compile_cache_dir(backend), manager.active_runs())
        except compile_cache.CacheInUse as error:
            return cache_text(backend, f"**Not cleared.** {error}")
        return cache_text(backend, "**Cleared.**")

    refresh.click(lambda: cache_text(backend), None, shown)
    page.load(lambda: cache_text(backend), None, shown)  # its folder is this machine's: after a login
    clear.click(on_clear, None, shown)
    return shown
