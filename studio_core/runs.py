"""The run manager: creates run folders, starts their supervisors, stops and lists runs.

The run folder is the source of truth; nothing about a run lives only in this process:
    spec.yaml        the resolved spec (recipe + applied defaults)
    launch.json      the exact argv and the environment the studio added (no secrets)
    supervisor.json  pid and start time of the run's supervisor process
    events.jsonl     the event stream (see events.py)
    train.log        the raw output of torchrun and every rank
    output/          the saved model
So a web app that restarts, a second browser, or the CLI all see the same runs.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil

from studio_core import leases, sources
from studio_core.checkpoints import RESUME_ENV, clear_control, list_checkpoints, request_save_and_stop
from studio_core.events import FINAL_STATES, EventReader, append_event
from studio_core.hardware import Hardware
from studio_core.layout import format_cores, parse_cores
from studio_core.plan import Plan, plan
from studio_core.procs import kill_run_processes
from studio_core.spec import RunSpec, SpecError, validated, with_absolute_paths
from studio_core.compile_cache import compile_cache_root

DEFAULT_RUNS_DIR = "~/trn-studio/runs"
STARTING_GRACE_S = 30  # how long a folder may exist before its supervisor.json does
RECENT_STEPS = 20  # the ETA's window of step times
WARMUP_STEPS = 2  # compilations in these first steps are expected; later ones get a warning


def default_runs_dir() -> Path:
    return Path(os.environ.get("STUDIO_RUNS_DIR", DEFAULT_RUNS_DIR)).expanduser()


@dataclass
class RunView:
    """A run's state, rebuilt from its folder and kept current by reading new events."""

    dir: Path
    state: str = "starting"
    exit_code: int | None = None
    created: float = 0.0
    started: float | None = None  # first step began
    ended: float | None = None
    world_size: int | None = None
    step: int = 0
    max_steps: int | None = None
    epoch: float | None = None
    metrics: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    progress_times: list[tuple[float, int]] = field(default_factory=list)  # (time, step)
    step_seconds: list[float] = field(default_factory=list)  # each step's time, compilation left out
    tokens: int = 0  # real (unpadded) tokens trained on
    compiles: list[dict] = field(default_factory=list)  # compile_end events, with their start's reason
    compiling: dict[tuple, dict] = field(default_factory=dict)  # compile_start events not ended yet
    shapes: list[dict] = field(default_factory=list)  # shape events: batch shapes as they first came
    checkpoints: list[dict] = field(default_factory=list)  # checkpoint events: {step, folder, size_bytes}
    hardware: list[dict] = field(default_factory=list)  # hardware events: samples of the run's processes
    download: dict | None = None  # the latest download event: a Hub model's (`model`) or dataset's (`dataset`)
    spec: dict = field(default_factory=dict)
    _reader: EventReader | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # app threads share views

    @property
    def id(self) -> str:
        return self.dir.name

    def refresh(self) -> RunView:
        with self._lock:
            if self._reader is None:
                self._reader = EventReader(self.dir / "events.jsonl")
                self.spec = _read_yaml(self.dir / "spec.yaml")
                spec_file = self.dir / "spec.yaml"
                self.created = spec_file.stat().st_mtime if spec_file.exists() else 0
            for event in self._reader.read_new():
                self._apply(event)
        return self

    def _apply(self, event: dict) -> None:
        kind = event["type"]
        if kind == "status":
            self.state = event.get("state", self.state)
            self.exit_code = event.get("exit_code", self.exit_code)
            self.world_size = event.get("world_size", self.world_size)
            self.max_steps = event.get("max_steps", self.max_steps)
            if self.state == "running" and self.started is None:
                self.started = event["time"]
            if self.state in FINAL_STATES:
                self.ended = event["time"]
        elif kind == "progress":
            self.step = event.get("step", self.step)
            self.max_steps = event.get("max_steps", self.max_steps)
            self.epoch = event.get("epoch", self.epoch)
            self.progress_times.append((event["time"], self.step))
            if "step_s" in event:
                self.step_seconds.append(event["step_s"])
                self.tokens += event.get("tokens", 0)
        elif kind == "compile_start":
            self.compiling[(event["graph"], event["phase"])] = event
        elif kind == "compile_end":
            start = self.compiling.pop((event["graph"], event["phase"]), {})
            self.compiles.append({**event, "started": start.get("time", event["time"] - event["seconds"]),
                                  "reason": start.get("reason")})
        elif kind == "shape":
            self.shapes.append(event)
        elif kind == "checkpoint":
            self.checkpoints.append(event)
        elif kind == "resume":  # a new attempt from a checkpoint: what came after it is replaced
            self.metrics = [m for m in self.metrics if m.get("step", 0) <= event["step"]]
            self.step, self.progress_times, self.ended, self.exit_code = event["step"], [], None, None
        elif kind == "hardware":
            self.hardware.append(event)
        elif kind == "download":
            self.download = event
        elif kind == "metrics":
            self.metrics.append(event)
        elif kind == "error":
            self.errors.append(event)

    @property
    def live_state(self) -> str:
        """The state, corrected for a supervisor that died without saying so."""
        if self.state in FINAL_STATES or supervisor_alive(self.dir):
            return self.state
        self.refresh()  # the supervisor may have written its final status just before it ended
        if self.state in FINAL_STATES:
            return self.state
        if not (self.dir / "supervisor.json").exists() and time.time() - self.created < STARTING_GRACE_S:
            return "starting"
        return "failed"

    @property
    def error_text(self) -> str | None:
        if self.errors:
            return self.errors[-1].get("message")
        if self.live_state == "failed" and self.state not in FINAL_STATES:
            return "the run's supervisor ended without writing a final status (killed, or the machine restarted)"
        return None

    def eta_seconds(self) -> float | None:
        """Remaining time from the recent step times, compilation left out (None until two
        steps are seen): a compilation is a one-off, not a rate."""
        if not self.max_steps or len(self.progress_times) < 2 or self.live_state not in ("running",):
            return None
        recent = self.step_seconds[1:][-RECENT_STEPS:]  # the first step also loads and warms up
        if recent:
            return sum(recent) / len(recent) * (self.max_steps - self.step)
        (t0, s0), (t1, s1) = self.progress_times[0], self.progress_times[-1]
        if s1 <= s0:
            return None
        return (t1 - t0) / (s1 - s0) * (self.max_steps - s1)

    def resume_point(self) -> dict | None:
        """The checkpoint a resume would go on from (the last one on disk), or None."""
        found = list_checkpoints(self.dir)
        return found[-1] if found else None

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
            entry["graphs"] += 1
            entry["seconds"] += c["seconds"]
            entry["reason"] = entry["reason"] or (c.get("reason") or "").split("; ")[0] or None
        for event in self.shapes:
            if event["step"] in steps:
                steps[event["step"]]["shape"] = event["shape"]
        return list(steps.values())

    def duration(self) -> float | None:
        begin = self.created
        end = self.ended or (time.time() if self.live_state in ("starting", "running") else None)
        return None if end is None else end - begin


