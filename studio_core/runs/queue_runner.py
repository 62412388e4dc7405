"""The queue runner of a runs folder: starts its queued runs, first in order first, as their
cores free up (runs/queue.py says how the queue works), evaluates the finished runs of sweeps
that ask for it (runs/sweep_eval.py), and exits when none is queued and none waits to be
evaluated.

    python -m studio_core.runs.queue_runner RUNS_DIR [LOCK_FD]

An entry point, never imported. It holds the runs folder's `.queue.lock` while it lives: a
second runner of the same folder exits at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from studio_core.machine import children, leases
from studio_core.machine.hardware import Hardware
from studio_core.machine.procs import die_with_parent
from studio_core.runs import queue, sweep_eval
from studio_core.runs.manager import RunManager
from studio_core.runs.view import RunView

AFTER_RUN = "studio_core.evaluate.after_run"  # an evaluation of a sweep's finished run (a child)


def main(runs_dir: Path, lock_fd: int | None) -> int:
    """`lock_fd`: the queue lock, taken by the process that started this one (queue.ensure_runner)."""
    lock_fd = queue.lock_queue(runs_dir) if lock_fd is None else lock_fd
    manager, evaluator = RunManager(runs_dir), Evaluator(runs_dir)

    def work(wanted: list) -> bool:
        return bool(queue.queued(runs_dir) or evaluator.busy() or wanted)

    while lock_fd is not None:  # None: another runner has this queue
        while work(wanted := evaluator.wanted()):
            for run_id, problem in manager.start_queued():
                say(f"run {run_id}: {problem or 'started'}")
            started = evaluator.step(wanted)
            if started:
                say(started)
            time.sleep(queue.QUEUE_POLL_S)
        # let go, then look once more: a run queued in the meantime found the lock held and left it to us
        os.close(lock_fd)
        lock_fd = queue.lock_queue(runs_dir) if work(evaluator.wanted()) else None
    return 0


class Evaluator:
    """The runner's part that evaluates the sweeps' finished runs (runs/sweep_eval.py), one at a
    time, each in a child process (studio_core/evaluate/after_run.py) that dies with the runner."""

    def __init__(self, runs_dir: Path):
        self.runs_dir = Path(runs_dir)
        self.views: dict[str, RunView] = {}
        self.child: subprocess.Popen | None = None

    def busy(self) -> bool:
        return self.child is not None and self.child.poll() is None

    def wanted(self) -> list[tuple[str, str]]:
        """(sweep id, run id) of each run that waits for its evaluation and has finished or may
        still finish; a run that ended otherwise is recorded as skipped (nothing to evaluate)."""
        found = []
        for sweep_id, _, run_id in sweep_eval.waiting(self.runs_dir):
            view = self.views.setdefault(run_id, RunView(dir=self.runs_dir / run_id)).refresh()
            state = view.live_state
            if state == "finished" or view.active:
                found.append((sweep_id, run_id))
            else:
                sweep_eval.mark(self.runs_dir, sweep_id, run_id, {"state": "skipped", "why": f"the run {state}"})
        return found

    def step(self, wanted: list[tuple[str, str]]) -> str | None:
        """Start the next evaluation when none runs, a finished run of `wanted` (as wanted() gave
        them) waits for one and a core is free; what it started, in words."""
        if self.busy():
            return None
        for sweep_id, run_id in wanted:
            view = self.views[run_id]
            if view.live_state != "finished":
                continue
            if not leases.has_free(self.runs_dir, Hardware(**view.launch()["hardware"])):
                return None  # every core is busy: later
            self.child = children.start(AFTER_RUN, self.runs_dir, sweep_id, run_id, stdin=subprocess.DEVNULL,
                                        preexec_fn=die_with_parent)
            return f"run {run_id}: evaluating it (sweep {sweep_id})"
        return None


def say(what: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {what}", flush=True)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None))
