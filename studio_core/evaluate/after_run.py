"""The evaluation of a sweep's finished run, as the queue runner starts it (runs/sweep_eval.py
says when and why). An entry point, never imported:

    python -m studio_core.evaluate.after_run RUNS_DIR SWEEP_ID RUN_ID

It runs the studio's evaluation of the run (evaluation.EvalProcess, as `launch.py eval RUN_ID`
does: its own process on a core of its own) with the sweep's settings, waits for it, and records
what became of it in the sweep's evaluations record. It exits 3 without recording anything when
no core was free at the start (another process took the one the runner saw free): the runner
tries again later. It dies with the runner (the runner sets its parent-death signal), and its
evaluation process ends when this one does (its stdin closes).
"""

from __future__ import annotations

import sys
from pathlib import Path

from studio_core.evaluate.evaluation import EvalError, EvalProcess, EvalRequest
from studio_core.machine import leases
from studio_core.machine.hardware import Hardware
from studio_core.rundir import folder
from studio_core.runs import sweep_eval

SILENCE_S = 1800  # an evaluation that says nothing this long is stopped and counted failed
NO_CORE = 3


def main(runs_dir: Path, sweep_id: str, run_id: str) -> int:
    settings = folder.read_json(runs_dir / sweep_eval.SWEEPS / f"{sweep_id}.json").get("eval") or {}
    request = EvalRequest(run_id, metrics=tuple(settings["metrics"]) if settings.get("metrics") else None,
                          limit=settings.get("limit", sweep_eval.DEFAULT_LIMIT))
    hardware = Hardware(**folder.read_launch(runs_dir / run_id)["hardware"])
    try:
        evaluation = EvalProcess.start(request, runs_dir, hardware)
    except EvalError as error:
        if not leases.has_free(runs_dir, hardware):
            print(f"run {run_id}: no core free for its evaluation yet", flush=True)
            return NO_CORE
        return record(runs_dir, sweep_id, run_id, {"state": "failed", "why": str(error)})
    try:
        for _ in evaluation.events(timeout=SILENCE_S):
            continue
    except EvalError as error:
        return record(runs_dir, sweep_id, run_id, {"state": "failed", "why": str(error)})
    return record(runs_dir, sweep_id, run_id, {"state": "done", "dir": str(evaluation.out)})


def record(runs_dir: Path, sweep_id: str, run_id: str, result: dict) -> int:
    sweep_eval.mark(runs_dir, sweep_id, run_id, result)
    print(f"run {run_id}: evaluation {result['state']}" + (f": {result['why']}" if "why" in result else ""),
          flush=True)
    return 0 if result["state"] == "done" else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2], sys.argv[3]))