def late_compile_text(late: dict) -> str:
    """One line for a step that compiled after the warm-up (see RunView.late_compiles)."""
    shape = f", new batch shape {'x'.join(map(str, late['shape']))}" if late["shape"] else ""
    return (f"step {late['step']} compiled {late['graphs']} graph(s) in {late['seconds']:.1f} s after the "
            f"warm-up{shape}: {late['reason'] or 'no reason logged'}. Something is producing new shapes: pad "
            "to a fixed multiple (pad_to_multiple_of) or pack (packing); the shape forecast shows their effect")


class RunManager:
    def __init__(self, runs_dir: str | Path | None = None):
        self.runs_dir = Path(runs_dir).expanduser() if runs_dir else default_runs_dir()
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self._views: dict[str, RunView] = {}
        self._lock = threading.Lock()  # the web app reads runs from several threads

    # --- starting ----------------------------------------------------------------------
    def plan(self, spec: RunSpec, hardware: Hardware, run_id: str = "<run id>", this_machine: bool = False) -> Plan:
        """The plan of a launch. With `this_machine` (a preview of Start here, now) the cores are
        the ones Start would take at this moment: the asked-for ones if free (else SpecError
        naming their holder), or the next free block, so the preview shows the exact environment."""
        spec = with_absolute_paths(validated(spec))
        chosen = None
        if this_machine:
            chosen = self.choose_cores(spec, hardware)
            spec = replace(spec, layout=replace(spec.layout, cores=chosen))
        run_dir = self.runs_dir / run_id
        launch = plan(spec, hardware, run_dir=run_dir, run_id=run_id, compile_cache=compile_cache_root(),
                      model_config=sources.model_config(spec.model_name_or_path))
        if chosen and not launch.errors:
            launch.applied.insert(0, ("studio.cores", chosen, "free on this machine now; Start takes the cores "
                                      "that are free when it is clicked (next free, when none are named)"))
        return launch

    def start(self, spec: RunSpec, hardware: Hardware) -> RunView:
        """Validate, reserve cores, plan, write the run folder, start its supervisor.
        Raises SpecError, naming the holder when a core is taken."""
        run_id = self._new_run_id(spec.display_name)
        spec = validated(spec)
        with leases.choosing(self.runs_dir):  # until the supervisor holds the cores chosen here
            view, supervisor, cores = self._start(run_id, spec, hardware)
            leases.wait_held(self.runs_dir, hardware.backend, cores, supervisor)
        return view

    def _start(self, run_id: str, spec: RunSpec, hardware: Hardware) -> tuple[RunView, subprocess.Popen, list[int]]:
        spec = replace(spec, layout=replace(spec.layout, cores=self.choose_cores(spec, hardware)))
        launch = self.plan(spec, hardware, run_id)
        if launch.errors:
            raise SpecError(launch.errors)
        tmp = self.runs_dir / f".creating-{run_id}"
        tmp.mkdir()
        _write_launch(tmp, launch, hardware)
        append_event(tmp / "events.jsonl", "status", state="starting")
        for warning in launch.warnings:
            append_event(tmp / "events.jsonl", "log", message=f"warning: {warning}")
        run_dir = self.runs_dir / run_id
        tmp.rename(run_dir)
        return self.view(run_id), _start_supervisor(run_dir, launch.env), parse_cores(spec.layout.cores)

    def resume(self, run_id: str, hardware: Hardware, step: int | None = None) -> RunView:
        """Go on from the run's last checkpoint (or the one at `step`), in the same run folder:
        model, optimizer, scheduler and RNG states come back, the step count goes on, and the
        new events append to the run's own (after a `resume` event)."""
        view = self.view(run_id)
        if view.live_state in ("starting", "running"):
            raise SpecError([f"run {run_id} is {view.live_state}: stop it (or stop and save) first"])
        found = list_checkpoints(view.dir)
        if not found:
            raise SpecError([f"run {run_id} saved no checkpoint, so it cannot be resumed: train with save_steps "
                             "(a checkpoint every N steps), or use Stop and save"])
        chosen = found[-1] if step is None else next((c for c in found if c["step"] == step), None)
        if chosen is None:
            raise SpecError([f"run {run_id} has no checkpoint at step {step}; it has steps "
                             f"{', '.join(str(c['step']) for c in found)}"])
        spec = RunSpec.load(view.dir / "spec.yaml")
        with leases.choosing(self.runs_dir):
            count = hardware.cpu_count if hardware.backend == "cpu" else hardware.devices
            held = leases.holders(self.runs_dir, hardware.backend, count)
            if spec.layout.cores and set(parse_cores(spec.layout.cores)) & set(held):
                spec = replace(spec, layout=replace(spec.layout, cores=None))  # its cores are taken: next free
            spec = replace(spec, layout=replace(spec.layout, cores=self.choose_cores(spec, hardware)))
            launch = self.plan(spec, hardware, run_id)
            if launch.errors:
                raise SpecError(launch.errors)
            launch.env[RESUME_ENV] = chosen["path"]
            # the spec is the resolved one, so this plan applies nothing new: keep the first list
            first = json.loads((view.dir / "launch.json").read_text())
            launch = replace(launch, applied=[tuple(entry) for entry in first.get("applied", [])])
            clear_control(view.dir)
            _write_launch(view.dir, launch, hardware)
            append_event(view.dir / "events.jsonl", "resume", step=chosen["step"], checkpoint=chosen["path"])
            append_event(view.dir / "events.jsonl", "status", state="starting")
            supervisor = _start_supervisor(view.dir, launch.env)
            leases.wait_held(self.runs_dir, hardware.backend, parse_cores(spec.layout.cores), supervisor)
        return self.view(run_id)

    def stop_and_save(self, run_id: str) -> RunView:
        """Ask the run to save a checkpoint at its next step and stop; it ends as "stopped",
        resumable from that checkpoint. Returns at once: the run stops by itself."""
        view = self.view(run_id)
        if view.live_state not in ("starting", "running"):
            raise SpecError([f"run {run_id} is {view.live_state}: there is nothing to stop"])
        request_save_and_stop(view.dir)
        append_event(view.dir / "events.jsonl", "log", message="stop and save: asked for a checkpoint at the "
                     "next step, then a stop")
        return view

    def choose_cores(self, spec: RunSpec, hardware: Hardware) -> str:
        """The cores the run will hold: the ones asked for if all are free, else the first free
        valid block ("next free"). On the CPU backend these are CPU cores the run is pinned to."""
        try:
            return format_cores(leases.choose(self.runs_dir, hardware, spec.layout.nproc, spec.layout.cores))
        except leases.NoFreeCores as none:
            raise SpecError([f"studio.nproc: no {spec.layout.nproc} free {hardware.backend} cores in a valid "
                             f"block; {none}: wait for or stop one of them, or ask for fewer processes"]) from none
        except ValueError as error:
            raise SpecError([f"studio.cores: {error}"]) from error

    def _new_run_id(self, name: str) -> str:
        """`<time>-<name>-<6 hex>`: the suffix keeps ids unique across runs folders too, which
        matters because a run's processes are found by their STUDIO_RUN_ID marker machine-wide."""
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")[:48] or "run"
        while True:
            run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{slug}-{secrets.token_hex(3)}"
            if not (self.runs_dir / run_id).exists() and not (self.runs_dir / f".creating-{run_id}").exists():
                return run_id

    # --- reading -----------------------------------------------------------------------
    def view(self, run_id: str) -> RunView:
        run_dir = self.runs_dir / run_id
        if not (run_dir / "spec.yaml").exists():
            raise KeyError(f"no run {run_id!r} in {self.runs_dir}")
        with self._lock:
            view = self._views.setdefault(run_id, RunView(run_dir))
        return view.refresh()

    def list(self) -> list[RunView]:
        """Every run in the runs folder, newest first."""
        ids = [p.name for p in self.runs_dir.iterdir()
               if not p.name.startswith(".") and (p / "spec.yaml").exists()]  # .creating-*: half-made
        return sorted((self.view(i) for i in ids), key=lambda v: v.created, reverse=True)

    # --- stopping ----------------------------------------------------------------------
    def stop(self, run_id: str, grace_s: float = 20) -> RunView:
        """Stop a run: SIGTERM its supervisor, wait, kill what is left, confirm none is."""
        run_dir = self.runs_dir / run_id
        supervisor = supervisor_process(run_dir)
        if supervisor is not None:
            supervisor.send_signal(signal.SIGTERM)
            _, alive = psutil.wait_procs([supervisor], timeout=grace_s)
            if alive:  # the supervisor is stuck: take the whole process group down ourselves
                os.killpg(supervisor.pid, signal.SIGKILL)
                psutil.wait_procs(alive, timeout=5)
                append_event(run_dir / "events.jsonl", "status", state="stopped", exit_code=-signal.SIGKILL)
        left = kill_run_processes(run_id)
        if left:
            raise RuntimeError(f"processes of run {run_id} survived SIGKILL: {[p.pid for p in left]}")
        return self.view(run_id)


