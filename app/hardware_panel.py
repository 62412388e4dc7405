"""The run page's hardware plots: CPU and memory of the run's processes, NeuronCore
utilisation and device memory, CUDA memory, and a line saying what is monitored and what
is not available (and why).

Everything comes from the run's `hardware` events (written by its supervisor through
studio_core.machine.monitor), which RunView keeps in `view.hardware`. The run panel places these
widgets and adds `render(view)`'s values to its own.

The x-axis is training time (RunState.training_time_at): a resumed run's attempts follow one
another, the time it stood stopped left out, each attempt its own stretch of line. The CPU and
memory plots show from the second sample on (one sample is no line; the note gives its values).
"""

from __future__ import annotations

from bisect import bisect_right

import gradio as gr
import pandas as pd

from studio_core.machine.monitor import SAMPLE_EVERY_S
from studio_core.runs.view import RunView
from studio_core.machine.sizes import MB

MAX_POINTS = 600  # per plot: a long run's samples are thinned to this many, evenly
X_TITLE = "training time (s)"  # a longer title is cut off; the note says what a resume does to it
# Every run page plot's axis labels, as d3 formats: Vega-Lite's own label a lone point's axis with
# every digit ("6.889331" by "1.000000": one step logged, or a value that never changes); these
# give "6.889" by "1", and a long axis its usual ticks.
AXES = {"x_axis_format": "~g", "y_axis_format": ".4~g"}


class HardwarePanel:
    """The widgets, made in the current Blocks context; `render` and `empty` give their values."""

    def __init__(self):
        self.note = gr.Markdown("", elem_classes="run-hardware")
        plot = {"x": "seconds", "x_title": X_TITLE, "height": 220, **AXES}
        # hidden until the run has two samples: an empty plot is an untitled frame, and a lone sample
        # draws no line, only axes labelled with its values' every digit (the note above gives them)
        with gr.Row(visible=False) as self.process_plots:
            self.cpu = gr.LinePlot(y="cpu_percent", color="node", title="CPU of the run's processes (%, 100 = one "
                                   "core)", **plot)
            self.rss = gr.LinePlot(y="rss_mb", color="node", title="Memory of the run's processes (RSS, MB)", **plot)
        with gr.Row():
            self.neuron_util = gr.LinePlot(y="utilization", color="core", title="NeuronCore utilisation (%)",
                                           visible=False, **plot)
            self.neuron_mem = gr.LinePlot(y="memory_mb", color="core", title="NeuronCore device memory (MB)",
                                          visible=False, **plot)
            self.cuda_mem = gr.LinePlot(y="cuda_mb", color="node", title="CUDA memory of the run's processes (MB)",
                                        visible=False, **plot)

    @property
    def components(self) -> list[gr.Component]:
        return [self.note, self.process_plots, self.cpu, self.rss, self.neuron_util, self.neuron_mem, self.cuda_mem]

    @property
    def plots(self) -> list[gr.Component]:
        """The plots, and the row that shows the process plots: what a going run redraws less often."""
        return [self.process_plots, self.cpu, self.rss, self.neuron_util, self.neuron_mem, self.cuda_mem]

    def empty(self) -> dict:
        """{widget: value} when no run is shown."""
        return {self.note: "", self.process_plots: gr.update(visible=False), self.cpu: None, self.rss: None,
                self.neuron_util: gr.update(value=None, visible=False),
                self.neuron_mem: gr.update(value=None, visible=False),
                self.cuda_mem: gr.update(value=None, visible=False)}

    def render(self, view: RunView) -> dict:
        """{widget: value} for this run."""
        samples = _thin(view.hardware)
        neuron = [s for s in samples if "neuron" in s]
        cuda = [s for s in samples if "cuda_mem_bytes" in s]
        return {self.note: note_markdown(view), self.process_plots: gr.update(visible=len(samples) >= 2),
                self.cpu: _plotted(_process_frame(samples, "cpu_percent", view)),
                self.rss: _plotted(_process_frame(samples, "rss_mb", view)),
                self.neuron_util: gr.update(value=_plotted(_core_frame(neuron, "utilization", view)),
                                            visible=bool(neuron)),
                self.neuron_mem: gr.update(value=_plotted(_core_frame(neuron, "memory_mb", view)), visible=bool(neuron)),
                self.cuda_mem: gr.update(value=_plotted(_process_frame(cuda, "cuda_mb", view)), visible=bool(cuda))}


