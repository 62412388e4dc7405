"""The Doctor tab: the same checks as `launch.py doctor`, shown as they finish; and the smoke
test of `launch.py doctor --smoke` (studio_core.doctor.smoke), run in the background and followed."""

from __future__ import annotations

import gradio as gr

from studio_core.doctor import doctor, smoke
from studio_core.machine.hardware import Hardware
from studio_core.runs.manager import RunManager

INTRO = ("Checks this machine for the studio: the backend and versions, the devices, a 2-process collective "
         "placed as a run's ranks are, a compiled step that must hit the compile cache the second time, the "
         "cache and runs folders, the hardware monitor and the Hub. The device checks take free cores while they "
         "run (about a minute on CPU, several on Neuron, where the first compilations are slow). Run it first on "
         "a new machine; `python launch.py doctor` prints the same, to paste into a bug report.")
SMOKE_INTRO = ("**Smoke test** (`python launch.py doctor --smoke`): the studio's own jobs on this machine's device "
               "with the built-in tiny model: a precompiled run that must find its graphs in the cache, 5 compiled "
               "SFT steps, a 2-process run, a 3-token chat and an evaluation. It takes its cores like any run, "
               "goes on in the background if you leave the page (minutes on CPU, more on Neuron) and writes one "
               "report file to attach to a bug report.")


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


def smoke_table(job: smoke.Background) -> str:
    steps = list(job.smoke.steps)
    rows = [f"| {'running ...' if s.ok is None else 'skipped' if s.skipped else 'PASS' if s.ok else '**FAIL**'} | "
            f"{s.name} | "
            f"{smoke.STEPS[s.name]} | {'' if s.ok is None else f'{s.seconds:.0f} s'} | {_cell(s.error or s.found)} |"
            for s in steps]
    lines = ["| | step | what | time | found / error |", "|---|---|---|---|---|", *rows]
    if not job.done:
        ending = f"Running ... ({sum(s.ok is not None for s in steps)} of {len(smoke.STEPS)} steps done)"
    else:
        verdict = smoke.verdict([s for s in steps if s.ok is not None])
        ending = f"**{verdict[0].upper()}{verdict[1:]}.**" + (f" {job.failure}" if job.failure else "")
        if job.smoke.report_path is not None:
            ending += (f"\n\nReport (attach it to a bug report): `{job.smoke.report_path}` "
                       f"(readable copy: `{job.smoke.report_path.with_suffix('.md')}`)")
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

    gr.Markdown(SMOKE_INTRO)
    run_smoke = gr.Button("Run smoke test", scale=0, min_width=220, elem_id="doctor-smoke")
    smoke_shown = gr.Markdown(elem_id="doctor-smoke-results")
    timer = gr.Timer(1.0, active=False)

    def on_smoke():
        job, started = smoke.Background.start(manager.runs_dir)  # one at a time: a second click shows it
        note = "" if started else "A smoke test was already running; here it is.\n\n"
        return note + smoke_table(job), gr.update(interactive=False), gr.Timer(active=True)

    def on_tick():
        job = smoke.Background.latest
        if job is None:
            return "", gr.update(interactive=True), gr.Timer(active=False)
        return smoke_table(job), gr.update(interactive=job.done), gr.Timer(active=not job.done)

    run_smoke.click(on_smoke, None, [smoke_shown, run_smoke, timer])
    timer.tick(on_tick, None, [smoke_shown, run_smoke, timer], show_progress="hidden", queue=False)
