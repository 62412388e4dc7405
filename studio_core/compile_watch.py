"""What the training process compiles and what reaches the model, as events (rank 0).

Dynamo calls a start callback when it begins compiling (trigger DYNAMO: a frame, the
forward; LAZY_BACKWARD: its backward, compiled on the first backward pass) and an end
callback when it is done. That works on every backend (neuron, inductor, aot_eager,
eager), so the same events come from a CPU test and a Trainium run:

    compile_start  graph ("0/1": frame 0, its 2nd compilation), phase, step, reason
    compile_end    graph, phase, step, seconds, cache ("hit" / "miss" / absent: unknown)
    shape          a batch shape reaching the model for the first time, and its step

A recompile's reason ("tensor 'kwargs['input_ids']' size mismatch at index 1. expected
16, actual 32") comes from Dynamo's `recompiles` log, which is logged just before the
compile starts. Cache hits are known for Inductor's FX graph cache.

On Neuron, Dynamo's end callback comes when the graph is lowered; neuronx-cc then compiles
it to a NEFF lazily, at the first device sync, so minutes of compiling would count as step
time. `NeffCompileTimes` takes that time from TorchNeuron's own per-graph records
(`torch.neuron.get_dynamo_metrics()`, field `torch_neuronx_compile_us`; read in the
torch-neuronx source, not run here): at the end of a step in which a graph was recorded
(the no-sync counter `counters["neuron"]["compiled_graphs"]` grew), it reads them (that
call syncs the device, so it is made on compiling steps only) and reports each new graph
as a `compile_end` of phase "neff". The step's time is then its wall time less Dynamo's
compile time and the NEFF compile time, and the progress event says the step compiled.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

from studio_core.runs import events as ev

RECOMPILES_LOGGER = "torch._dynamo.guards.__recompiles"
CACHE_COUNTERS = ("fxgraph_cache_hit", "fxgraph_cache_miss")


class CompileWatch:
    def __init__(self, events: Path, step: Callable[[], int]):
        self.events = events
        self.step = step  # the optimizer step now running
        self.finished_s = 0.0
        self.compiles = 0
        self.running: dict[tuple[str, str], float] = {}  # (graph, phase) -> start time
        self.reason: str | None = None
        self.cache_before: tuple[int, int] = (0, 0)
        self.neff: NeffCompileTimes | None = None  # Neuron only
        self._lock = threading.Lock()

    def install(self) -> None:
        import torch
        from torch._dynamo.callback import callback_handler

        neuron = getattr(torch, "neuron", None)
        if neuron is not None and hasattr(neuron, "get_dynamo_metrics"):
            from torch._dynamo.utils import counters

            self.neff = NeffCompileTimes(neuron.get_dynamo_metrics, lambda: counters["neuron"]["compiled_graphs"])
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        if not os.environ.get("TORCH_LOGS"):  # the user's own TORCH_LOGS wins
            torch._logging.set_logs(recompiles=True)
        logging.getLogger(RECOMPILES_LOGGER).addHandler(_ReasonHandler(self))

    def compile_seconds(self) -> float:
        """Compile time so far, including compilations still running."""
        now = time.time()
        with self._lock:
            return self.finished_s + sum(now - start for start in self.running.values())

    def step_ended(self) -> None:
        """At the end of each step: on Neuron, add the NEFF compile time of graphs recorded in it."""
        if self.neff is None:
            return
        for graph, seconds in self.neff.new_graphs():
            with self._lock:
                self.finished_s += seconds
                self.compiles += 1
            ev.append(self.events, ev.compile_end(graph, "neff", self.step(), round(seconds, 3)))

    def report_backend_metrics(self) -> None:
        """The Neuron backend's own per-graph records, when it is installed (Trainium only)."""
        if self.neff is not None:
            ev.append(self.events, ev.compile_metrics("neuron", _plain(self.neff.metrics())))

    def _start(self, args) -> None:
        phase = "backward" if args.callback_trigger.name == "LAZY_BACKWARD" else "forward"
        key = (str(args.compile_id), phase)
        with self._lock:
            self.running[key] = time.time()
            reason, self.reason = (self.reason, None) if phase == "forward" else (None, self.reason)
            self.cache_before = _cache_counts()
        ev.append(self.events, ev.compile_start(key[0], phase, self.step(), reason=reason or None))

    def _end(self, args) -> None:
        phase = "backward" if args.callback_trigger.name == "LAZY_BACKWARD" else "forward"
        key = (str(args.compile_id), phase)
        with self._lock:
            start = self.running.pop(key, None)
            if start is None:
                return
            seconds = time.time() - start
            self.finished_s += seconds
            self.compiles += 1
            hits, misses = (now - before for now, before in zip(_cache_counts(), self.cache_before))
        cache = ("hit" if hits and not misses else "miss") if hits or misses else None
        ev.append(self.events, ev.compile_end(key[0], phase, self.step(), round(seconds, 3), cache=cache))


