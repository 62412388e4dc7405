"""On Neuron: did a graph come from the NEFF cache, and did a step compile outside any graph.

Written from torch-neuronx's source, not run on a Trainium device here. Each answer is "hit",
"miss" or "unknown": unknown where nothing read proves either. The signals:

- TorchNeuron's per-graph records (`torch.neuron.get_dynamo_metrics()`), one per Dynamo graph,
  with `torch_neuronx_compile_us`: neuronx-cc's time for it, looked up by the graph's key in the
  in-process compilation cache's entries (torch-neuronx metrics.py, `_populate_compile_timing`
  and `_get_compilation_time_ms`). A graph compiled here gets the compiler's time, seconds at
  least (neuronx-cc is a compiler run, not a lookup): at or above NEAR_ZERO_S it is a miss. But 0
  is reported both for a graph found in the persistent NEFF cache (its entry is made with a
  compile time of 0 ms: CompilationCache.cpp, `CheckCacheAndCoordinateWork`) and for one whose
  entry is not found, evicted from the in-process cache (the lookup's default): 0 alone does not
  prove a hit.
- TorchNeuron's `CompilationCache.PersistentHits` counter (torch_neuronx.metrics,
  `get_counter_value`; counted only when its metrics are on, TORCH_NEURONX_METRICS_ENABLED=1):
  it grows by one for each NEFF read from the persistent cache by this process, graphs' and
  eager ops' alike. When it can be read, a step's graphs without a compile time are hits if it
  grew by at least as many, else unknown; the folder is not asked then.
- The NEFF cache folder (`TORCH_NEURONX_NEFF_CACHE_DIR`, NEFFs at any depth: <dir>/ab/cd/<key>.neff
  from the persistent cache, <dir>/<hash>/<hash>.neff from the kernel path): a compile that
  missed the cache writes a new file there (the same source: `Put` after a compile). A graph's
  file cannot be named from its record (the persistent key hashes the graph's HLO too:
  CacheUtils.cpp, `MakePersistentCacheKey`), so the folder's evidence for a 0 record is that it
  held NEFFs before the step and the step added none: the graph was not compiled into it, and
  there was something to find. Eager-mode ops compile into it too, and `get_dynamo_metrics`
  never sees them.

Which wins: a record's compile time, when it is not 0. It is this process's own, per graph; the
folder is shared by every process on the machine (the run's other ranks, other runs, parallel
precompile jobs), and a new file there does not say which graph, op or process made it. A record
without the field is a miss when the folder grew meanwhile (nothing else explains it better);
one of 0 is then unknown, since another rank may have written the NEFF it found.

Eager steps (DPO, KTO, GRPO, RLOO and reward modelling run without torch.compile on Neuron
by default; compiled runs also run their optimizer's ops eagerly): a step after which the
folder holds NEFFs that none of the step's missed graphs explains compiled for (part of) its
time. `NeffStepWatch` lists the folder (os.scandir down the tree: tens of milliseconds for
thousands of NEFFs) only where a compile is likely, so a steady step pays nothing: the
attempt's first WARMUP_STEPS steps, a step in which a new batch shape reached the model, a step
much slower than the recent steady ones, and the step of a record without a compile time. NEFFs
a step that was not listed added are counted at the next listing. The whole step's time, less
the graphs' compile time already counted, is then its compile time: an upper bound (the step
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

NEAR_ZERO_S = 0.05  # 0 ms is recorded for a cache hit or an entry not found; any neuronx-cc run takes far longer
SLOW_FACTOR, SLOW_MARGIN_S = 2.0, 1.0  # a step this much slower than the steady ones may have compiled
RECENT = 20  # steady step times kept for that comparison


def record_field(record, name: str):
    """A field of a get_dynamo_metrics() record: a dataclass in torch-neuronx, a dict when read back."""
    return record.get(name) if isinstance(record, dict) else getattr(record, name, None)


def compile_seconds(record) -> float | None:
    """neuronx-cc's time for a record's graph, None when the record does not carry it."""
    micro = record_field(record, "torch_neuronx_compile_us")
    return None if micro is None else micro / 1e6


HIT, MISS, UNKNOWN = "hit", "miss", "unknown"  # a compile_end's or precompiled's `cache`


def compiled_here(compile_s: float | None) -> bool:
    """A record's compile time says neuronx-cc ran for its graph in this process."""
    return compile_s is not None and compile_s >= NEAR_ZERO_S


def cache_label(compile_s: float | None, new_neffs: int | None, held: int | None = None,
                persistent_hits: int | None = None, uncertain: int = 1) -> str:
    """One graph's cache answer: "hit", "miss" or "unknown". `compile_s`: its record's compile
    time (None: not recorded); `new_neffs`: NEFFs added to the cache folder while it compiled
    (None: not looked at, or no cache folder); `held`: NEFFs the folder held before (None: not
    known); `persistent_hits`: how much TorchNeuron's PersistentHits counter grew meanwhile
    (None: its metrics are off); `uncertain`: how many graphs of the step have no compile time
    (0 or none), which that growth must cover. The module's docstring says why each counts."""
    if compiled_here(compile_s):
        return MISS
    if persistent_hits is not None:
        if persistent_hits >= max(1, uncertain):
            return HIT
        return MISS if compile_s is None and new_neffs else UNKNOWN
    if new_neffs is None:
        return UNKNOWN
    if new_neffs:
        return MISS if compile_s is None else UNKNOWN  # 0: another rank may have written the NEFF it found
    return HIT if held else UNKNOWN  # an empty folder had nothing to find


def cache_labels(compile_times: Sequence[float | None], new_neffs: int | None, held: int | None = None,
                 persistent_hits: int | None = None) -> list[str]:
    """cache_label of each graph of one step."""
    uncertain = sum(not compiled_here(seconds) for seconds in compile_times)
    return [cache_label(seconds, new_neffs, held, persistent_hits, uncertain) for seconds in compile_times]


def step_cache_label(compile_times: Sequence[float | None], new_neffs: int | None, held: int | None = None,
                     persistent_hits: int | None = None) -> str:
    """A whole step's answer (a precompile job's step: one batch shape): a miss if any of its
    graphs missed, a hit if all hit, else unknown; with no graph recorded, what the counter and
    the cache folder say."""
    labels = (cache_labels(compile_times, new_neffs, held, persistent_hits)
              or [cache_label(None, new_neffs, held, persistent_hits)])
    if MISS in labels:
        return MISS
    return HIT if all(label == HIT for label in labels) else UNKNOWN


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
        self.held: int | None = None  # NEFFs of the listing before the latest one still there at the latest
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
        self.held = len(now & self.known) if self.known is not None else None  # what a hit could have found
        self.known = now  # a clear in the meantime shrinks it: only additions count
        return added

    def steady_step(self, wall_s: float) -> None:
        """A step that compiled nothing: what later steps are compared with."""
        if self.steps > 1:  # an attempt's first step warms up
            self.steady.append(wall_s)
