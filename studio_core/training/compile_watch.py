"""What the training process compiles and what reaches the model, as events (rank 0); the
tokens it trains on (TRL's count); and what the studio's own per-step work costs (StepCost).

Dynamo calls a start callback when it begins compiling (trigger DYNAMO: a frame, the
forward; LAZY_BACKWARD: its backward, compiled on the first backward pass) and an end
callback when it is done. That works on every backend (neuron, inductor, aot_eager,
eager), so the same events come from a CPU test and a Trainium run:

    compile_start  graph ("0/1": frame 0, its 2nd compilation), phase, step, reason
    compile_end    graph, phase, step, seconds, cache ("hit" / "miss" / "unknown": nothing proves
                   either; absent: no cache was asked)
    shape          a batch shape reaching the model for the first time, and its step
                   (read from tensor metadata: nothing here reads a value off the device)

A recompile's reason ("tensor 'kwargs['input_ids']' size mismatch at index 1. expected
16, actual 32") comes from Dynamo's `recompiles` log, which is logged just before the
compile starts. Where a cache answer comes from: see "Cache hits" below.

On Neuron, Dynamo's end callback comes when the graph is lowered; neuronx-cc then compiles
it to a NEFF lazily, at the first device sync, so minutes of compiling would count as step
time. `NeffCompileTimes` takes that time from TorchNeuron's own per-graph records
(`torch.neuron.get_dynamo_metrics()`, field `torch_neuronx_compile_us`; read in the
torch-neuronx source, not run here): at the end of a step in which a graph was recorded
(the no-sync counter `counters["neuron"]["compiled_graphs"]` grew), it reads them (that
call syncs the device, so it is made on compiling steps only) and reports each new graph
as a `compile_end` of phase "neff". The step's time is then its wall time less Dynamo's
compile time and the NEFF compile time, and the progress event says the step compiled.

Cache hits: on CPU and CUDA from Inductor's FX graph cache counters. On Neuron those stay 0
(the neuron backend does not use Inductor), so a "neff" compile_end is labelled hit, miss or
unknown from TorchNeuron's record, its PersistentHits counter (when its metrics are on) and the
NEFF cache folder instead: a record's 0 ms alone is no hit, since TorchNeuron also reports 0 for
an entry it could not find. A step that added NEFFs no missed graph explains (eager-mode ops:
DPO, KTO, GRPO, RLOO and reward modelling train eagerly on Neuron) is reported as a compilation
of phase "eager" whose time is the step's; studio_core/training/neff_watch.py has the rules and
their sources (read in the torch-neuronx source, not run on a device here). `StepCache` gives a
precompile job's step the same answer.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from time import perf_counter, thread_time
from typing import Callable

from studio_core.machine.compile_cache import neff_cache_folder, neff_keys
from studio_core.training.neff_watch import (MISS, NeffStepWatch, cache_labels, compile_seconds, compiled_here,
                                             record_field, step_cache_label)
from studio_core.rundir import events as ev

RECOMPILES_LOGGER = "torch._dynamo.guards.__recompiles"
CACHE_COUNTERS = ("fxgraph_cache_hit", "fxgraph_cache_miss")
# TorchNeuron's count of NEFFs this process read from the persistent cache (torch-neuronx source:
# CompilationCache.cpp adds to it on each persistent hit; torch_neuronx/metrics.py reads it).
PERSISTENT_HITS = "CompilationCache.PersistentHits"


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
        self.eager: NeffStepWatch | None = None  # Neuron with its NEFF cache on
        self.hits: PersistentHits | None = None  # Neuron with TorchNeuron's metrics on
        self._lock = threading.Lock()

    def install(self) -> None:
        import torch
        from torch._dynamo.callback import callback_handler

        self.neff = neuron_compile_times()
        self.hits = PersistentHits.here() if self.neff is not None else None
        folder = neff_cache_folder() if self.neff is not None else None
        if folder is not None:
            self.eager = NeffStepWatch(folder)
            self.eager.start()
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        if not os.environ.get("TORCH_LOGS"):  # the user's own TORCH_LOGS wins
            torch._logging.set_logs(recompiles=True)
        logging.getLogger(RECOMPILES_LOGGER).addHandler(_ReasonHandler(self))

    def compile_seconds(self) -> float:
        """Compile time so far, including compilations still running."""
        if not self.running:  # nearly every step end: no lock, no clock (a read of a dict is safe)
            return self.finished_s
        now = time.time()
        with self._lock:
            return self.finished_s + sum(now - start for start in self.running.values())

    def step_ended(self, since: tuple[float, float] | None = None, new_shape: bool = False) -> None:
        """At the end of each step, on Neuron: neuronx-cc's time for the graphs recorded in it,
        each labelled hit, miss or unknown, and a step that compiled outside them (NEFFs none of
        the missed ones explains) reported as an "eager" compilation of the step's time. `since`:
        when the step began and compile_seconds() then (the worker's mark); `new_shape`: a batch
        shape reached the model for the first time in it."""
        if self.neff is None:
            return
        graphs = self.neff.new_graphs()
        hits = self.hits.grown() if self.hits is not None else None  # read each step: this step's own
        with self._lock:
            self.finished_s += sum(seconds or 0.0 for _, seconds in graphs)
            self.compiles += len(graphs)
        wall = None if since is None else max(0.0, time.time() - since[0] - (self.compile_seconds() - since[1]))
        new = None
        if self.eager is not None and (wall is not None or graphs):
            # a graph without a compile time needs the folder's answer
            uncertain = any(not compiled_here(s) for _, s in graphs)
            new = self.eager.step_ended(wall or 0.0, new_shape, must_scan=uncertain)
        held = self.eager.held if new is not None else None
        labels = cache_labels([seconds for _, seconds in graphs], new, held, hits)
        if graphs:
            step = self.step()
            ev.append_all(self.events, [ev.compile_end(graph, "neff", step, round(seconds or 0.0, 3), cache=label)
                                        for (graph, seconds), label in zip(graphs, labels)])
        unexplained = (new or 0) - labels.count(MISS)
        if unexplained > 0 and since is not None:
            self._eager_compiled(since[0], wall, unexplained)
        elif self.eager is not None and wall is not None and self.compile_seconds() == since[1]:
            self.eager.steady_step(wall)

    def _eager_compiled(self, began: float, seconds: float, neffs: int) -> None:
        """A step compiled ops outside any graph: its time (less what graphs took) was compiling.
        Found at the step's end, so both events are written then; the start carries the step's
        start time, when this compilation began at the earliest."""
        with self._lock:
            self.finished_s += seconds
            self.compiles += 1
        step = self.step()
        start = ev.compile_start(f"eager/{step}", "eager", step,
                                 reason=f"{neffs} new NEFF(s) in the NEFF cache that no compiled graph explains "
                                        "(ops run eagerly, without torch.compile)")
        start["time"] = began
        ev.append_all(self.events, [start, ev.compile_end(f"eager/{step}", "eager", step, round(seconds, 3),
                                                          cache=MISS, graphs=neffs)])

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
            # on Neuron the "neff" compile_end carries the answer (Inductor's counters stay 0 there)
            cache = None if self.neff is not None else _inductor_label(_cache_counts(), self.cache_before)
        ev.append(self.events, ev.compile_end(key[0], phase, self.step(), round(seconds, 3), cache=cache))


class NeffCompileTimes:
    """neuronx-cc's compile time per graph, from TorchNeuron's records. `metrics`: its
    get_dynamo_metrics (syncs the device); `recorded`: how many graphs it has recorded so far
    (a counter, no sync)."""

    def __init__(self, metrics: Callable[[], list], recorded: Callable[[], int]):
        self.metrics, self.recorded = metrics, recorded
        self.seen = 0

    def new_graphs(self) -> list[tuple[str, float | None]]:
        """(graph name, NEFF compile seconds; None when its record has no such field) of the
        graphs recorded since the last call."""
        if self.recorded() == self.seen:
            return []
        records = self.metrics()
        new, self.seen = records[self.seen:], len(records)
        return [(_record_name(r), compile_seconds(r)) for r in new]


def _record_name(record) -> str:
    return record_field(record, "graph_name") or str(record_field(record, "graph_id") or "?")


def neuron_compile_times() -> NeffCompileTimes | None:
    """TorchNeuron's per-graph records of this process, when torch-neuronx is installed (Trainium)."""
    import torch

    neuron = getattr(torch, "neuron", None)
    if neuron is None or not hasattr(neuron, "get_dynamo_metrics"):
        return None
    from torch._dynamo.utils import counters

    return NeffCompileTimes(neuron.get_dynamo_metrics, lambda: counters["neuron"]["compiled_graphs"])


class PersistentHits:
    """TorchNeuron's PersistentHits counter, read as its growth since the last reading. `read`:
    the counter's value (torch_neuronx.metrics.get_counter_value; None: not counted yet)."""

    def __init__(self, read: Callable[[], int | None]):
        self.read = read
        self.seen = read() or 0

    @classmethod
    def here(cls) -> PersistentHits | None:
        """This process's counter, when torch-neuronx counts it (its metrics are off by default:
        TORCH_NEURONX_METRICS_ENABLED=1 turns them on); None when nothing can be read."""
        try:
            import torch_neuronx.metrics as metrics
        except ImportError:
            return None
        if not (hasattr(metrics, "get_counter_value") and hasattr(metrics, "is_enabled")) or not metrics.is_enabled():
            return None
        return cls(lambda: metrics.get_counter_value(PERSISTENT_HITS))

    def grown(self) -> int | None:
        """How much the counter grew since the last reading; None when it went back (TorchNeuron
        clears it with its persistent cache), which says nothing of the step."""
        now = self.read() or 0
        grown, self.seen = now - self.seen, now
        return grown if grown >= 0 else None


class StepCache:
    """Whether one step's compilations came from the compile cache (a precompile job's step):
    on Neuron "hit", "miss" or "unknown" from TorchNeuron's records, its PersistentHits counter and
    the NEFF cache folder (neff_watch.step_cache_label), elsewhere from Inductor's FX graph cache
    counters (None: the cache was not asked)."""

    def __init__(self, neff: NeffCompileTimes | None, folder: Path | None, hits: PersistentHits | None = None):
        self.neff, self.folder, self.hits = neff, folder, hits
        self.before: tuple[int, int] = (0, 0)
        self.keys: set[str] = set()

    @classmethod
    def here(cls) -> StepCache:
        neff = neuron_compile_times()
        if neff is None:
            return cls(None, None)
        return cls(neff, neff_cache_folder(), PersistentHits.here())

    def begin(self) -> None:
        if self.neff is None:
            self.before = _cache_counts()
            return
        if self.folder is not None:
            self.keys = neff_keys(self.folder)
        if self.hits is not None:
            self.hits.grown()  # from here on

    def end(self) -> str | None:
        if self.neff is None:
            return _inductor_label(_cache_counts(), self.before)
        graphs = self.neff.new_graphs()  # syncs the device: every graph of the step has compiled
        now = neff_keys(self.folder) if self.folder is not None else None
        new, held = (None, None) if now is None else (len(now - self.keys), len(now & self.keys))
        hits = self.hits.grown() if self.hits is not None else None
        return step_cache_label([seconds for _, seconds in graphs], new, held, hits)


class ShapeWatch:
    """A forward pre-hook on the outermost model wrapper (outside the compiled region, so it
    changes no graph): every batch shape reaching the model. It reads tensor metadata only
    (`.shape`), never a value: on Neuron or CUDA a value read here would be a device-to-host
    sync per micro-batch, stalling the device's queue. The tokens come from TRL (TrainerTokens)."""

    def __init__(self, events: Path, step: Callable[[], int], cost: StepCost | None = None):
        self.events = events
        self.step = step
        self.cost = cost
        self.seen: set[tuple[int, ...]] = set()

    def install(self, model) -> None:
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        start, cpu_start = perf_counter(), thread_time()
        ids = kwargs.get("input_ids", args[0] if args else None)
        shape = getattr(ids, "shape", None)  # a tensor's metadata; None for anything else
        if shape is not None:
            shape = tuple(shape)
            if shape not in self.seen:
                self.seen.add(shape)
                ev.append(self.events, ev.shape(list(shape), self.step()))
        if self.cost is not None:
            self.cost.add("shape_hook", start, cpu_start)


class TrainerTokens:
    """The tokens trained so far, as TRL itself counts them for its `num_tokens` metric: a Python
    int TRL keeps on the host (it has already made the .item() call for its metric), so reading
    it makes no device sync of ours. TRL 1.16 keeps it in `_total_train_tokens` in SFT, DPO, KTO
    and reward modelling (training mode only, summed over the data-parallel ranks, divided by the
    tensor-parallel size), and in `state.num_input_tokens_seen` in GRPO and RLOO (prompt and
    completion tokens, counted as they are generated), where `_total_train_tokens` stays 0.
    Whichever grows first is read from then on (Transformers also adds to num_input_tokens_seen
    when a user sets include_num_input_tokens_seen; TRL's own count wins then)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.begin = self._counters()  # a resumed attempt starts from its checkpoint's count
        self.from_trl_total = False

    def _counters(self) -> tuple[int, int]:
        return getattr(self.trainer, "_total_train_tokens", 0) or 0, self.trainer.state.num_input_tokens_seen or 0

    def counted(self) -> int:
        """Tokens counted since this attempt's training began (all data-parallel ranks)."""
        total, seen = self._counters()
        if self.from_trl_total or total > self.begin[0]:
            self.from_trl_total = True
            return total - self.begin[0]
        return seen - self.begin[1]


class EventBuffer:
    """The per-step events (progress, metrics), written together: at once when the last write is
    FLUSH_S old or more (so a 1-second Trainium step's progress is written as it ends), else with
    the next that is due, and at the end of training (`flush`). A model of 50 steps/s then makes
    one open, write and close per dozen steps instead of per step, and its JSON encoding runs
    back to back (several times faster than at each step end, with the caches cold from the
    step). Readers poll every 1-2 s, so they see no delay; a rank that crashes loses at most its
    last FLUSH_S of progress (its error event still comes)."""

    FLUSH_S = 0.25

    def __init__(self, path: Path):
        self.path = path
        self.pending: list[dict] = []
        self.written = float("-inf")  # monotonic time of the last write: the first event goes at once

    def add(self, event: dict) -> None:
        self.pending.append(event)
        if time.monotonic() - self.written >= self.FLUSH_S:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            ev.append_all(self.path, self.pending)
            self.pending = []
        self.written = time.monotonic()


class StepCost:
    """The studio's own time in the training process, per part, and how often each part ran:
    around each call the studio makes per step, perf_counter() (wall time: what the step felt,
    including any time the OS gave the core to another process meanwhile) and thread_time()
    (this thread's CPU time: the studio's work alone, which a busy machine does not inflate),
    added into small dicts whose keys exist from the start (nothing is kept per call)."""

    PARTS = ("step_end", "log", "shape_hook", "stop_check")

    def __init__(self):
        self.seconds = dict.fromkeys(self.PARTS, 0.0)
        self.cpu_seconds = dict.fromkeys(self.PARTS, 0.0)
        self.calls = dict.fromkeys(self.PARTS, 0)

    def add(self, part: str, start: float, cpu_start: float) -> None:
        """One call of `part`, begun at perf_counter() `start` and thread_time() `cpu_start`, has ended."""
        self.cpu_seconds[part] += thread_time() - cpu_start
        self.seconds[part] += perf_counter() - start
        self.calls[part] += 1

    def parts(self) -> dict[str, dict]:
        """{part: {seconds, cpu_seconds, calls}}, as the studio_cost event carries them."""
        return {name: {"seconds": round(self.seconds[name], 6), "cpu_seconds": round(self.cpu_seconds[name], 6),
                       "calls": self.calls[name]} for name in self.PARTS}


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


def _inductor_label(now: tuple[int, int], before: tuple[int, int]) -> str | None:
    """Inductor's FX graph cache answer between two counts: hit, miss, or None (it was not asked)."""
    hits, misses = (n - b for n, b in zip(now, before))
    return ("hit" if hits and not misses else "miss") if hits or misses else None


def _plain(value):
    """Backend records as JSON-friendly values."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return _plain(vars(value)) if hasattr(value, "__dict__") else str(value)
