"""The Doctor tab: the same checks as `launch.py doctor`, shown as they finish."""

from __future__ import annotations

import gradio as gr

from studio_core import doctor
from studio_core.hardware import Hardware
from studio_core.runs.manager import RunManager

INTRO = ("Checks this machine for the studio: the backend and versions, the devices, a 2-process collective "
         "placed as a run's ranks are, a compiled step that must hit the compile cache the second time, the "
         "cache and runs folders, the hardware monitor and the Hub. The device checks take free cores while they "
         "run (about a minute on CPU, several on Neuron, where the first compilations are slow). Run it first on "
         "a new machine; `python launch.py doctor` prints the same, to paste into a bug report.")


def table(results: list[doctor.Check], running: bool) -> str:
    rows = [f"| {'PASS' if c.ok else '**FAIL**'} | {c.name} | {_cell(c.found)} | {_cell(c.fix) if not c.ok else ''} |"
            for c in results]
    lines = ["| | check | found | what to do |", "|---|---|---|---|", *rows]
    if running:
        ending = f"Checking ... ({len(results)} done)"
    else:  # the CLI's last line, word for word: one verdict for both
        verdict = doctor.verdict(results)
        ending = f"**{verdict[0].upper()}{verdict[1:]}.**"
    return "\n".join(lines) + "\n\n" + ending


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def build(manager: RunManager, hardware: Hardware) -> None:
    gr.Markdown(INTRO)
    start = gr.Button("Check this machine", variant="primary", scale=0, min_width=220, elem_id="doctor-run")
    shown = gr.Markdown(elem_id="doctor-results")

    def on_start():
        results: list[doctor.Check] = []
        yield table(results, running=True), gr.update(interactive=False)
        for check in doctor.checks(manager.runs_dir, hardware):
            results.append(check)
            yield table(results, running=True), gr.update(interactive=False)
        yield table(results, running=False), gr.update(interactive=True)

    start.click(on_start, None, [shown, start])
