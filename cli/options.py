"""What the options of the commands stand for: a spec, a Hardware, the runs folder, the files
given on the command line; each refused with what to change (CommandLineError, SpecError)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import yaml

from cli import fields
from studio_core.backends import BACKENDS, with_options
from studio_core.machine.cores import parse_cores
from studio_core.machine.hardware import Hardware, Target, cpu_hardware, detect_hardware
from studio_core.runs.manager import default_runs_dir
from studio_core.recipe.spec import Layout, RunSpec, SpecError, read_yaml


class CommandLineError(ValueError):
    """An option that cannot be used as given; the message names it and says what to change."""


def hardware_for(args):
    """The hardware of --instance (at --lnc), else of this machine (the CPU alone with --backend cpu)."""
    target = Target(getattr(args, "instance", None), getattr(args, "lnc", Target.lnc))
    try:
        return target.hardware(cpu_hardware if getattr(args, "backend", None) == "cpu" else detect_hardware)
    except ValueError as error:
        raise SpecError([f"{'/'.join(fields.flags(Target).values())}: {error}"]) from error


def load_spec(args) -> RunSpec:
    problems = [problem for item in args.set for problem in yaml_problem(item)]
    if problems:
        raise SpecError(problems)
    # the layout's flags but --nodes (a backend's, below); JSON quotes a core set, text even as "3", as YAML reads it
    layout = [f"studio.{key}={json.dumps(value)}" for key in fields.layout_flags(Layout)
              if key != "nodes" and (value := getattr(args, key)) is not None]
    if getattr(args, "jobs", None) is not None and not args.precompile:
        raise SpecError(["--jobs goes with --precompile (the number of parallel compile processes)"])
    if getattr(args, "precompile", False):
        layout += ["studio.precompile=true", *([f"studio.precompile_jobs={args.jobs}"] if args.jobs else [])]
    spec = read_recipe(args.recipe).with_overrides([*args.set, *layout])  # checked once, by plan or start
    spec.layout.run_on = chosen_backend(args) or spec.layout.run_on  # the flag, or a recipe written for that backend
    for backend in with_options():
        set_options(args, spec, backend)
    if args.nodes is not None and not getattr(args, "submit_script", None) and not BACKENDS[spec.layout.run_on].cluster:
        picks = " or ".join(f"--{b.name}" + (" ADDRESS" if picked_by_option(b) else "") for b in with_options()
                            if b.cluster)
        raise SpecError([f"--nodes: a run on several machines goes to a cluster: add {picks}"])
    return spec


def chosen_backend(args) -> str | None:
    """The backend a flag picks (--slurm, --ray ADDRESS), None when none does; SpecError when two do:
    a run goes to one place."""
    chosen = [backend for backend in BACKENDS.values() if picked(args, backend)]
    if len(chosen) > 1:
        named = " and ".join(f"--{b.name}" + (" ADDRESS" if picked_by_option(b) else "") for b in chosen)
        raise SpecError([f"{named} cannot go together: a run goes to one place, give only one of them"])
    return chosen[0].name if chosen else None


def picked_by_option(backend) -> bool:
    """Is the backend's flag one of its options (--ray ADDRESS), not a switch of its own (--slurm)?"""
    return f"--{backend.name}" in fields.flags(backend.options_type).values()


def picked(args, backend) -> bool:
    """Was the backend chosen on the command line: its flag (--slurm), or its option of that name (--ray ADDRESS)?"""
    if backend.options_type is None:
        return False
    named = next((name for name, flag in fields.flags(backend.options_type).items() if flag == f"--{backend.name}"),
                 backend.name)
    return getattr(args, named, None) not in (None, False, [])


def set_options(args, spec: RunSpec, backend) -> None:
    """The backend's options given on the command line, over the recipe's (studio.<backend name>):
    checked by the options' own rule, under the flags' names; refused when the run goes elsewhere."""
    given = fields.given(args, backend.options_type)
    problems = backend.options_type(**given).check(labels=fields.flags(backend.options_type))
    if problems:
        raise SpecError(problems)
    if spec.layout.run_on != backend.name:
        named = [fields.flags(backend.options_type)[key] for key in given]
        if named:
            raise SpecError([f"{', '.join(named)}: these are for a run on {backend.label}: add --{backend.name}"])
        return
    if given:
        spec.layout.options = replace(backend.options(spec.layout), **given).settled()
    spec.layout.nodes = args.nodes if args.nodes is not None else spec.layout.nodes


