"""Sweeps: one recipe, a grid of values, a run for each combination, all through the queue.

    launch.py sweep recipes/tiny-sft.yaml --grid learning_rate=1e-4,3e-4 --grid lora_r=8,16

Every run of the grid is checked and planned before any starts: an unknown key, a value of the
wrong type, a run that would not fit in a core's memory, or more runs than MAX_RUNS without
`yes` refuses the whole sweep, naming the combination. Then each run is started like Start with
the queue on (runs/queue.py): as many run at once as there are free cores for them, the rest wait
in order. They share the backend's compile cache (machine/compile_cache.py), so a shape one run
compiled is a cache hit for the next. A failed run does not stop the others.

A sweep is recorded in `<runs dir>/sweeps/<sweep id>.json` (its recipe, grid and each run's id
and values); `table()` reads its runs back, best first by their last evaluation loss (else
training loss), the failed ones last with why.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

from studio_core.machine.hardware import Hardware
from studio_core.recipe.spec import RunSpec, SpecError
from studio_core.rundir import folder
from studio_core.runs.manager import RunManager, RunNotFound

MAX_RUNS = 16  # more need `yes`: each run is a training (and on Neuron, maybe a compilation)
SWEEPS = "sweeps"  # the sweeps' records, in the runs folder
RUN_NAME_MAX = 64  # recipe/validate.py's longest run_name


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """`KEY=V1,V2` items -> {key: [values as written]}; SpecError for a malformed or repeated one."""
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key, found = key.strip(), [value.strip() for value in values.split(",") if value.strip()]
        if not sep or not key or not found:
            raise SpecError([f"--grid {item!r}: write it as KEY=V1,V2,... e.g. learning_rate=1e-4,3e-4"])
        if key in grid:
            raise SpecError([f"--grid {key} is given twice: list all its values in one --grid {key}=..."])
        grid[key] = found
    if not grid:
        raise SpecError(["a sweep needs at least one --grid KEY=V1,V2,..."])
    return grid


def combinations(grid: dict[str, list[str]]) -> list[dict[str, str]]:
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def label(params: dict[str, str]) -> str:
    """`learning_rate=1e-4 lora_r=8`: a combination as the user wrote it."""
    return " ".join(f"{key}={value}" for key, value in params.items())


def run_specs(spec: RunSpec, grid: dict[str, list[str]]) -> list[tuple[dict[str, str], RunSpec]]:
    """Each combination and its run's spec: the recipe with the values set (as --set sets them),
    named after the recipe's run and the values."""
    found, base = [], re.sub(r"[^A-Za-z0-9._-]+", "-", spec.display_name).strip("-") or "sweep"
    for n, params in enumerate(combinations(grid), 1):
        # a value's last path part, in characters a run name keeps: model_name_or_path=/a/b/my-model -> my-model
        suffix = "-".join(f"{key.rsplit('.', 1)[-1]}{re.sub(r'[^A-Za-z0-9._-]+', '', Path(value).name)}"
                          for key, value in params.items())
        name = f"{base}-{suffix}"
        if len(name) > RUN_NAME_MAX:  # cut, and numbered so that two cut names still differ
            name = f"{name[:RUN_NAME_MAX - 4]}-{n:03d}"
        found.append((params, spec.with_overrides([*(f"{k}={v}" for k, v in params.items()), f"run_name={name}"])))
    return found


@dataclass
class Sweep:
    id: str
    record: dict  # the file's content: recipe, grid, runs [{id, params}], created


def start(manager: RunManager, spec: RunSpec, grid: dict[str, list[str]], hardware: Hardware, recipe: str = "",
          yes: bool = False) -> Sweep:
    """Check and plan every run of the grid, then start them all through the queue."""
    runs = run_specs(spec, grid)
    if len(runs) > MAX_RUNS and not yes:
        raise SpecError([f"the grid makes {len(runs)} runs, more than {MAX_RUNS}: give fewer values, or confirm "
                         "with --yes"])
    found = {}  # each combination's problems
    for params, run_spec in runs:
        try:
            found[label(params)] = manager.plan(run_spec, hardware).errors
        except SpecError as error:
            found[label(params)] = error.problems
    everywhere = [problem for problem in next(iter(found.values())) if all(problem in p for p in found.values())]
    problems = [f"every run: {problem}" for problem in everywhere] + [
        f"{name}: {problem}" for name, listed in found.items() for problem in listed if problem not in everywhere]
    if problems:
        raise SpecError(problems + ["nothing was started"])
    sweep_id = folder.new_run_id(manager.runs_dir, f"sweep-{spec.display_name}")
    record = {"recipe": recipe, "grid": grid, "created": time.time(), "runs": []}
    for params, run_spec in runs:
        view = manager.start(run_spec, hardware, queue_if_busy=True)
        record["runs"].append({"id": view.id, "params": params})
        write(manager.runs_dir, sweep_id, record)  # as it grows: a sweep cut short still lists what started
    return Sweep(sweep_id, record)


def write(runs_dir: Path, sweep_id: str, record: dict) -> None:
    path = Path(runs_dir) / SWEEPS / f"{sweep_id}.json"
    path.parent.mkdir(exist_ok=True)
    folder.write_json(path, record)


def read(runs_dir: Path, sweep_id: str) -> dict:
    path = Path(runs_dir) / SWEEPS / f"{Path(sweep_id).name}.json"
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or not isinstance(record.get("runs"), list):
            raise ValueError("it holds no list of runs")
        return record
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
        raise RunNotFound(f"sweep record {path} cannot be read ({error}): its runs are still listed one by one "
                          "(`launch.py runs`); delete the file to drop the sweep") from None
    except FileNotFoundError:
        known = listed(runs_dir)
        raise RunNotFound(f"no sweep {sweep_id!r} in {runs_dir}" + (f"; there are {', '.join(known)}" if known
                                                                      else "")) from None


def listed(runs_dir: Path) -> list[str]:
    """The sweeps' ids, newest first."""
    return sorted((path.stem for path in (Path(runs_dir) / SWEEPS).glob("*.json")), reverse=True)


def table(manager: RunManager, sweep_id: str) -> list[dict]:
    """The sweep's runs, best first: {id, params, state, step, loss, eval_loss, why}; ranked by the
    last eval_loss where every ranked run has one, else by the last training loss; runs that have
    not finished come after, the failed ones last."""
    rows = []
    for entry in read(manager.runs_dir, sweep_id)["runs"]:
        try:
            view = manager.view(entry["id"])
        except RunNotFound:
            rows.append({**entry, "state": "deleted", "step": 0, "loss": None, "eval_loss": None, "why": None})
            continue
        last = {key: next((m[key] for m in reversed(view.metrics) if key in m), None) for key in ("loss", "eval_loss")}
        rows.append({**entry, "state": view.live_state, "step": view.step, **last,
                     "why": view.error_text if view.live_state in ("failed", "stopped") else None})
    key = ranked_by(rows)
    order = {"finished": 0, "running": 1, "starting": 1, "queued": 2, "stopped": 3, "failed": 4, "deleted": 5}

    def rank(row):
        value = row[key]
        return order.get(row["state"], 5), value if isinstance(value, (int, float)) and not math.isnan(value) \
            else math.inf

    return sorted(rows, key=rank)


def ranked_by(rows: list[dict]) -> str:
    """What the table ranks by: eval_loss where every finished run has one, else loss."""
    finished = [row for row in rows if row["state"] == "finished"]
    return "eval_loss" if finished and all(row["eval_loss"] is not None for row in finished) else "loss"
