"""The queue runner of a runs folder: starts its queued runs, first in order first, as their
cores free up, and exits when none is queued (runs/queue.py says how the queue works).

    python -m studio_core.runs.queue_runner RUNS_DIR [LOCK_FD]

An entry point, never imported. It holds the runs folder's `.queue.lock` while it lives: a
second runner of the same folder exits at once.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from studio_core.runs import queue
from studio_core.runs.manager import RunManager


def main(runs_dir: Path, lock_fd: int | None) -> int:
    """`lock_fd`: the queue lock, taken by the process that started this one (queue.ensure_runner)."""
    lock_fd = queue.lock_queue(runs_dir) if lock_fd is None else lock_fd
    manager = RunManager(runs_dir)
    while lock_fd is not None:  # None: another runner has this queue
        while queue.queued(runs_dir):
            for run_id, problem in manager.start_queued():
                print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} run {run_id}: {problem or 'started'}", flush=True)
            time.sleep(queue.QUEUE_POLL_S)
        # let go, then look once more: a run queued in the meantime found the lock held and left it to us
        os.close(lock_fd)
        lock_fd = queue.lock_queue(runs_dir) if queue.queued(runs_dir) else None
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None))
