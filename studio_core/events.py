"""The run's event stream: one JSON object per line in `<run>/events.jsonl`.

Every event has `type` and `time` (Unix seconds). Types written today: `status`
(`state`: starting, running, finished, failed, stopped; `exit_code` when it ends),
`progress` (step, max_steps, epoch), `metrics` (step, epoch, loss, learning_rate and
whatever else the trainer logs), `log` (message) and `error` (message, traceback).
Readers skip types they do not know, so the format can grow.

Writers append whole lines with a single write, so a reader never sees half an event
except at the very end of the file, which `EventReader` leaves for its next read.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

STATES = ("starting", "running", "finished", "failed", "stopped")
FINAL_STATES = ("finished", "failed", "stopped")


def append_event(path: str | Path, type: str, **fields) -> dict:
    event = {"type": type, "time": time.time(), **fields}
    line = json.dumps(event, default=str) + "\n"
    # O_APPEND makes each write land whole at the end, even with several writers.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    return event


class EventReader:
    """Reads the events added since the last call, from a remembered byte offset."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.offset = 0

    def read_new(self) -> list[dict]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # keep a trailing partial line for next time
        self.offset += end
        events = []
        for line in data[:end].splitlines():
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a crash mid-write: nothing to recover from it
            if isinstance(event, dict) and "type" in event:
                events.append(event)
        return events


def read_events(path: str | Path) -> list[dict]:
    return EventReader(path).read_new()
