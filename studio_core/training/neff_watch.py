"""On Neuron: did a graph come from the NEFF cache, and did a step compile outside any graph.

Written from torch-neuronx's source, not run on a Trainium device here. Two signals:

- TorchNeuron's per-graph records (`torch.neuron.get_dynamo_metrics()`), one per Dynamo graph,
  with `torch_neuronx_compile_us`: neuronx-cc's time for it, filled from the in-process
  compilation cache's entry (torch-neuronx metrics.py, `_populate_compile_timing`). A graph
  found in the persistent NEFF cache gets an entry made with a compile time of exactly 0 ms
  (CompilationCache.cpp, `CheckCacheAndCoordinateWork`); a graph compiled here gets the
  compiler's time, seconds at least (neuronx-cc is a compiler run, not a lookup).
- The NEFF cache folder (`TORCH_NEURONX_NEFF_CACHE_DIR`, files <dir>/ab/cd/<key>.neff): a
  compile that missed the cache writes a new file there (the same source: `Put` after a
  compile). Eager-mode ops compile into it too, and `get_dynamo_metrics` never sees them.

Which wins: the record, when it has a compile time. It is this process's own, per graph; the
folder is shared by every process on the machine (the run's other ranks, other runs, parallel
precompile jobs), and a new file there does not say which graph, op or process made it. So
`torch_neuronx_compile_us` at or above NEAR_ZERO_S is a miss, below it a hit; the folder
decides only for a record without that field, and for steps that recorded no graph at all.

Eager steps (DPO, KTO, GRPO, RLOO and reward modelling run without torch.compile on Neuron
by default; compiled runs also run their optimizer's ops eagerly): a step after which the
folder holds NEFFs that none of the step's graphs explains compiled for (part of) its time.
`NeffStepWatch` lists the folder (three levels of scandir: tens of milliseconds for thousands
of NEFFs) only where a compile is likely, so a steady step pays nothing: the attempt's first
WARMUP_STEPS steps, a step in which a new batch shape reached the model, a step much slower
than the recent steady ones, and the step of a record without a compile time. NEFFs a step
that was not listed added are counted at the next listing. The whole step's time, less the
graphs' compile time already counted, is then its compile time: an upper bound (the step
also ran), which keeps it out of the steady step times the ETA is made of. What this cannot
tell: a step that only waited for another process compiling the same graph (it finds the
NEFF then: no new file of its own), and NEFFs another process added while this step was slow.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from studio_core.machine.compile_cache import neff_keys
from studio_core.rundir.events import WARMUP_STEPS

NEAR_ZERO_S = 0.05  # a cache hit records 0 ms; any real neuronx-cc run takes far longer than this
SLOW_FACTOR, SLOW_MARGIN_S = 2.0, 1.0  # a step this much slower than the steady ones may have compiled
RECENT = 20  # steady step times kept for that comparison


def record_field(record, name: str):
    """A field of a get_dynamo_metrics() record: a dataclass in torch-neuronx, a dict when read back."""
    return record.get(name) if isinstance(record, dict) else getattr(record, name, None)


def compile_seconds(record) -> float | None:
    """neuronx-cc's time for a record's graph, None when the record does not carry it."""
    micro = record_field(record, "torch_neuronx_compile_us")
    return None if micro is None else micro / 1e6


def cache_label(compile_s: float | None, new_neffs: int | None) -> str | None:
    """One graph's cache answer. `compile_s`: its record's compile time (None: not recorded);
    `new_neffs`: NEFFs added to the cache folder while it compiled (None: not looked at, or no
    cache folder). The record wins when it has a time (the module's docstring says why)."""
    if compile_s is not None:
        return "miss" if compile_s >= NEAR_ZERO_S else "hit"
    if new_neffs is None:
        return None
    return "miss" if new_neffs else "hit"


def step_cache_label(compile_times: Sequence[float | None], new_neffs: int | None) -> str | None:
    """A whole step's answer (a precompile job's step: one batch shape): a miss if any of its
    graphs missed, a hit if all hit; with no graph recorded, what the cache folder says."""
    labels = [cache_label(seconds, new_neffs) for seconds in compile_times] or [cache_label(None, new_neffs)]
    if "miss" in labels:
        return "miss"
    return "hit" if all(label == "hit" for label in labels) else None


def should_scan(step: int, wall_s: float, new_shape: bool, steady: Sequence[float]) -> bool:
    """Whether to list the NEFF cache after this step (`step`: 1 for an attempt's first; `wall_s`:
    its time less the compile time already counted; `steady`: recent times of steps that
    compiled nothing). Listing costs tens of milliseconds in a large cache: only where a
    compile is likely."""
    if step <= WARMUP_STEPS or new_shape or not steady:
        return True
    typical = statistics.median(steady)
    return wall_s > max(SLOW_FACTOR * typical, typical + SLOW_MARGIN_S)


class NeffStepWatch:
    """The NEFF cache folder between steps: which NEFFs appeared since the last listing."""

    def __init__(self, folder: Path, list_keys=neff_keys):
        self.folder = folder
        self.list_keys = list_keys
        self.known: set[str] | None = None
        self.steady: deque[float] = deque(maxlen=RECENT)
        self.steps = 0  # steps ended in this process (one attempt)

    def start(self) -> None:
        """Before training: what the cache already holds."""
        self.known = self.list_keys(self.folder)

    def step_ended(self, wall_s: float, new_shape: bool, must_scan: bool = False) -> int | None:
        """NEFFs added since the last listing, if this step is one to look at (None if not)."""
        self.steps += 1
        if not (must_scan or should_scan(self.steps, wall_s, new_shape, self.steady)):
            return None
        now = self.list_keys(self.folder)
        added = len(now - self.known) if self.known is not None else 0  # a first listing only sets the baseline
        self.known = now  # a clear in the meantime shrinks it: only additions count
        return added

    def steady_step(self, wall_s: float) -> None:
        """A step that compiled nothing: what later steps are compared with."""
        if self.steps > 1:  # an attempt's first step warms up
            self.steady.append(wall_s)