def _write_launch(folder: Path, launch: Plan, hardware: Hardware) -> None:
    """spec.yaml (the resolved spec) and launch.json (what will run, and why)."""
    launch.spec.save(folder / "spec.yaml")
    (folder / "launch.json").write_text(json.dumps({
        "argv": launch.argv, "env": launch.env, "hardware": hardware.to_dict(),
        "applied": [[k, v, why] for k, v, why in launch.applied], "warnings": launch.warnings,
        "cores": parse_cores(launch.spec.layout.cores),
    }, indent=2, default=str))


def _start_supervisor(run_dir: Path, env: dict) -> subprocess.Popen:
    log = open(run_dir / "train.log", "ab")
    try:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "studio_core.supervisor", str(run_dir)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, env={**os.environ, **env}, cwd=run_dir,
        )
    finally:
        log.close()
    _write_json(run_dir / "supervisor.json",
                {"pid": supervisor.pid, "create_time": psutil.Process(supervisor.pid).create_time()})
    # The supervisor is our child until we exit: reap it when it ends, or it stays a zombie.
    threading.Thread(target=supervisor.wait, name=f"reap-{run_dir.name}", daemon=True).start()
    return supervisor


def supervisor_process(run_dir: Path) -> psutil.Process | None:
    """The run's supervisor if it still runs (pid and start time both match)."""
    try:
        info = json.loads((run_dir / "supervisor.json").read_text())
        proc = psutil.Process(info["pid"])
        if abs(proc.create_time() - info["create_time"]) < 0.05 and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except (FileNotFoundError, json.JSONDecodeError, psutil.NoSuchProcess):
        return None
    return None


def supervisor_alive(run_dir: Path) -> bool:
    return supervisor_process(run_dir) is not None


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _read_yaml(path: Path) -> dict:
    import yaml

    try:
        return yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        return {}
