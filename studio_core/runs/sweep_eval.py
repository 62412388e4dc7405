"""A sweep's evaluations: each run evaluated once it has finished, when the sweep asks for it
(`launch.py sweep --eval`, the Train tab's "Evaluate each run when it ends").

The runs folder's queue runner (runs/queue_runner.py) sees to it, so nothing of the app or the
CLI has to stay open: it lives while a run of an evaluating sweep waits for its evaluation, and
starts one evaluation at a time when a core is free (studio_core/evaluate/after_run.py, its child:
the studio's own evaluation, as `launch.py eval RUN_ID` runs it: the tuned model against its base
on the run's held-out data, else its training data, the first `limit` rows, the sweep's `metrics`,
default every one that applies). The result goes where `launch.py eval` puts it (the run's
eval/<time>/); the sweep's table shows the tuned model's scores and ranks by them.

What became of each run's evaluation is kept beside the sweep's record, in
`sweeps/<sweep id>.evals.json`: {run id: {"state": "done", "failed" (with "why") or "skipped"
(the run did not finish)}}. A failed evaluation is not tried again (`launch.py eval RUN_ID` runs
one by hand). This module only reads and writes those records: no run is read here but from its
files, so the queue can ask whether anything waits without importing the runs' views.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

from studio_core.rundir import folder

DEFAULT_LIMIT = 50  # rows of the evaluation set, when the sweep names no limit
EVALS = ".evals.json"  # beside the sweep's record: sweeps/<sweep id>.evals.json
LOCK = ".evals.lock"  # in the sweeps folder: taken to write an evaluations record
SWEEPS = "sweeps"  # the sweeps' records, in the runs folder (runs/sweep.py)


def problems(evaluate: dict) -> list[str]:
    """What is wrong with a sweep's evaluation settings ({"limit": N, "metrics": [...]}); the
    metrics' names are the evaluation's to check (evaluate/evaluation.py check_metrics)."""
    limit = evaluate.get("limit")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        return []
    return [f"--eval-limit: {limit!r} rows; give a whole number above 0"]


def path_of(runs_dir: Path, sweep_id: str) -> Path:
    return Path(runs_dir) / SWEEPS / f"{sweep_id}{EVALS}"


def done(runs_dir: Path, sweep_id: str) -> dict:
    """What became of the sweep's evaluations: {run id: {"state", ...}}."""
    return folder.read_json(path_of(runs_dir, sweep_id))


def mark(runs_dir: Path, sweep_id: str, run_id: str, result: dict) -> None:
    """Record what became of a run's evaluation. Its writers (the queue runner, its evaluation
    child) take turns on the record's lock, so neither loses what the other wrote."""
    path = path_of(runs_dir, sweep_id)
    with open(path.with_name(LOCK), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # let go when the file closes
        folder.write_json(path, {**folder.read_json(path), run_id: result})


def waiting(runs_dir: Path) -> list[tuple[str, dict, str]]:
    """(sweep id, its evaluation settings, run id) for each run of an evaluating sweep whose
    evaluation has not been recorded, its folder still there (finished or not)."""
    found = []
    for path in sorted((Path(runs_dir) / SWEEPS).glob("*.json")):
        if path.name.endswith(EVALS):
            continue
        record = folder.read_json(path)
        if not isinstance(record.get("eval"), dict) or not isinstance(record.get("runs"), list):
            continue
        recorded = done(runs_dir, path.stem)
        for entry in record["runs"]:
            run_id = entry.get("id") if isinstance(entry, dict) else None
            if isinstance(run_id, str) and run_id not in recorded and folder.is_run(Path(runs_dir) / run_id):
                found.append((path.stem, record["eval"], run_id))
    return found


def unevaluated(runs_dir: Path, sweep_id: str) -> list[str]:
    """The sweep's runs whose evaluation has not been recorded yet (their folders still there)."""
    return [run_id for found, _, run_id in waiting(runs_dir) if found == sweep_id]


def latest(run_dir: Path) -> dict | None:
    """The tuned model's scores in the run's newest evaluation, or None."""
    found = folder.evaluations(run_dir)
    scores = found[0].get("results", {}).get("tuned") if found else None
    return scores if isinstance(scores, dict) else None
