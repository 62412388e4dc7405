"""A run's event stream: one JSON object per line in `<run>/events.jsonl`, and what it adds up to.

Every event has `type` and `time` (Unix seconds). Each type has one constructor here, which
names its fields; writers call `append(path, status("running", ...))`, never write JSON of
their own. Readers skip lines they cannot use (a torn last line, a type they do not know,
an event without a time), so the format can grow.

Who writes what:
    manager      status queued (cores busy: runs/queue.py) and starting, log (plan warnings, stop
                 and save), resume; status stopped for a run cancelled while queued
    backend      log (a Slurm job id), error and status failed / stopped (a Slurm job that ended
                 without a final status: Slurm's reason)
    supervisor   log, hardware (every 2 s; per node on Slurm), error, status finished / failed / stopped,
                 precompile_end
    precompile jobs (before torchrun)  precompile_start, precompiled
    worker       status running, progress, metrics, checkpoint, saved_stop, error, log, studio_cost,
                 peak_memory
    compile_watch (in the worker)  compile_start, compile_end, compile_metrics, shape
    downloads (in the worker)      download, log

`RunState.apply` folds events into a run's state, one at a time (so a reader can follow a
live run); `fold` does it for a whole list. The run page, the CLI, history, comparison and the
model card all read a run through this fold, so a run resumed from a checkpoint looks the
same everywhere: what came after the checkpoint it went on from is dropped.

Writers append whole lines with a single write (O_APPEND), so a reader never sees half an
event except at the very end of the file, which `EventReader` leaves for its next read.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

STATES = ("queued", "starting", "running", "finished", "failed", "stopped")
FINAL_STATES = ("finished", "failed", "stopped")
ACTIVE_STATES = ("queued", "starting", "running")  # queued: waiting for its cores (runs/queue.py)
WARMUP_STEPS = 2  # compilations in these first steps are expected; later ones get a warning


def _event(type_: str, **fields) -> dict:
    """An event: its type, the time now, and the fields given (None-valued ones left out)."""
    return {"type": type_, "time": time.time(), **{k: v for k, v in fields.items() if v is not None}}


# --- the event types ----------------------------------------------------------------------
def status(state: str, exit_code: int | None = None, world_size: int | None = None,
           max_steps: int | None = None, num_train_epochs: float | None = None, reason: str | None = None) -> dict:
    """The run's state changed. `state`: one of STATES. `exit_code`: torchrun's, when it ended.
    When training begins (running): `world_size` (processes), `max_steps`, `num_train_epochs`.
    `reason`: why it ended, when the run itself could not say (Slurm ended the job; a full disk
    that kept the ranks from writing their error). A stop the user asked for is "stopped" with
    exit code 0 (torchrun's own code after SIGTERM goes to a log event), unless it was killed."""
    return _event("status", state=state, exit_code=exit_code, world_size=world_size, max_steps=max_steps,
                  num_train_epochs=num_train_epochs, reason=reason)


def progress(step: int, max_steps: int, epoch: float | None, step_s: float, compile_s: float,
             tokens: int, compiled: bool = False) -> dict:
    """An optimizer step ended (rank 0, every step). `step_s`: the step's wall time less the
    compile time in it; `compile_s`: compile seconds so far in this attempt; `tokens`: the
    real (unpadded) tokens TRL counted in the step for its `num_tokens` metric, summed over all
    data-parallel ranks (GRPO and RLOO: prompt and completion tokens, counted in the step that
    generated them); `compiled`: something compiled in this step (its time is left out of
    step_s, but such a step is no sample of the steady rate)."""
    return _event("progress", step=step, max_steps=max_steps, epoch=epoch, step_s=step_s, compile_s=compile_s,
                  tokens=tokens, compiled=compiled)


def metrics(step: int, epoch: float | None, logs: dict) -> dict:
    """What the trainer logged at `step` (TRL's names: loss, learning_rate, grad_norm, its own
    rewards and margins, and train_* totals at the end)."""
    return {**_event("metrics", step=step, epoch=epoch), **logs}


def log(message: str) -> dict:
    """A line for people: what the studio did or saw."""
    return _event("log", message=message)


def error(message: str, traceback: str | None = None, rank: int | None = None,
          problems: list[str] | None = None) -> dict:
    """What made the run fail. `problems`: the what-to-change lines when the dataset's first rows
    failed the checks (then there is no traceback); `rank`: the process that raised."""
    return _event("error", message=message, traceback=traceback, rank=rank, problems=problems)


def compile_start(graph: str, phase: str, step: int, reason: str | None = None) -> dict:
    """A compilation began. `graph`: Dynamo's id ("0/1": frame 0, its second compilation);
    `phase`: forward or backward; `reason`: Dynamo's, for a recompilation. On Neuron also phase
    "eager", graph "eager/<step>": a step that compiled ops outside any graph, found at its end
    and written then with the step's start as its time (compile_watch.CompileWatch.step_ended)."""
    return _event("compile_start", graph=graph, phase=phase, step=step, reason=reason)


def compile_end(graph: str, phase: str, step: int, seconds: float, cache: str | None = None,
                graphs: int | None = None) -> dict:
    """That compilation ended after `seconds`; `cache`: "hit", "miss" or "unknown" (nothing proves
    either: on Neuron a record of 0 ms with no persistent-cache evidence), from Inductor's FX graph
    cache, on Neuron from TorchNeuron's record, counter and NEFF cache (studio_core/training/neff_watch.py);
    absent: no cache was asked (and in runs from before "unknown" was written); `graphs`: how many
    it compiled when more than one (phase "eager": the NEFFs a step added; absent: one)."""
    return _event("compile_end", graph=graph, phase=phase, step=step, seconds=seconds, cache=cache, graphs=graphs)


def compile_metrics(backend: str, records) -> dict:
    """The compiler backend's own records at the end of training (Neuron's per-graph metrics)."""
    return _event("compile_metrics", backend=backend, records=records)


def shape(shape: list[int], step: int) -> dict:
    """A batch shape reached the model for the first time, at `step`."""
    return _event("shape", shape=list(shape), step=step)


def checkpoint(step: int, folder: str, size_bytes: int) -> dict:
    """A checkpoint was saved at `step` in `folder`."""
    return _event("checkpoint", step=step, folder=folder, size_bytes=size_bytes)


def saved_stop(step: int) -> dict:
    """A "stop and save" request was carried out: the run saved at `step` and stopped."""
    return _event("saved_stop", step=step)


def resume(step: int, checkpoint: str) -> dict:
    """A new attempt begins from the checkpoint at `step`: what came after it is dropped."""
    return _event("resume", step=step, checkpoint=checkpoint)


def download(done_bytes: int, total_bytes: int, model: str | None = None, dataset: str | None = None) -> dict:
    """The run's own download from the Hub (a model's first use, a dataset's split), so far."""
    return _event("download", model=model, dataset=dataset, done_bytes=done_bytes, total_bytes=total_bytes)


def hardware(sample: dict) -> dict:
    """A sample of the run's processes (studio_core.machine.monitor): `cpu_percent` (100 = one core),
    `rss_bytes`, `processes`; `neuron` (per-core utilization and memory_bytes),
    `cuda_mem_bytes` when available; `sources` (monitored, unavailable) first and on change."""
    return {**_event("hardware"), **sample}


def peak_memory(bytes_: int | None, measured: str, device: str, allocator: dict | None = None) -> dict:
    """The most memory rank 0 used while it trained (studio_core/training/peak_memory.py): `bytes`
    (None when the device does not report it), `measured`: how, or why not; `device`; on Neuron
    `allocator`: TorchNeuron's allocator statistics (bytes now and at the peak, OOM counts) or why not."""
    return _event("peak_memory", bytes=bytes_, measured=measured, device=device, allocator=allocator)


def studio_cost(steps: int, parts: dict[str, dict], step_cpu_ms: float | None = None) -> dict:
    """The studio's own time in the training process, at the end of training (rank 0): the time
    around everything it runs per step. `parts`: {name: {seconds, cpu_seconds, calls}}:
    `step_end` (the progress event, CompileWatch.step_ended, TRL's token count), `log` (the
    metrics event), `shape_hook` (the forward pre-hook: every forward, evaluation's too),
    `stop_check` (the stop-and-save check; rank 0's: every other rank makes the same check);
    `seconds` is wall time (perf_counter: what the steps felt, other processes' turns on the core
    included), `cpu_seconds` this thread's CPU time (thread_time: the studio's work alone).
    `steps`: this attempt's optimizer steps; `seconds`, `cpu_seconds`: the sums; `per_step_ms`,
    `cpu_per_step_ms`: per step; `step_cpu_ms`: the training thread's whole CPU time per step
    (steps 2 to the last), which the studio's share is a part of."""
    seconds = sum(part["seconds"] for part in parts.values())
    cpu = sum(part.get("cpu_seconds", 0.0) for part in parts.values())
    return _event("studio_cost", steps=steps, seconds=round(seconds, 6), cpu_seconds=round(cpu, 6),
                  per_step_ms=round(seconds / steps * 1000, 5) if steps else None,
                  cpu_per_step_ms=round(cpu / steps * 1000, 5) if steps else None,
                  step_cpu_ms=None if step_cpu_ms is None else round(step_cpu_ms, 4), parts=parts)


def precompile_start(shapes: list[list[int]], jobs: int) -> dict:
    """Precompile began (studio_core/training/precompile.py; written by its first job): the distinct batch
    `shapes` the run will take, compiled before step 1 by `jobs` parallel processes."""
    return _event("precompile_start", shapes=shapes, jobs=jobs)


def precompiled(shape: list[int], job: int, seconds: float, cache: str | None = None) -> dict:
    """A precompile job trained one step on a batch of `shape`: `seconds` (its compilation and the
    step), `cache`: "hit", "miss" or "unknown" (nothing proves either), from Inductor's FX graph cache on
    CPU and CUDA (absent: it was not asked), from TorchNeuron's records, counter and NEFF cache on
    Neuron (compile_watch.StepCache)."""
    return _event("precompiled", shape=shape, job=job, seconds=seconds, cache=cache)


def precompile_end(seconds: float, failed: list[int] | None = None) -> dict:
    """Every precompile job has ended (the supervisor), `seconds` after they started; `failed`:
    the jobs that did not end well (their shapes compile at their first step instead)."""
    return _event("precompile_end", seconds=seconds, failed=failed or None)


TYPES = ("status", "progress", "metrics", "log", "error", "compile_start", "compile_end", "compile_metrics",
         "shape", "checkpoint", "saved_stop", "resume", "download", "hardware", "studio_cost",
         "peak_memory", "precompile_start", "precompiled", "precompile_end")


# --- writing and reading ------------------------------------------------------------------
def append(path: str | Path, event: dict) -> dict:
    """Add one event at the end of the file, in one write."""
    append_all(path, [event])
    return event


def append_all(path: str | Path, events: list[dict]) -> None:
    """Add these events at the end of the file, in order, in one write (whole lines)."""
    data = "".join(json.dumps(event, default=str) + "\n" for event in events).encode()
    # O_APPEND makes each write land whole at the end, even with several writers.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


class EventReader:
    """Reads the events added since the last call, from a remembered byte offset.

    A file deleted while being read is no ending: nothing is read until one is there again.
    A new file in its place (deleted, then appended to) is read from its start, and
    `replaced` says so: it is told apart by its first line (its first event, with its time),
    since a new file may get the old one's inode number. `skipped` counts the complete lines
    that were no usable event."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.offset = 0
        self.head = b""  # the file's first line, as read
        self.replaced = False
        self.skipped = 0

    def read_new(self) -> list[dict]:
        try:
            size = os.stat(self.path).st_size
            if size == self.offset:
                return []  # nothing new: a stat instead of an open and a read
            with self.path.open("rb") as handle:
                if self.offset and (size < self.offset or handle.read(len(self.head)) != self.head):
                    self.offset, self.replaced = 0, True
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        if not self.offset:
            self.head = data[:data.find(b"\n") + 1]
        end = data.rfind(b"\n") + 1  # keep a trailing partial line for next time
        self.offset += end
        events = []
        for line in data[:end].splitlines():
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                self.skipped += 1  # e.g. a line torn by a crash mid-write: nothing to recover from it
                continue
            if usable(event):
                events.append(event)
            else:
                self.skipped += 1
        return events


def last_state(path: str | Path) -> str | None:
    """The state the run's events end in, as `fold(read(path)).state` has it once they hold a
    status, found from the file's end: a check that a run is queued or has ended does not fold
    every event of a long run. None without a status event."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    for line in reversed(data[:data.rfind(b"\n") + 1].splitlines()):  # a trailing partial line: not yet an event
        if b'"status"' not in line:
            continue
        try:
            event = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if usable(event) and event["type"] == "status" and "state" in event:
            return event["state"]
    return None


def usable(event) -> bool:
    """An event a reader can fold: a JSON object with a text `type` and a numeric `time`."""
    return (isinstance(event, dict) and isinstance(event.get("type"), str)
            and isinstance(event.get("time"), (int, float)) and not isinstance(event.get("time"), bool))


def read(path: str | Path) -> list[dict]:
    """Every usable event in the file."""
    return EventReader(path).read_new()


# --- the fold -----------------------------------------------------------------------------
@dataclass
class Attempt:
    """One attempt of a run (the first, or one after a resume): from its first event to its
    final status, else to its latest event (a run whose processes died without a word)."""

    begin: float
    end: float
    ended: bool = False  # a final status closed it

    def seconds(self, until: float | None = None) -> float:
        """Its length; `until` (now) for the attempt still going."""
        end = self.end if until is None else max(self.end, until)
        return max(0.0, end - self.begin)


@dataclass
class RunState:
    """What a run's events add up to. `apply` takes one event at a time."""

    state: str = "starting"
    exit_code: int | None = None
    reason: str | None = None  # why it ended, when Slurm ended it
    started: float | None = None  # first step began
    ended: float | None = None
    world_size: int | None = None
    step: int = 0
    max_steps: int | None = None
    epoch: float | None = None
    metrics: list[dict] = field(default_factory=list)  # of the attempts that led here (resume drops the rest)
    errors: list[dict] = field(default_factory=list)
    progress_times: list[tuple[float, int]] = field(default_factory=list)  # (time, step) of this attempt
    step_seconds: list[float] = field(default_factory=list)  # each step's time, compilation left out
    steady_step_seconds: list[float] = field(default_factory=list)  # of steps that compiled nothing, no first one
    tokens: int = 0  # real (unpadded) tokens trained on, all data-parallel ranks (TRL's count)
    compiles: list[dict] = field(default_factory=list)  # compile_end events, with their start's time and reason
    compiling: dict[tuple, dict] = field(default_factory=dict)  # compile_start events not ended yet
    shapes: list[dict] = field(default_factory=list)  # shape events: batch shapes as they first came
    checkpoints: list[dict] = field(default_factory=list)  # checkpoint events
    hardware: list[dict] = field(default_factory=list)  # hardware samples
    download: dict | None = None  # the latest download event
    studio_cost: dict | None = None  # this attempt's studio_cost event, once its training ended
    peak_memory: dict | None = None  # this attempt's peak_memory event, once its training ended
    attempts: int = 1  # 1 + the resumes
    spans: list[Attempt] = field(default_factory=list)  # each attempt's times, the first run's included
    precompile: dict | None = None  # {jobs, total, done: [precompiled events], seconds, failed} (precompile.py)

    def apply(self, event: dict) -> None:
        kind, when = event["type"], event["time"]
        # a queued run has begun no attempt: the time it waits for its cores is no part of the run
        # (a queued resume's attempt begins with its resume event, when it leaves the queue)
        waiting = event.get("state") == "queued" if kind == "status" else self.state == "queued" and kind != "resume"
        if not waiting and (kind == "resume" or not self.spans):
            self.spans.append(Attempt(when, when))
        elif not waiting and not self.spans[-1].ended:
            self.spans[-1].end = max(self.spans[-1].end, when)
        if kind == "status":
            # a queued resume called off (runs/queue.py cancel) ends nothing new: the run ended before
            called_off = self.state == "queued" and self.spans and self.spans[-1].ended
            self.state = event.get("state", self.state)
            self.exit_code = event.get("exit_code", self.exit_code)
            self.world_size = event.get("world_size", self.world_size)
            self.max_steps = event.get("max_steps", self.max_steps)
            self.reason = event.get("reason")
            if self.state == "running" and self.started is None:
                self.started = when
            if self.state in FINAL_STATES and not called_off:
                self.ended = when
                self.spans[-1].ended = True
        elif kind == "progress":
            self.step = event.get("step", self.step)
            self.max_steps = event.get("max_steps", self.max_steps)
            self.epoch = event.get("epoch", self.epoch)
            self.progress_times.append((when, self.step))
            if "step_s" in event:
                self.step_seconds.append(event["step_s"])
                self.tokens += event.get("tokens", 0)
                if len(self.progress_times) > 1 and not event.get("compiled"):  # an attempt's first step warms up
                    self.steady_step_seconds.append(event["step_s"])
        elif kind == "metrics":
            self.metrics.append(event)
        elif kind == "compile_start":
            self.compiling[(event.get("graph"), event.get("phase"))] = event
        elif kind == "compile_end":
            start = self.compiling.pop((event.get("graph"), event.get("phase")), {})
            seconds = event.get("seconds", 0.0)
            self.compiles.append({**event, "seconds": seconds, "started": start.get("time", when - seconds),
                                  "reason": start.get("reason")})
        elif kind == "shape":
            self.shapes.append(event)
        elif kind == "checkpoint":
            self.checkpoints.append(event)
        elif kind == "resume":  # a new attempt from a checkpoint: what came after it is replaced
            step = event.get("step", 0)
            self.metrics = [m for m in self.metrics if m.get("step", 0) <= step]
            self.step, self.progress_times, self.ended, self.exit_code, self.reason = step, [], None, None, None
            self.compiling, self.studio_cost, self.peak_memory = {}, None, None
            self.attempts += 1
        elif kind == "hardware":
            self.hardware.append(event)
        elif kind == "download":
            self.download = event
        elif kind == "studio_cost":
            self.studio_cost = event
        elif kind == "peak_memory":
            self.peak_memory = event
        elif kind == "error":
            self.errors.append(event)
        elif kind in ("precompile_start", "precompiled", "precompile_end"):
            self._precompile(kind, event)

    def _precompile(self, kind: str, event: dict) -> None:
        state = self.precompile = self.precompile or {"jobs": None, "total": None, "done": [], "seconds": None,
                                                      "failed": []}
        if kind == "precompile_start":
            state["jobs"], state["total"] = event.get("jobs"), len(event.get("shapes", []))
        elif kind == "precompiled":
            state["done"].append(event)
        else:
            state["seconds"], state["failed"] = event.get("seconds", 0.0), event.get("failed", [])
            state["total"] = state["total"] if state["total"] is not None else len(state["done"])

    # --- what the page, the CLI and the card show -----------------------------------------
    def losses(self) -> list[tuple[int, float]]:
        """(step, training loss) of the path that led to the model, in order."""
        return [(m["step"], m["loss"]) for m in self.metrics if isinstance(m.get("loss"), (int, float))
                and "step" in m]

    def last_loss(self) -> float | None:
        losses = self.losses()
        return losses[-1][1] if losses else None

    def final_metrics(self) -> dict:
        """The trainer's totals at the end (train_runtime, train_loss, ...) and the last epoch."""
        return {k: v for m in self.metrics for k, v in m.items() if k.startswith("train_") or k == "epoch"}

    def training_time_at(self, when: float) -> float:
        """Seconds of training time (the attempts' lengths, the idle gaps between them left out)
        at the moment `when`; a moment in a gap counts as the end of the attempt before it."""
        total = 0.0
        for span in self.spans:
            if when < span.begin:
                break
            total += min(when, span.end) - span.begin
        return total

    def compile_seconds(self) -> float:
        """Time spent compiling so far, the compilations still running included."""
        ongoing = sum(time.time() - e["time"] for e in self.compiling.values()) if self.ended is None else 0
        return sum(c["seconds"] for c in self.compiles) + ongoing

    def tokens_per_second(self) -> float | None:
        """Training throughput in real tokens per second of step time (compilation left out)."""
        seconds = sum(self.step_seconds)
        return self.tokens / seconds if seconds > 0 and self.tokens else None

    def late_compiles(self) -> list[dict]:
        """Steps after the warm-up that compiled (something is producing new shapes), one entry
        per step: {step, graphs, seconds, reason (Dynamo's first), shape (if a new one came)}."""
        steps: dict[int, dict] = {}
        for c in self.compiles:
            if c.get("step", 0) <= WARMUP_STEPS:
                continue
            entry = steps.setdefault(c["step"], {"step": c["step"], "graphs": 0, "seconds": 0.0, "reason": None,
                                                 "shape": None})
            entry["graphs"] += c.get("graphs", 1)
            entry["seconds"] += c["seconds"]
            entry["reason"] = entry["reason"] or (c.get("reason") or "").split("; ")[0] or None
        for event in self.shapes:
            if event.get("step") in steps:
                steps[event["step"]]["shape"] = event.get("shape")
        return list(steps.values())


def fold(events: list[dict]) -> RunState:
    """The state these events add up to."""
    state = RunState()
    for event in events:
        state.apply(event)
    return state
