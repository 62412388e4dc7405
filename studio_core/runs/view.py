"""A run as the page, the CLI and history see it: its folder's events folded into its state
(studio_core.rundir.events), kept current by reading the events added since, and corrected by
its backend when the run's processes are gone without a final status.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from studio_core import backends
from studio_core.rundir.checkpoints import RESUME_ENV, list_checkpoints
from studio_core.rundir import folder
from studio_core.runs import queue
from studio_core.rundir.events import ACTIVE_STATES, FINAL_STATES, STATES, EventReader, RunState
from studio_core.training.memory import gib
from studio_core.training.peak_memory import describe_allocator

__all__ = ["ACTIVE_STATES", "FINAL_STATES", "STATES", "RunView", "late_compile_text", "memory_text",
           "studio_cost_text"]

RECENT_STEPS = 20  # the ETA's window of step times


@dataclass
class RunView(RunState):
    """A run's state, rebuilt from its folder; `refresh` reads what its events added since."""

    dir: Path = field(default_factory=Path)
    spec: dict = field(default_factory=dict)  # spec.yaml as plain data ({} when it cannot be read)
    spec_problem: str | None = None  # why spec.yaml cannot be read (folder.spec_problem: "cannot be read (not UTF-8 ...)")
    first_event: dict | None = None  # the first event of events.jsonl as read: a whole file's is `status starting`
    _reader: EventReader | None = field(default=None, repr=False)
    _launch: dict | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # app threads share views

    @property
    def id(self) -> str:
        return self.dir.name

    def refresh(self) -> RunView:
        with self._lock:
            if self._reader is None:
                self._reader = EventReader(self.dir / folder.EVENTS)
                self.spec, self.spec_problem = folder.spec_problem(self.dir)
            for event in self._reader.read_new():
                if self.first_event is None:
                    self.first_event = event
                self.apply(event)
        return self

    def apply(self, event: dict) -> None:
        """RunState's fold of one event, but a run that ends while it waits in the queue (cancelled
        before it ever started) begins no attempt with that end: it has no start, no training time."""
        cancelled = (self.state == "queued" and not self.spans and event.get("type") == "status"
                     and event.get("state") in FINAL_STATES)
        super().apply(event)
        if cancelled:
            self.spans.clear()

    @property
    def backend(self) -> backends.RunBackend:
        """The backend that started the run (launch.json says; older runs ran here)."""
        try:
            return backends.get(self.launch().get("backend"))
        except KeyError:
            return backends.get(None)

    def launch(self) -> dict:
        """launch.json: argv, env, hardware, backend, cores, applied defaults, warnings. Read again
        only when a resume has rewritten it (it then adds a status event)."""
        if self._launch is None or self.state in ("queued", "starting"):  # re-planned when it starts
            self._launch = folder.read_launch(self.dir)
        return self._launch

    def events_lost(self) -> bool:
        """Whether events.jsonl lost what the studio wrote first (its `status starting`): deleted,
        or deleted and begun again by the run's processes, while its launch record says it started."""
        if not self.dir.joinpath(folder.LAUNCH).exists():
            return False  # no launch record: nothing says the run started
        reader = self._reader
        if reader is not None and reader.replaced:
            return True
        first = self.first_event
        return first is None or first.get("type") != "status" or first.get("state") not in ("starting", "queued")

    @property
    def live_state(self) -> str:
        """The state, corrected for a run whose processes ended without saying so."""
        if self.state in FINAL_STATES or self.state == "queued":  # a queued run has no process yet
            return self.state
        if self.backend.alive(self.dir):
            # its events lost the `status running` it wrote: its processes live, so it runs
            return "running" if self.state == "starting" and self.events_lost() and self.spans else self.state
        self.refresh()  # the supervisor may have written its final status just before it ended
        if self.state in FINAL_STATES:
            return self.state
        ending = self.backend.record_ending(self.dir, self.attempt_began)  # kept: the place may forget it
        return "starting" if ending is None else ending.state

    def other(self, run_id: str) -> RunView | None:
        """Another run of this runs folder, read now (None when it is not there)."""
        run_dir = self.dir.parent / run_id
        return RunView(dir=run_dir).refresh() if folder.is_run(run_dir) else None

    @property
    def active(self) -> bool:
        return self.live_state in ACTIVE_STATES

    def where(self, queue_order: list[str] | None = None) -> str | None:
        """Where the run executes, when not simply here: a Slurm job's id, and while it is
        active its state (PENDING and Slurm's reason, RUNNING on which nodes); a queued run's
        place and what it waits for (`queue_order`: the queue's run names, when a listing has them)."""
        if self.live_state == "queued":
            return queue.describe(self.dir, self.other, queue_order)
        return self.backend.where(self.dir, live=self.active)

    @property
    def error_text(self) -> str | None:
        if self.errors:
            return self.errors[-1].get("message")
        if self.reason and self.state in FINAL_STATES:
            return self.reason
        if self.state not in FINAL_STATES and self.live_state not in ACTIVE_STATES:
            ending = self.backend.ending(self.dir, self.attempt_began)
            return ending.reason if ending and ending.state != "finished" else None
        return None

    def eta_seconds(self) -> float | None:
        """Remaining time from the recent step times, compilation left out (None until two
        steps are seen): a compilation is a one-off, not a rate."""
        if not self.max_steps or len(self.progress_times) < 2 or self.live_state != "running":
            return None
        recent = self.steady_step_seconds[-RECENT_STEPS:]  # not a first step (it warms up), nor one that compiled
        if recent:
            return sum(recent) / len(recent) * (self.max_steps - self.step)
        (t0, s0), (t1, s1) = self.progress_times[0], self.progress_times[-1]
        if any(c.get("time", 0) > t0 for c in self.compiles):
            # every step since the first compiled (an eager Neuron run's first steps compile for
            # minutes): the wall time between them is compilation, no rate to go on yet
            return None
        if s1 <= s0:
            return None
        return (t1 - t0) / (s1 - s0) * (self.max_steps - s1)

    def version(self) -> tuple:
        """A value that changes whenever what the run shows can change: its state, the events
        read, its log's size (a page redraws an ended run only when this changes)."""
        try:
            log_size = os.stat(self.dir / folder.LOG).st_size
        except FileNotFoundError:
            log_size = 0
        return self.live_state, self._reader.offset if self._reader else 0, log_size

    def damage(self) -> list[str]:
        """What is wrong with the run's folder, each in a sentence (none for a sound one): the run
        still lists and opens; what cannot be read is left out."""
        found = [f"{folder.SPEC} {self.spec_problem}: its settings are unknown"] if self.spec_problem else []
        if not self.launch() and (self.dir / folder.LAUNCH).exists():
            found.append(f"{folder.LAUNCH} cannot be read: how it was launched is unknown")
        reader = self._reader
        if not (self.dir / folder.EVENTS).exists():
            found.append(f"{folder.EVENTS} is missing: the run's progress is unknown")
        elif self.events_lost():
            found.append(f"{folder.EVENTS} was deleted or replaced while the run was going: what it said before "
                         "is gone from it (its start time is the one its launch record and id give)")
        if reader is not None and reader.skipped:
            found.append(f"{reader.skipped} line(s) of {folder.EVENTS} are no event (not JSON, or without a type "
                         "or a time) and were left out")
        return found

    def saved_checkpoints(self) -> list[dict]:
        """The complete checkpoints on disk, oldest first: {step, path, size_bytes}."""
        return list_checkpoints(self.dir)

    def resume_point(self) -> dict | None:
        """The checkpoint a resume would go on from (the last one on disk), or None."""
        found = self.saved_checkpoints()
        return found[-1] if found else None

    # --- its times: the same before and after a resume, and after the app restarts ---------
    @property
    def first_start(self) -> float | None:
        """When the run was first started: its first attempt's first event (written as its folder was
        made, or as it left the queue), else, when its events lost their beginning, the time its
        folder was made (`made`); None for a run that never left the queue (queued, or cancelled
        there). A resume does not change it."""
        if self.spans and not self.events_lost():
            return self.spans[0].begin
        if self.never_started():
            return None
        return self.made() or (self.spans[0].begin if self.spans else None)

    def never_started(self) -> bool:
        """Whether the run began in the queue and has begun no attempt since (it waits, or was
        cancelled while it waited)."""
        first = self.first_event or {}
        return not self.spans and first.get("type") == "status" and first.get("state") == "queued"

    def made(self) -> float | None:
        """When the run's folder was made: its launch record's `created`, else the time its run id gives."""
        created = self.launch().get("created")
        if isinstance(created, (int, float)) and not isinstance(created, bool):
            return float(created)
        return run_id_time(self.id)

    def resumed_from(self) -> str | None:
        """The checkpoint folder the run's latest attempt loads (the launch record's resume
        setting), None for a run started afresh: what a resume message names."""
        return (self.launch().get("env") or {}).get(RESUME_ENV)

    @property
    def created(self) -> float:
        """first_start (the time its folder was made for a run that never left the queue), 0 when
        unknown: what listings sort by and backends measure a start's grace from."""
        return self.first_start or self.made() or 0.0

    @property
    def attempt_began(self) -> float:
        """When the latest attempt began (its resume, or the run's first start): what a backend
        measures a start's grace from, and tells this attempt's records from the last one's by."""
        return self.spans[-1].begin if self.spans and len(self.spans) > 1 else self.created

    def going(self) -> bool:
        """Whether an attempt goes on now (a queued resume's last attempt has ended: it waits)."""
        return bool(self.spans) and not self.spans[-1].ended and self.live_state in ACTIVE_STATES

    def training_seconds(self) -> float | None:
        """The time the run has been going: each attempt from its start to its end (the one going
        now up to now), the idle time between a stop and a resume left out. None without events."""
        if not self.spans:
            return None
        now = time.time() if self.going() else None
        return sum(span.seconds() for span in self.spans[:-1]) + self.spans[-1].seconds(now)

    def wall_seconds(self) -> float | None:
        """From the first start to the end of the last attempt (now while it goes), idle time included."""
        if not self.spans:
            return None
        end = time.time() if self.going() else self.spans[-1].end
        return max(0.0, end - min(self.first_start or self.spans[0].begin, self.spans[0].begin))

    def duration(self) -> float | None:
        """What the run page's status line shows: the training time (training_seconds)."""
        return self.training_seconds()

    def output_info(self) -> dict | None:
        """What the run saved (studio_core.rundir.folder.output_info), or None before it has."""
        return folder.output_info(self.dir)

    def size(self) -> int:
        return folder.run_size(self.dir)

    def log_tail(self) -> str:
        return folder.log_tail(self.dir)

    def spec_text(self) -> str:
        try:
            return (self.dir / folder.SPEC).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    @property
    def trainer(self) -> str:
        return str((self.spec.get("studio") or {}).get("trainer", ""))

    @property
    def model(self) -> str:
        return str(self.spec.get("model_name_or_path", ""))

    @property
    def dataset(self) -> str:
        return str(self.spec.get("dataset_name", ""))

    @property
    def short_model(self) -> str:
        return short_source(self.model)

    @property
    def short_dataset(self) -> str:
        return short_source(self.dataset)


