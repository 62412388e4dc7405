"""sweep: one recipe over a grid of values, a run per combination through the queue; its table."""

from __future__ import annotations

import math
import sys

from cli.options import CommandLineError, hardware_for, load_spec, runs_folder
from studio_core.evaluate.evaluation import check_metrics, check_run_evaluation
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
    grid = sweep.parse_grid(args.grid)  # every value's YAML checked, said under --grid
    if not args.eval and (args.eval_metrics or args.eval_limit != sweep.EVAL_LIMIT):
        raise CommandLineError("--eval-limit and --eval-metrics go with --eval (evaluate each run when it ends)")
    evaluate = {"limit": args.eval_limit, "metrics": [m.strip() for m in (args.eval_metrics or "").split(",")
                                                      if m.strip()]} if args.eval else None
    if evaluate and evaluate["metrics"] and check_metrics(evaluate["metrics"]):
        raise SpecError([f"--eval-metrics: {problem}" for problem in check_metrics(evaluate["metrics"])])
    spec = load_spec(args)  # the recipe, --set, the layout's flags, --slurm and its options, --precompile
    print(f"Checking and planning {len(sweep.combinations(grid))} run(s) ...", flush=True)
    started = sweep.start(manager, spec, grid, hardware_for(args), recipe=args.recipe, yes=args.yes,
                          parallel=args.parallel, evaluate=evaluate, check_evaluation=check_run_evaluation)
    for entry in started.record["runs"]:
        print(f"{entry['id']:48} {manager.view(entry['id']).live_state:8} {sweep.label(entry['params'])}")
    if started.record.get("group"):
        print(f"Submitted as {started.record['group']['label']}")
    print(f"Sweep {started.id}: `launch.py sweep --show {started.id}` shows its table")
    if not args.wait:
        return 0
    try:
        ended = follow(manager, started)
    except KeyboardInterrupt:
        print(f"\nNo longer following the sweep; its runs go on (`launch.py stop RUN_ID` stops one, "
              f"`launch.py sweep --show {started.id}` shows the table)", file=sys.stderr)
        return 130
    rows = print_table(manager, started.id)
    evaluated = not evaluate or all(isinstance(row["evaluation"], dict) for row in rows)
    return 0 if evaluated and all(view.live_state == "finished" for view in ended) else 1


def follow(manager: RunManager, started: sweep.Sweep) -> list:
    """Wait for the sweep's runs to end and, when it evaluates them, for their evaluations; the
    runs' views as they ended. No time limit: a sweep of long runs takes what it takes."""
    ended = [manager.wait(entry["id"], timeout=math.inf) for entry in started.record["runs"]]
    left = sweep.unevaluated(manager.runs_dir, started.id) if started.record.get("eval") else []
    if left:
        print(f"Waiting for the evaluation of {len(left)} run(s) ...", file=sys.stderr, flush=True)
        sweep.wait_evaluations(manager.runs_dir, started.id)
    return ended


def print_table(manager: RunManager, sweep_id: str) -> list[dict]:
    rows = sweep.table(manager, sweep_id)
    print(f"Sweep {sweep_id}, best first by {sweep.ranked_by(rows)}:")
    print(f"{'run':48} {'state':9} {'step':>5} {'loss':>9} {'eval_loss':>9}  values")
    for row in rows:
        loss, eval_loss = (format_loss(row[key]) or "-" for key in ("loss", "eval_loss"))
        print(f"{row['id']:48} {row['state']:9} {row['step']:>5} {loss:>9} {eval_loss:>9}  "
              f"{sweep.label(row['params'])}")
        if row["evaluation"]:
            print(f"    evaluation: {sweep.scores_text(row['evaluation'])}")
        if row.get("precompiled_by") and row["state"] != "finished":
            print(f"    shares the precompile of run {row['precompiled_by']}")
        if row["why"]:
            print(f"    {row['why']}")
    return rows
