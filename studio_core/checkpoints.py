"""Checkpoints: listing them, and "stop and save".

TRL's trainers save checkpoints to RUN_DIR/output/checkpoint-<step> (TRL's save
settings: save_strategy, save_steps, save_total_limit). Resuming from one restores the
model, optimizer, scheduler and RNG states, and the step count goes on (studio_core.runs.manager
RunManager.resume).

"Stop and save" is a request file, RUN_DIR/control.json, that every rank reads at each
step end. Rank 0 answers it with the step at which all ranks stop: the next one with a
single process, two steps on with several, so that every rank (they are at most a step
apart, held together by the gradient all-reduce) reads the answer before that step ends.
There they all save a checkpoint and stop.

No torch or transformers import at module level: the web app lists checkpoints too.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path


CONTROL = "control.json"
RESUME_ENV = "STUDIO_RESUME_FROM"  # set by RunManager.resume: the checkpoint folder the worker goes on from
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def list_checkpoints(run_dir: Path) -> list[dict]:
    """The run's complete checkpoints, oldest first: {step, path, size_bytes}."""
    found = []
    for path in (Path(run_dir) / "output").glob("checkpoint-*"):
        match = CHECKPOINT.match(path.name)
        if match and (path / "trainer_state.json").exists():  # written last: the checkpoint is whole
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            found.append({"step": int(match.group(1)), "path": str(path), "size_bytes": size})
    return sorted(found, key=lambda c: c["step"])


def request_save_and_stop(run_dir: Path) -> None:
    _write_control(Path(run_dir), {"save_and_stop": True, "asked": time.time()})


def clear_control(run_dir: Path) -> None:
    (Path(run_dir) / CONTROL).unlink(missing_ok=True)


def _write_control(run_dir: Path, data: dict) -> None:
    tmp = run_dir / f".{CONTROL}.tmp"
    tmp.write_text(json.dumps(data))
    tmp.replace(run_dir / CONTROL)


def stop_and_save_callback(run_dir: Path, rank: int, world_size: int, cost=None):
    """A TrainerCallback, on every rank, that carries out a save-and-stop request. `cost`: a
    compile_watch.StepCost that its step-end checks add their time to (part `stop_check`)."""
    from transformers import TrainerCallback

    control_file = run_dir / CONTROL
    control_path = str(control_file)

    class StopAndSave(TrainerCallback):
        stopped_at: int | None = None

        def on_step_end(self, args, state, control, **kwargs):
            start, cpu_start = time.perf_counter(), time.thread_time()
            self._check(state, control)
            if cost is not None:
                cost.add("stop_check", start, cpu_start)

        def _check(self, state, control) -> None:
            # Without a request (nearly always) a single stat() per step: a failed Path.read_text
            # costs five times as much (measured at a step end: ~3 us against ~15 us).
            try:
                os.stat(control_path)
                request = json.loads(control_file.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                return  # no request (or one being written: read again at the next step)
            if not request.get("save_and_stop"):
                return
            if "stop_at" not in request:
                if rank != 0:
                    return
                request["stop_at"] = state.global_step + (0 if world_size == 1 else 2)
                _write_control(run_dir, request)
            if state.global_step >= request["stop_at"]:
                control.should_save = True
                control.should_training_stop = True
                self.stopped_at = state.global_step

    return StopAndSave()
