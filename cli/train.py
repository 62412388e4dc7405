"""train, plan, runs and stop: start and follow runs in the terminal, and what a launch would be."""

from __future__ import annotations

import shlex
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from cli.fields import layout_flags
from cli.options import CommandLineError, check_new_file, hardware_for, load_spec, runs_folder
from studio_core.backends import EXPORT
from studio_core.training import precompile
from studio_core.data import sources
from studio_core.training.forecast import forecast_in_subprocess
from studio_core.runs import queue
from studio_core.runs.manager import RunManager
from studio_core.runs.view import (FINAL_STATES, RunView, format_seconds, format_time, late_compile_text,
                                   memory_text, studio_cost_text)
from studio_core.training.scripts import launch_script, overwrite_problem, submit_script
from studio_core.recipe.spec import Layout, SpecError


def cmd_plan(args) -> int:
    scripts = {option: check_new_file(option, path) for option, path in
               (("--export-script", args.export_script), (f"--{EXPORT.name}-script", args.submit_script)) if path}
    for option, path in scripts.items():  # before anything is planned: nothing but the studio's own script replaced
        problem = overwrite_problem(path)
        if problem:
            raise CommandLineError(f"{option} {path} {problem}")
    spec = load_spec(args)
    hardware = hardware_for(args)
    manager = RunManager(runs_folder(args))
    launch = manager.plan(spec, hardware, this_machine=not args.instance, elsewhere=bool(args.instance))
    print(f"Hardware: {hardware.describe()}\n")
    print(replace(launch, errors=[]).describe())
    if launch.errors:
        raise SpecError(launch.errors)
    missing = sources.not_here(launch.spec.model_name_or_path, launch.spec.dataset_name) if args.instance else []
    if missing and not args.no_forecast:
        print(f"\nNo shape forecast: {' and '.join(missing)} not on this machine, and a plan for another one "
              "downloads nothing; run the plan where they are (or with them in the Hugging Face cache) to see it")
    elif not args.no_forecast:
        try:
            print("\n" + forecast_in_subprocess(launch.spec, hardware.backend).describe())
        except SpecError as error:
            print(f"\nNo shape forecast: {error}")
    for option, path in scripts.items():
        if option == "--export-script":
            text, note = launch_script(launch), "one machine"
        else:  # the batch script Start would submit, for a run of its own (a new id), on the cluster's nodes
            job = manager.export_plan(spec, hardware, args.nodes, elsewhere=bool(args.instance))
            try:
                text = submit_script(job)
            except ValueError as error:
                raise CommandLineError(f"{option}: {error}") from None
            run_id, runs = Path(job.argv[-1]).name, runs_option(args)
            note = (f"{EXPORT.label}, {job.spec.layout.nodes} node(s), run {run_id}: submit it with `sbatch {path}`; "
                    f"`launch.py runs{runs}` then lists the run, `launch.py stop {run_id}{runs}` stops it")
        try:
            path.write_text(text)
            path.chmod(0o755)
        except OSError as error:
            raise CommandLineError(f"{option} {path}: cannot write it ({error.strerror}): choose a file in a "
                                   "folder you can write to") from None
        print(f"\nWrote {path} ({note})")
    return 0


def runs_option(args) -> str:
    """` --runs-dir DIR` when the command named one, for the commands it prints."""
    return f" --runs-dir {shlex.quote(str(args.runs_dir))}" if args.runs_dir else ""