def _plotted(frame: pd.DataFrame) -> pd.DataFrame | None:
    """The frame, or None for no rows. A plot coloured by a column (node, core) that was once
    sent an empty frame fixes an empty colour scale and draws every later line without a
    colour, invisible (Gradio 6); None leaves the plot empty without fixing anything."""
    return frame if len(frame) else None


def note_markdown(view: RunView) -> str:
    """What the plots cover, the latest sample, and each source that is not available."""
    if not view.hardware:
        if view.live_state in ("starting", "running"):
            return f"Hardware: no sample yet (the run's supervisor samples every {SAMPLE_EVERY_S:g} s)."
        return "Hardware: this run has no hardware samples (runs started before hardware monitoring have none)."
    sources = next((e["sources"] for e in reversed(view.hardware) if "sources" in e), {})
    last = view.hardware[-1]
    now = (f"node {last['node']}: " if "node" in last else "") + (
        f"{last['processes']} process(es), CPU {last['cpu_percent']:.0f} %, RSS {last['rss_bytes'] / MB:,.0f} MB")
    if "cuda_mem_bytes" in last:
        now += f", CUDA memory {last['cuda_mem_bytes'] / MB:,.0f} MB"
    cores = (last.get("neuron") or {}).get("cores")
    if cores is not None:
        now += ", " + (", ".join(f"NeuronCore {c}: {d.get('utilization', 0):.0f} %" for c, d in cores.items())
                       or "no NeuronCore of the run active yet")
    lines = [f"**Hardware** ({'last sample' if view.ended is None else 'at the end'}): {now}."]
    if sources.get("monitored"):
        lines.append("Monitored: " + "; ".join(sources["monitored"]) + ".")
    if sources.get("unavailable"):
        lines.append("Not available: " + "; ".join(sources["unavailable"]) + ".")
    for error in (last.get("neuron") or {}).get("errors", []):
        lines.append(f"neuron-monitor reports: {error}")
    if len(view.spans) > 1:
        lines.append(f"The run went in {len(view.spans)} attempts (resumed): the plots' training time joins them, "
                     "one after the other, the time it stood stopped left out.")
    return "  \n".join(lines)


def _thin(samples: list[dict]) -> list[dict]:
    """At most MAX_POINTS samples per node, evenly spaced (a Slurm run's nodes sample in turns)."""
    nodes: dict[str | None, list[dict]] = {}
    for sample in samples:
        nodes.setdefault(sample.get("node"), []).append(sample)
    kept = [s for own in nodes.values() for s in own[::max(1, -(-len(own) // MAX_POINTS))]]
    return sorted(kept, key=lambda s: s["time"])


def _process_frame(samples: list[dict], column: str, view: RunView | None = None) -> pd.DataFrame:
    """One row per sample: seconds, value, node (the plots' colour: a Slurm run's node, else this machine)."""
    value = {"cpu_percent": lambda s: s["cpu_percent"], "rss_mb": lambda s: s["rss_bytes"] / MB,
             "cuda_mb": lambda s: s["cuda_mem_bytes"] / MB}[column]
    rows = [(s, value(s), s.get("node", "this machine")) for s in samples]
    return _frame(view, rows, column, "node")


def _core_frame(samples: list[dict], column: str, view: RunView | None = None) -> pd.DataFrame:
    """One row per sample and core of the run: seconds, value, core (the plots' colour)."""
    key, scale = {"utilization": ("utilization", 1.0), "memory_mb": ("memory_bytes", 1 / MB)}[column]
    rows = [(s, data[key] * scale, (f"{s['node']} " if "node" in s else "") + f"core {core}")
            for s in samples for core, data in s["neuron"].get("cores", {}).items() if key in data]
    return _frame(view, rows, column, "core")


def _frame(view: RunView | None, rows: list[tuple[dict, float, str]], column: str, series: str) -> pd.DataFrame:
    """Rows (sample, value, series) placed at the sample's training time: where a series goes on
    in the run's next attempt, a row without a value between the two breaks its line there."""
    begins = [span.begin for span in view.spans] if view else []
    last: dict[str, tuple[int, float]] = {}  # each series' attempt and place so far
    placed = []
    for sample, value, name in rows:
        seconds = view.training_time_at(sample["time"]) if view else 0.0
        attempt = bisect_right(begins, sample["time"])
        if name in last and last[name][0] != attempt:
            placed.append(((last[name][1] + seconds) / 2, float("nan"), name))
        last[name] = attempt, seconds
        placed.append((seconds, value, name))
    frame = pd.DataFrame(placed, columns=["seconds", column, series])
    return frame.astype({"seconds": float, column: float})
