"""sweep: one recipe over a grid of values, a run per combination through the queue; its table."""

from __future__ import annotations

import math
import sys

from cli.options import CommandLineError, hardware_for, read_recipe, runs_folder, yaml_problem
from studio_core.recipe.spec import SpecError
from studio_core.runs.view import format_loss
from studio_core.runs import sweep
from studio_core.runs.manager import RunManager


def cmd_sweep(args) -> int:
    manager = RunManager(runs_folder(args, write=not args.show))
    if args.show:
        if args.recipe or args.grid:
            raise CommandLineError("--show SWEEP_ID shows a sweep's table: leave out the recipe and --grid")
        print_table(manager, args.show)
        return 0
    if not args.recipe:
        raise SpecError(["give a recipe and its --grid KEY=V1,V2 (or --show SWEEP_ID)"])
    grid = sweep.parse_grid(args.grid)
    problems = [problem for item in [*args.set, *(f"{key}={value}" for key, values in grid.items()
                                                  for value in values)] for problem in yaml_problem(item)]
    if problems:
        raise SpecError(problems)
    spec = read_recipe(args.recipe).with_overrides(args.set)
    print(f"Checking and planning {len(sweep.combinations(grid))} run(s) ...", flush=True)
    started = sweep.start(manager, spec, grid, hardware_for(args), recipe=args.recipe, yes=args.yes)
    for entry in started.record["runs"]:
        print(f"{entry['id']:48} {manager.view(entry['id']).live_state:8} {sweep.label(entry['params'])}")
    print(f"Sweep {started.id}: `launch.py sweep --show {started.id}` shows its table")
    if not args.wait:
        return 0
    try:  # no time limit: a sweep of long runs takes what it takes
        ended = [manager.wait(entry["id"], timeout=math.inf) for entry in started.record["runs"]]
    except KeyboardInterrupt:
        print(f"\nNo longer following the sweep; its runs go on (`launch.py stop RUN_ID` stops one, "
              f"`launch.py sweep --show {started.id}` shows the table)", file=sys.stderr)
        return 130
    print_table(manager, started.id)
    return 0 if all(view.live_state == "finished" for view in ended) else 1


def print_table(manager: RunManager, sweep_id: str) -> None:
    rows = sweep.table(manager, sweep_id)
    key = sweep.ranked_by(rows)
    print(f"Sweep {sweep_id}, best first by {key}:")
    print(f"{'run':48} {'state':9} {'step':>5} {'loss':>9} {'eval_loss':>9}  values")
    for row in rows:
        loss, eval_loss = (format_loss(row[key]) or "-" for key in ("loss", "eval_loss"))
        print(f"{row['id']:48} {row['state']:9} {row['step']:>5} {loss:>9} {eval_loss:>9}  "
              f"{sweep.label(row['params'])}")
        if row["why"]:
            print(f"    {row['why']}")
