"""A run as the page, the CLI and history see it: its folder's events folded into its state
(studio_core.runs.events), kept current by reading the events added since, and corrected by
its backend when the run's processes are gone without a final status.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from studio_core import backends
from studio_core.checkpoints import list_checkpoints
from studio_core.runs import folder
from studio_core.runs.events import ACTIVE_STATES, FINAL_STATES, STATES, EventReader, RunState

__all__ = ["ACTIVE_STATES", "FINAL_STATES", "STATES", "RunView", "late_compile_text", "studio_cost_text"]

RECENT_STEPS = 20  # the ETA's window of step times


@dataclass
class RunView(RunState):
    """A run's state, rebuilt from its folder; `refresh` reads what its events added since."""

    dir: Path = field(default_factory=Path)
    spec: dict = field(default_factory=dict)  # spec.yaml as plain data ({} when it cannot be read)
    spec_problem: str | None = None  # why spec.yaml cannot be read
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
                spec_file = self.dir / folder.SPEC
                self.spec, self.spec_problem = _read_spec(spec_file)
            for event in self._reader.read_new():
                self.apply(event)
        return self

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
        if self._launch is None or self.state == "starting":
            self._launch = folder.read_launch(self.dir)
        return self._launch

    @property
    def live_state(self) -> str:
        """The state, corrected for a run whose processes ended without saying so."""
        if self.state in FINAL_STATES or self.backend.alive(self.dir):
            return self.state
        self.refresh()  # the supervisor may have written its final status just before it ended
        if self.state in FINAL_STATES:
            return self.state
        ending = self.backend.ending(self.dir, self.created)
        return "starting" if ending is None else ending.state

    @property
    def active(self) -> bool:
        return self.live_state in ACTIVE_STATES

    def where(self) -> str | None:
        """Where the run executes, when not simply here: a Slurm job's id, and while it is
        active its state (PENDING and Slurm's reason, RUNNING on which nodes)."""
        return self.backend.where(self.dir, live=self.active)

    @property
    def error_text(self) -> str | None:
        if self.errors:
            return self.errors[-1].get("message")
        if self.reason and self.state in FINAL_STATES:
            return self.reason
        if self.state not in FINAL_STATES and self.live_state not in ACTIVE_STATES:
            ending = self.backend.ending(self.dir, self.created)
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
        if reader is not None and reader.replaced:
            found.append(f"{folder.EVENTS} was deleted or replaced while the run was going: what it said before "
                         "is gone from it")
        elif not (self.dir / folder.EVENTS).exists():
            found.append(f"{folder.EVENTS} is missing: the run's progress is unknown")
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
        """When the run was first started: its first event (written as its folder was made), else
        the time in its run id; None when neither is there. A resume does not change it."""
        return self.spans[0].begin if self.spans else run_id_time(self.id)

    @property
    def created(self) -> float:
        """first_start, 0 when unknown: what listings sort by and backends measure a start's grace from."""
        return self.first_start or 0.0

    def training_seconds(self) -> float | None:
        """The time the run has been going: each attempt from its start to its end (the one going
        now up to now), the idle time between a stop and a resume left out. None without events."""
        if not self.spans:
            return None
        now = time.time() if self.live_state in ACTIVE_STATES else None
        return sum(span.seconds() for span in self.spans[:-1]) + self.spans[-1].seconds(now)

    def wall_seconds(self) -> float | None:
        """From the first start to the end of the last attempt (now while it goes), idle time included."""
        if not self.spans:
            return None
        end = time.time() if self.live_state in ACTIVE_STATES else self.spans[-1].end
        return max(0.0, end - self.spans[0].begin)

    def duration(self) -> float | None:
        """What the run page's status line shows: the training time (training_seconds)."""
        return self.training_seconds()

    def output_info(self) -> dict | None:
        """What the run saved (studio_core.runs.folder.output_info), or None before it has."""
        return folder.output_info(self.dir)

    def size(self) -> int:
        return folder.run_size(self.dir)

    def log_tail(self) -> str:
        return folder.log_tail(self.dir)

    def spec_text(self) -> str:
        try:
            return (self.dir / folder.SPEC).read_text()
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


def run_id_time(run_id: str) -> float | None:
    """The local time a run id begins with (folder.new_run_id: `20260101-120000-<name>-<hex>`),
    or None for a name that does not."""
    try:
        return time.mktime(time.strptime(run_id[:15], "%Y%m%d-%H%M%S"))
    except (ValueError, OverflowError):
        return None


def _read_spec(path: Path) -> tuple[dict, str | None]:
    """spec.yaml as plain data, and what is wrong with it ({} and the problem when it cannot be read)."""
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        return {}, None  # a run folder being deleted
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        return {}, f"cannot be read ({_first_line(error)})"
    return (data, None) if isinstance(data, dict) else ({}, "holds no recipe (a mapping of settings)")


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def late_compile_text(late: dict) -> str:
    """One line for a step that compiled after the warm-up (see RunView.late_compiles)."""
    shape_text = f", new batch shape {'x'.join(map(str, late['shape']))}" if late["shape"] else ""
    return (f"step {late['step']} compiled {late['graphs']} graph(s) in {late['seconds']:.1f} s after the "
            f"warm-up{shape_text}: {late['reason'] or 'no reason logged'}. Something is producing new shapes: pad "
            "to a fixed multiple (pad_to_multiple_of) or pack (packing); the shape forecast shows their effect")


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
