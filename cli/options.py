"""What the options of the commands stand for: a spec, a Hardware, the runs folder, the files
given on the command line; each refused with what to change (CommandLineError, SpecError)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import yaml

from studio_core.backends.slurm import tools as slurm_values
from studio_core.machine.cores import parse_cores
from studio_core.machine.hardware import Hardware, cpu_hardware, detect_hardware, instance_hardware
from studio_core.runs.manager import default_runs_dir
from studio_core.recipe.spec import RunSpec, SpecError, read_yaml


class CommandLineError(ValueError):
    """An option that cannot be used as given; the message names it and says what to change."""


def hardware_for(args):
    if getattr(args, "instance", None):
        try:
            return instance_hardware(args.instance, lnc=args.lnc)
        except ValueError as error:
            raise SpecError([f"--instance/--lnc: {error}"]) from error
    if getattr(args, "backend", None) == "cpu":
        return cpu_hardware()
    return detect_hardware()


def load_spec(args) -> RunSpec:
    problems = [problem for item in args.set for problem in yaml_problem(item)]
    if problems:
        raise SpecError(problems)
    layout = [f"studio.{key}={value}" for key in ("nproc", "tp_size", "fsdp_size")
              if (value := getattr(args, key)) is not None]
    if args.cores is not None:
        layout.append(f"studio.cores={json.dumps(args.cores)}")  # a core set is text, even "3" (JSON quotes as YAML)
    if getattr(args, "jobs", None) is not None and not args.precompile:
        raise SpecError(["--jobs goes with --precompile (the number of parallel compile processes)"])
    if getattr(args, "precompile", False):
        layout += ["studio.precompile=true", *([f"studio.precompile_jobs={args.jobs}"] if args.jobs else [])]
    spec = read_recipe(args.recipe).with_overrides([*args.set, *layout])  # checked once, by plan or start
    slurm = {key: value for key, value in (("partition", args.partition), ("time", args.time),
                                           ("account", args.account)) if value is not None}
    slurm |= {"sbatch_args": args.sbatch_arg} if args.sbatch_arg else {}
    problems = check_slurm_options(slurm)
    if problems:
        raise SpecError(problems)
    if args.sbatch_arg:  # as sbatch gets them: ["--qos high"] is saved as ["--qos=high"]
        slurm["sbatch_args"] = slurm_values.sbatch_words(args.sbatch_arg)[0]
    slurm |= {"auto_resume": True} if args.auto_resume else {}
    if args.slurm or spec.layout.run_on == "slurm":  # the flag, or a recipe written for Slurm
        spec.layout.run_on = "slurm"
        if slurm and not isinstance(spec.layout.slurm, dict):
            raise SpecError([f"studio.slurm: {spec.layout.slurm!r} is not a mapping: write it as "
                             "{partition: trn, time: '1:00:00'}, or leave it out and give --partition, --time"])
        spec.layout.slurm = {**spec.layout.slurm, **slurm} if slurm else spec.layout.slurm
        spec.layout.nodes = args.nodes if args.nodes is not None else spec.layout.nodes
    else:
        given = [{"sbatch_args": "--sbatch-arg"}.get(key, f"--{key.replace('_', '-')}") for key in slurm]
        given += ["--nodes"] if args.nodes is not None and not getattr(args, "slurm_script", None) else []
        if given:
            raise SpecError([f"{', '.join(given)}: these are for a run on Slurm: add --slurm"])
    return spec


# The Slurm options as the command line names them, for its messages.
SLURM_OPTIONS = {"partition": "--partition", "time": "--time", "account": "--account", "sbatch_args": "--sbatch-arg"}


def check_slurm_options(given: dict) -> list[str]:
    """The Slurm options given on the command line, by the one rule for Slurm values
    (slurm.check_options), each problem under the option's name."""
    return slurm_values.check_options(given, SLURM_OPTIONS)


def sbatch_args_joined(argv: list[str]) -> list[str]:
    """`--sbatch-arg --qos=high` as `--sbatch-arg=--qos=high`: argparse takes a value that starts
    with - for an option of its own, so an sbatch option written after --sbatch-arg (as README
    writes it) would be refused. The word after --sbatch-arg is its value, whatever it is."""
    out, words = [], iter(argv)
    for word in words:
        following = next(words, None) if word == "--sbatch-arg" else None
        out.append(word if following is None else f"--sbatch-arg={following}")
    return out


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