def repeated_flags() -> set[str]:
    """The flags of the backends' options that take one value each time they are given."""
    return fields.repeated(backend.options_type for backend in with_options())


def yaml_problem(item: str) -> list[str]:
    """[] when the value of `--set key=value` reads as YAML, else what to write instead."""
    key, _, raw = item.partition("=")
    try:
        read_yaml(raw)
    except yaml.YAMLError as error:
        return [f"--set {item}: {raw!r} is not valid YAML ({getattr(error, 'problem', None) or error}): close its "
                f"brackets ([1, 2], {{a: 1}}), or quote it to pass text: --set '{key}={json.dumps(raw)}'"]
    return []


def read_recipe(path: str) -> RunSpec:
    try:
        return RunSpec.load(path)
    except UnicodeDecodeError as error:
        raise SpecError([f"recipe {path} is not UTF-8 text (byte {error.start} is {error.object[error.start]:#x}): "
                         "save it as UTF-8"]) from None
    except OSError as error:
        raise SpecError([f"recipe {path}: {error.strerror}: give a .yaml file you can read"]) from None


def runs_folder(args, write: bool = False) -> Path:
    """--runs-dir (default $STUDIO_RUNS_DIR, else ~/trn-studio/runs), made if missing; with
    `write`, checked to take new files (runs, leases) as well."""
    path = Path(args.runs_dir).expanduser() if args.runs_dir else default_runs_dir()
    fix = "give --runs-dir (or $STUDIO_RUNS_DIR) a folder you can write to"
    blocked = not_a_folder(path)
    if blocked:
        raise CommandLineError(f"runs folder {path} {blocked}: {fix}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        if write:
            with tempfile.TemporaryFile(dir=path):
                pass
    except OSError as error:
        raise CommandLineError(f"runs folder {path}: cannot {'write to' if path.is_dir() else 'make'} it "
                               f"({error.strerror}): {fix}") from None
    return path


def not_a_folder(path: Path) -> str | None:
    """Why `path` cannot be (or become) a folder: it, or a folder above it, is a file."""
    existing = next(p for p in (path, *path.absolute().parents) if os.path.exists(p))  # os.path: never raises
    if os.path.isdir(existing):
        return None
    return "is not a folder" if existing == path else f"is inside {existing}, which is not a folder"


def check_new_file(option: str, path: str) -> Path:
    """A file the command will write: not a folder, in a folder that exists."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise CommandLineError(f"{option} {path} is a folder: give a file name, e.g. {path / 'run.sh'}")
    blocked = not_a_folder(path.parent)
    if blocked:
        raise CommandLineError(f"{option} {path}: {path.parent} {blocked}: write the file elsewhere")
    if not path.parent.is_dir():
        raise CommandLineError(f"{option} {path}: the folder {path.parent} does not exist: make it first "
                               f"(mkdir -p {path.parent}), or write the file elsewhere")
    return path


def check_new_folder(option: str, path: str) -> Path:
    """A folder the command will make (or fill, when empty): nothing on its way is a file."""
    path = Path(path).expanduser()
    blocked = not_a_folder(path)
    if blocked:
        raise CommandLineError(f"{option} {path} {blocked}: give a new (or empty) folder")
    return path


def check_one_core(cores: str | None, hardware: Hardware) -> None:
    """--cores of chat and export: one core of this machine."""
    if cores is None:
        return
    try:
        chosen = parse_cores(cores)
    except ValueError as error:
        raise CommandLineError(f"--cores {cores}: {error}") from None
    if len(chosen) != 1 or chosen[0] >= hardware.cores:
        raise CommandLineError(f"--cores {cores}: give one core of this machine's {hardware.cores} "
                               f"{hardware.backend} cores, 0 to {hardware.cores - 1} (or leave it out: the next free)")


def whole_number(low: int, high: int | None = None):
    """An argparse type: a whole number from `low` (to `high`), refused with the range."""
    def parse(text: str) -> int:
        try:
            number = int(text)
        except ValueError:
            number = None
        if number is None or number < low or (high is not None and number > high):
            span = f"from {low} to {high}" if high is not None else f"of {low} or more"
            raise argparse.ArgumentTypeError(f"{text!r}: use a whole number {span}")
        return number
    return parse