def cmd_train(args) -> int:
    manager = RunManager(runs_folder(args, write=True))
    if args.resume:
        layout = [(flag, getattr(args, key)) for key, flag in layout_flags(Layout).items() if key != "nodes"]
        given = [name for name, value in (("the recipe", args.recipe), ("--set", args.set), *layout,
                                          ("--precompile", args.precompile or None), ("--jobs", args.jobs))
                 if value not in (None, [])]
        if given:
            raise SpecError([f"--resume goes on with the run's own settings: leave out {', '.join(given)}"])
        manager.view(args.resume)  # a run of that id, before the hardware is probed
        view = manager.resume(args.resume, hardware_for(args), step=args.from_checkpoint,
                              queue_if_busy=not args.no_queue)
        loads = view.resumed_from()
        if view.live_state == "queued":
            print(f"Run {view.id} {view.where()}; its folder: {view.dir}")
        else:
            print(f"Run {view.id} resumed from step {checkpoint_step(loads, view.step)}; its folder: {view.dir}"
                  + (f" (it loads {Path(loads).relative_to(view.dir) if Path(loads).is_relative_to(view.dir) else loads})"
                     if loads else ""))
    elif not args.recipe:
        raise SpecError(["give a recipe (e.g. recipes/tiny-sft.yaml), or --resume RUN_ID"])
    elif args.from_checkpoint is not None:
        raise SpecError(["--from-checkpoint goes with --resume RUN_ID (a new run from a recipe starts at step 0)"])
    else:
        view = manager.start(load_spec(args), hardware_for(args), planned=print_warnings,
                             queue_if_busy=not args.no_queue)
        where = view.where()
        print(f"Run {view.id} {'queued' if view.live_state == 'queued' else 'started'}; its folder: {view.dir}"
              + (f" ({where})" if where else ""))
    if args.detach:
        return 0

    def stop(signum, frame):
        print(f"\nStopping run {view.id} ...", file=sys.stderr)
        manager.stop(view.id)
        raise SystemExit(130 if signum == signal.SIGINT else 143)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    return follow(manager, view, resumed=bool(args.resume))


def print_warnings(launch) -> None:
    """The plan's warnings (the data check's among them), as `plan` shows them, before the run starts."""
    for warning in launch.warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)


def checkpoint_step(path: str | None, step: int) -> int:
    """The step of the checkpoint folder the run loads (checkpoint-<step>), else `step`."""
    name = Path(path).name if path else ""
    return int(name.split("-")[-1]) if name.startswith("checkpoint-") and name.split("-")[-1].isdigit() else step


def follow(manager: RunManager, view: RunView, resumed: bool = False) -> int:
    """Follow the run to its end, with a progress bar and its metrics as they come. A `resumed`
    run's history (metrics, late compilations, steps up to its checkpoint) is not shown again."""
    from tqdm import tqdm

    bar, fetch, precompiled, queued = None, None, None, view.live_state == "queued"
    shown, warned, first_step = resumed_history(view) if resumed and not queued else (0, 0, 0)
    while True:
        view = manager.view(view.id)
        if queued and view.live_state != "queued":
            queued = False
            print(f"Run {view.id} left the queue: {view.live_state}", flush=True)
            if resumed:  # its attempt began now
                shown, warned, first_step = resumed_history(view)
        if queued:  # a queued resume's history is its last attempt's: nothing to show yet
            time.sleep(0.5)
            continue
        if bar is None:
            fetch = follow_download(view, fetch)
            line = precompile.describe(view.precompile)
            if line and line != precompiled:  # each shape compiled, then the total
                print(line, flush=True)
                precompiled = line
        if bar is None and view.max_steps:
            if fetch is not None:
                fetch.close()
            bar = tqdm(total=view.max_steps, initial=first_step, unit="step", dynamic_ncols=True)
        for event in view.metrics[shown:]:
            line = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in event.items()
                             if k not in ("type", "time"))
            (bar.write if bar else print)(line)
        shown = len(view.metrics)
        finished_steps = [late for late in view.late_compiles()
                          if late["step"] <= view.step or view.live_state in FINAL_STATES]
        for late in finished_steps[warned:]:
            (bar.write if bar else print)(f"warning: {late_compile_text(late)}")
        warned = len(finished_steps)
        if bar is not None:
            bar.update(view.step - bar.n)
            bar.set_postfix_str(compiling_text(view), refresh=False)
        state = view.live_state
        if state in FINAL_STATES:
            break
        time.sleep(0.5)
    for open_bar in (fetch, bar):
        if open_bar is not None:
            open_bar.close()
    print(f"Run {view.id}: {state} (exit code {view.exit_code})" + (f": {view.reason}" if view.reason else ""))
    for line in (studio_cost_text(view.studio_cost), memory_text(view)):
        if line:
            print(line[0].upper() + line[1:])
    if state == "failed":
        for event in view.errors[-1:]:
            print(event.get("traceback") or "", file=sys.stderr)
        print(f"Error: {view.error_text}", file=sys.stderr)
        print(f"Full log: {view.dir / 'train.log'}", file=sys.stderr)
        return 1
    if state == "finished":
        print(f"Model saved in {view.dir / 'output'}")
        return 0
    return 1