def short_source(name: str) -> str:
    """A model or dataset as a listing shows it: a local path by its last part, a Hub id
    (owner/name) and a built-in (builtin:qa) as they are."""
    if name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:
        return Path(name.rstrip("/")).name or name
    return name


def format_seconds(seconds: float) -> str:
    """A duration as listings show it: h:mm:ss, or m:ss under an hour."""
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def format_time(timestamp: float | None) -> str:
    """A moment as listings show it (local time), "" when unknown."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp)) if timestamp else ""


def format_loss(value: float | None) -> str:
    """A loss as every page, table and the CLI show it: 4 significant digits (as `launch.py train`
    prints metrics), a zero (GRPO's -0.0 too) as 0; "" for none."""
    if value is None:
        return ""
    text = f"{value:.4g}"
    return "0" if float(text) == 0 else text


def run_id_time(run_id: str) -> float | None:
    """The local time a run id begins with (folder.new_run_id: `20260101-120000-<name>-<hex>`),
    or None for a name that does not."""
    try:
        return time.mktime(time.strptime(run_id[:15], "%Y%m%d-%H%M%S"))
    except (ValueError, OverflowError):
        return None


def late_compile_text(late: dict) -> str:
    """One line for a step that compiled after the warm-up (see RunView.late_compiles)."""
    shape_text = f", new batch shape {'x'.join(map(str, late['shape']))}" if late["shape"] else ""
    return (f"step {late['step']} compiled {late['graphs']} graph(s) in {late['seconds']:.1f} s after the "
            f"warm-up{shape_text}: {late['reason'] or 'no reason logged'}. Something is producing new shapes: pad "
            "to a fixed multiple (pad_to_multiple_of) or pack (packing); the shape forecast shows their effect")


def compiling_text(graph: str | None, phase: str | None, number: int) -> str:
    """A compilation in progress, its Dynamo id ("4/2": code frame 4, its compilation 2 counted
    from 0, one per new input shape) spelled out, so it does not read as "4 of 2"."""
    frame, _, again = str(graph).partition("/")
    which = (f"code frame {frame}, its compilation {int(again) + 1}" if frame.isdigit() and again.isdigit()
             else f"graph {graph}")
    return f"Compiling now: compilation {number} of this run, the {phase} pass of {which} (Dynamo's id {graph})"


def compile_totals_text(view: RunView) -> str:
    """How many compilations, of what, in how much time and which share of the run's: each
    forward and backward pass of each code frame (the pieces between graph breaks) compiles
    once per new batch shape, so the count is not the forecast's count of shapes."""
    seconds, wall, going = view.compile_seconds(), view.duration() or 0, view.active
    done = [c.get("phase") for c in view.compiles]
    phases = ", ".join(f"{done.count(p)} {p}" for p in dict.fromkeys(done))
    # Dynamo's own compilations only: a Neuron graph's NEFF ("neff") and an eager step ("eager") are no code frame
    frames = {str(c.get("graph")).partition("/")[0] for c in view.compiles if c.get("phase") in ("forward", "backward")}
    share = f" ({seconds / wall:.0%} of the run's time{' so far' if going else ''})" if wall > 0 else ""
    frames_text = f"; {len(frames)} code frame(s)" if frames else ""
    answers = cache_answers_text(view.compiles)
    return (f"{len(view.compiles)} compilation(s)" + (f" ({phases}{frames_text})" if done else "")
            + f" in {short_seconds(seconds)}{share}; {len(view.shapes)} batch shape(s) reached the model (a new "
            "one compiles again the frames it changes)" + (f"; {answers}" if answers else ""))


CACHE_ANSWERS = {"hit": "found in the compile cache", "miss": "compiled",
                 "unknown": "unknown (nothing proves a cache hit or a compile)"}


def cache_answers_text(compiles: list[dict]) -> str:
    """How the compile cache answered the compilations that carry an answer ("2 found in the compile
    cache, 1 compiled, 1 unknown (...)"), "" when none does. "unknown" is said as such: on Neuron a
    graph recorded at 0 ms is a cache hit only with evidence (studio_core/training/neff_watch.py);
    an old run's events hold "hit" and "miss" only and read as before."""
    answers = [c.get("cache") for c in compiles if c.get("cache") in CACHE_ANSWERS]
    return ", ".join(f"{answers.count(answer)} {text}" for answer, text in CACHE_ANSWERS.items()
                     if answer in answers)


def short_seconds(seconds: float) -> str:
    """A short time as the compile panel shows it: 12.3 s, or 1:05 past a minute."""
    return f"{seconds:.1f} s" if seconds < 60 else format_seconds(seconds)


def memory_text(view: RunView) -> str | None:
    """The run's device memory per core: the plan's estimate (launch.json) and, once training
    ended, rank 0's measured peak (its peak_memory event): "memory per core: estimated 1.16 GiB
    before launch, measured 0.98 GiB at its peak (the estimate is 1.18 x the measurement)"; on
    Neuron, then what TorchNeuron's allocator says of the core (its `allocator`)."""
    estimated = (view.launch().get("memory") or {}).get("bytes")
    peak = view.peak_memory or {}
    parts = [f"estimated {gib(estimated)} before launch"] if estimated else []
    if peak.get("bytes"):
        parts.append(f"measured {gib(peak['bytes'])} at its peak ({peak.get('measured')})")
        if estimated:
            parts.append(f"the estimate is {estimated / peak['bytes']:.2f} x the measurement")
    elif peak:
        parts.append(f"not measured: {peak.get('measured')}")
    allocator = describe_allocator(peak.get("allocator"))  # on Neuron, beside the peak
    parts += [allocator] if allocator else []
    return "memory per core: " + "; ".join(parts) if parts else None


def studio_cost_text(cost: dict | None) -> str | None:
    """The run summary's line for a `studio_cost` event (RunState.studio_cost), None without one:
    "the studio's own cost: 0.052 ms per step (CPU 0.041 ms: step end 0.030, log 0.001, shape hook
    0.006, stop check 0.004; 300 steps)"."""
    if not cost or not cost.get("steps"):
        return None
    parts = ", ".join(f"{name.replace('_', ' ')} {part.get('cpu_seconds', 0.0) / cost['steps'] * 1000:.3f}"
                      for name, part in (cost.get("parts") or {}).items())
    return (f"the studio's own cost: {cost['per_step_ms']:.3f} ms per step (CPU "
            f"{cost.get('cpu_per_step_ms', 0.0):.3f} ms: {parts}; {cost['steps']} steps)")