class NeffCompileTimes:
    """neuronx-cc's compile time per graph, from TorchNeuron's records. `metrics`: its
    get_dynamo_metrics (syncs the device); `recorded`: how many graphs it has recorded so far
    (a counter, no sync)."""

    def __init__(self, metrics: Callable[[], list], recorded: Callable[[], int]):
        self.metrics, self.recorded = metrics, recorded
        self.seen = 0

    def new_graphs(self) -> list[tuple[str, float]]:
        """(graph name, NEFF compile seconds) of the graphs recorded since the last call."""
        if self.recorded() == self.seen:
            return []
        records = self.metrics()
        new, self.seen = records[self.seen:], len(records)
        return [(getattr(r, "graph_name", "") or str(getattr(r, "graph_id", "?")),
                 (getattr(r, "torch_neuronx_compile_us", 0) or 0) / 1e6) for r in new]


class ShapeWatch:
    """A forward pre-hook on the outermost model wrapper (outside the compiled region, so it
    changes no graph): every batch shape reaching the model, and the tokens it carries."""

    def __init__(self, events: Path, step: Callable[[], int]):
        self.events = events
        self.step = step
        self.seen: set[tuple[int, ...]] = set()
        self.tokens = 0  # real (unpadded) tokens so far

    def install(self, model, count_tokens: bool = True) -> None:
        """`count_tokens`: this model's forwards count as trained tokens (the outermost wrapper's
        only: a forward through it reaches the inner model's hook too)."""
        model.register_forward_pre_hook(functools.partial(self._hook, count_tokens=count_tokens), with_kwargs=True)

    def _hook(self, module, args, kwargs, count_tokens: bool = True) -> None:
        import torch

        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor):
            return
        if count_tokens and torch.is_grad_enabled():  # the trained forward; not a reference model's or old policy's pass
            mask = kwargs.get("attention_mask")
            self.tokens += int(mask.sum()) if isinstance(mask, torch.Tensor) and mask.dim() == 2 else ids.numel()
        shape = tuple(ids.shape)
        if shape not in self.seen:
            self.seen.add(shape)
            ev.append(self.events, ev.shape(list(shape), self.step()))


class _ReasonHandler(logging.Handler):
    """Keeps the guard failures of the latest recompile for the next compile_start."""

    def __init__(self, watch: CompileWatch):
        super().__init__(logging.DEBUG)
        self.watch = watch

    def emit(self, record: logging.LogRecord) -> None:
        lines = [line.strip()[2:] for line in record.getMessage().splitlines() if line.strip().startswith("- ")]
        with self.watch._lock:
            self.watch.reason = "; ".join(lines) or record.getMessage().splitlines()[0]


def _cache_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return tuple(counters["inductor"][name] for name in CACHE_COUNTERS)


def _plain(value):
    """Backend records as JSON-friendly values."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return _plain(vars(value)) if hasattr(value, "__dict__") else str(value)