def resumed_history(view: RunView) -> tuple[int, int, int]:
    """What a resumed run's follower does not show again: (its metrics before this attempt, its
    late compilations so far, the step it went on from)."""
    begin = view.spans[-1].begin if view.spans else 0.0
    return (sum(m["time"] < begin for m in view.metrics), len(view.late_compiles()),
            checkpoint_step(view.resumed_from(), view.step))


def follow_download(view: RunView, fetch):
    """Before training, a byte bar for the run's download of a Hub model or dataset (its latest
    `download` event); a new bar when the next one starts. -> the bar, or None."""
    from tqdm import tqdm

    download = view.download
    if not download:
        return fetch
    what = download.get("model") or f"dataset {download.get('dataset')}"
    if fetch is None or fetch.desc != f"downloading {what}":
        if fetch is not None:
            fetch.close()
        fetch = tqdm(total=download["total_bytes"], unit="B", unit_scale=True, dynamic_ncols=True,
                     desc=f"downloading {what}")
    fetch.total = download["total_bytes"]
    fetch.update(download["done_bytes"] - fetch.n)
    return fetch


def compiling_text(view: RunView) -> str:
    """The progress bar's postfix: what compiles now, and the compile time so far."""
    now = [f"compiling {graph} {phase}" for graph, phase in view.compiling]
    total = view.compile_seconds()
    return ", ".join(now + ([f"{len(view.compiles)} compiled in {total:.1f} s"] if view.compiles else []))


def clock(seconds: float | None) -> str:
    return "-" if seconds is None else format_seconds(seconds)


def cmd_runs(args) -> int:
    """The runs, newest first: started is the first start, training the time going (idle time
    between a stop and a resume left out), wall from the first start to the end."""
    manager = RunManager(runs_folder(args))
    queue.ensure_runner(manager.runs_dir)  # after a reboot: queued runs start again when their cores are free
    runs = manager.list()
    order = [path.name for path in queue.queued(manager.runs_dir)]  # read once for every queued run's place
    print(f"{'run':48} {'state':9} {'step':>11}  {'started':19} {'training':>8} {'wall':>8}  model / dataset")
    for view in runs:
        steps = f"{view.step}/{view.max_steps or '?'}"
        where = view.where(order)
        started = format_time(view.first_start) or "-"
        what = f"{view.model} / {view.dataset}" if view.spec else "?"
        print(f"{view.id:48} {view.live_state:9} {steps:>11}  {started:19} {clock(view.training_seconds()):>8} "
              f"{clock(view.wall_seconds()):>8}  {what}" + (f"  [{where}]" if where else ""))
        if view.live_state in ("failed", "stopped") and view.error_text:
            print(f"    {view.error_text}")
        for problem in view.damage():
            print(f"    damaged: {problem}")
    return 0


def cmd_queue(args) -> int:
    """The queued runs in order, each with what it waits for; with RUN_ID --to N, move one first."""
    runs_dir = runs_folder(args, write=bool(args.to))
    if (args.run_id is None) != (args.to is None):
        raise CommandLineError("give both a queued run and --to PLACE to move it, or neither to list the queue")
    if args.to:
        queue.move(runs_dir, args.run_id, args.to)
        print(f"Run {args.run_id} is now {queue.ordinal(args.to)} in the queue")
    queue.ensure_runner(runs_dir)  # after a reboot: queued runs start again when their cores are free
    order, manager = queue.queued(runs_dir), RunManager(runs_dir)
    damaged = queue.unreadable(runs_dir)
    if not order and not damaged:
        print("No run is queued.")
    names = [path.name for path in order]
    for path in [*order, *damaged]:
        print(f"{path.name:48} {queue.describe(path, manager.view_or_none, names)}")
    return 0


def cmd_stop(args) -> int:
    manager = RunManager(runs_folder(args, write=True))
    if args.save:
        manager.stop_and_save(args.run_id)
        view = manager.wait(args.run_id)
        point = view.resume_point()
        print(f"Run {view.id}: {view.live_state}" + (f"; resume it from step {point['step']} with "
                                                     f"`launch.py train --resume {view.id}`" if point else ""))
        return 0
    queued = manager.view(args.run_id).live_state == "queued"
    view = manager.stop(args.run_id)
    print(f"Run {view.id}: {view.live_state}" + (" (cancelled while queued)" if queued else ""))
    return 0
