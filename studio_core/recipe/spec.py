"""The run spec: one typed description of a training run, loaded from and saved to a recipe.

A recipe is a YAML file in TRL's own CLI format (`model_name_or_path`, `dataset_name`,
then any field of the trainer's TRL config), plus one `studio:` block for what only the
studio knows: the trainer and the process layout. Without that block the same file
works with `trl sft --config recipe.yaml`.

`validate` checks everything that can be checked before launch and returns the
problems as messages that say what to change; `SpecError` carries them.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import yaml

from studio_core.recipe import data_check, data_scan, eval_data, peft_check, rewards, trainers
from studio_core.backends.slurm import tools as slurm
from studio_core.data import sources
from studio_core.data.builtin import BUILTIN_MODEL
from studio_core.data.files import read_rows
from studio_core.machine.layout import check_sizes
from studio_core.rundir import folder
from studio_core.recipe.trl_schema import check_value, trainer_fields

# Set by the studio for every run; a recipe that sets them would be silently overridden.
STUDIO_OWNED = {
    "output_dir": "the model is saved in the run folder's output/ (choose where runs go with --runs-dir)",
}
# TRL settings that hold a secret (of the fields of every trainer's config, hub_token only):
# what a recipe or the form holds goes to spec.yaml, output/training_args.bin and the model
# card, so a token is refused there, with the ways to pass one that are never written down.
SECRET_FIELDS = {"hub_token"}
TOKEN_WAYS = ("log in once with `hf auth login`, or set HF_TOKEN in the environment the studio runs in; the "
              "studio reads it from there and never writes it down")
# A value that looks like a Hugging Face access token, in whatever setting.
TOKEN_VALUE = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")
# The studio block's keys besides the layout's.
STUDIO_KEYS = {"trainer", "column_map", "keep_columns", "rewards", "eval_fraction", "eval_dataset", "precompile",
               "precompile_jobs"}
MAX_PRECOMPILE_JOBS = 64
TRACKERS = ("tensorboard", "trackio")  # TRL's report_to values the studio installs, offers and places
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


# YAML 1.1 (PyYAML's default) reads `save_strategy: no` as False and `learning_rate: 1e-5`
# as a string; recipes and --set values are read as YAML 1.2 (and TRL's CLI) read them.
# Saved specs quote any string either reading would retype, so safe_load reads them too.
_BOOL, _FLOAT = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:float"
_YAML12 = {
    _BOOL: re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    _FLOAT: re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*|[0-9][0-9_]*(?=[eE]))"
                       r"(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
}


class _RecipeLoader(yaml.SafeLoader):
    yaml_implicit_resolvers = {
        first: [(tag, _YAML12.get(tag, regexp)) for tag, regexp in resolvers]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


class _RecipeDumper(yaml.SafeDumper):
    yaml_implicit_resolvers = {
        first: resolvers + [(tag, regexp) for tag, regexp in _RecipeLoader.yaml_implicit_resolvers[first]
                            if tag in _YAML12]
        for first, resolvers in yaml.SafeDumper.yaml_implicit_resolvers.items()}


def read_yaml(text: str):
    return yaml.load(text, Loader=_RecipeLoader)  # a SafeLoader: plain data only


class SpecError(ValueError):
    """A spec that cannot be launched; `problems` lists what to change, one line each."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(f"- {p}" for p in problems))


@dataclass
class Layout:
    nproc: int = 1  # torchrun processes: one per NeuronCore, GPU or CPU worker
    cores: str | None = None  # e.g. "0-3"; None takes the first free ones
    tp_size: int = 1
    fsdp_size: int = 1
    run_on: str = "local"  # where the run executes: a run backend (studio_core.backends)
    nodes: int = 1  # machines, each running nproc processes (several: run_on slurm)
    slurm: dict = field(default_factory=dict)  # run_on slurm: SLURM_KEYS


# The studio.slurm block: the job's sbatch settings the user chooses.
SLURM_KEYS = {"partition": "the partition (default: the cluster's default)", "time": "the time limit",
              "account": "the account charged", "sbatch_args": "a list of other sbatch options",
              "auto_resume": "true: HyperPod's srun --auto-resume=1"}


@dataclass
class RunSpec:
    trainer: str = trainers.DEFAULT
    model_name_or_path: str = BUILTIN_MODEL
    dataset_name: str = "builtin:qa"
    dataset_config: str | None = None
    dataset_train_split: str = "train"
    run_name: str | None = None
    args: dict = field(default_factory=dict)  # the trainer's TRL config fields, TRL's names
    layout: Layout = field(default_factory=Layout)
    column_map: dict = field(default_factory=dict)  # dataset column renames, {old: new}
    keep_columns: list | None = None  # keep only these columns (after renaming)
    rewards: list = field(default_factory=list)  # reward functions of GRPO, RLOO (see rewards.py)
    eval_fraction: float | None = None  # hold out this part of the training split (see eval_data.py)
    eval_dataset: str | None = None  # or evaluate on this dataset
    precompile: bool = False  # compile the forecast's batch shapes before step 1 (see precompile.py)
    precompile_jobs: int | None = None  # in this many parallel processes (None: the planner picks)

    # --- recipe YAML -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict) -> RunSpec:
        if not isinstance(data, dict):
            raise SpecError(["a recipe must be a YAML mapping of keys to values"])
        data = dict(data)
        studio = data.pop("studio", None) or {}
        if not isinstance(studio, dict):
            raise SpecError(["studio: must be a mapping (trainer, nproc, cores, tp_size, fsdp_size, run_on, nodes, "
                             "slurm)"])
        layout_keys = {f.name for f in fields(Layout)}
        unknown = set(studio) - layout_keys - STUDIO_KEYS
        if unknown:
            raise SpecError([f"studio.{k}: unknown key; the studio block takes "
                             f"{', '.join(sorted(layout_keys | STUDIO_KEYS))}" for k in sorted(unknown)])
        layout = {k: v for k, v in studio.items() if k in layout_keys}
        if isinstance(layout.get("cores"), int) and not isinstance(layout["cores"], bool):
            layout["cores"] = str(layout["cores"])  # `cores: 3` is the one-core set "3"
        spec = cls(trainer=studio.get("trainer", trainers.DEFAULT), layout=Layout(**layout),
                   column_map=studio.get("column_map") or {}, keep_columns=studio.get("keep_columns"),
                   rewards=studio.get("rewards") or [], eval_fraction=studio.get("eval_fraction"),
                   eval_dataset=studio.get("eval_dataset"), precompile=studio.get("precompile", False),
                   precompile_jobs=studio.get("precompile_jobs"))
        for name in ("model_name_or_path", "dataset_name", "dataset_config",
                     "dataset_train_split", "run_name"):
            if name in data:
                setattr(spec, name, data.pop(name))
        spec.args = data
        return spec

    def to_dict(self) -> dict:
        layout = asdict(self.layout)
        for key, unset in (("nodes", 1), ("slurm", {})):  # written only when they say something
            if layout[key] == unset:
                del layout[key]
        studio = {"trainer": self.trainer, **layout}
        studio |= {k: getattr(self, k) for k in ("column_map", "keep_columns", "rewards") if getattr(self, k)}
        studio |= {k: getattr(self, k) for k in ("eval_fraction", "eval_dataset") if getattr(self, k) is not None}
        if self.precompile:
            studio["precompile"] = self.precompile
        if self.precompile_jobs is not None:
            studio["precompile_jobs"] = self.precompile_jobs
        out = {"studio": studio,
               "model_name_or_path": self.model_name_or_path,
               "dataset_name": self.dataset_name}
        if self.dataset_config:
            out["dataset_config"] = self.dataset_config
        out["dataset_train_split"] = self.dataset_train_split
        if self.run_name:
            out["run_name"] = self.run_name
        out.update(self.args)
        return out

    @classmethod
    def load(cls, path: str | Path) -> RunSpec:
        path = Path(path)
        if path.is_dir():
            raise SpecError([f"recipe {path} is a folder, give a YAML file (e.g. recipes/tiny-sft.yaml)"])
        if path.exists() and not path.is_file():
            raise SpecError([f"recipe {path} is not a regular file (a device or a pipe): give a YAML file"])
        if not path.is_file():
            raise SpecError([f"recipe {path} not found: give the path of a .yaml file"])
        try:
            data = read_yaml(path.read_text())
        except yaml.YAMLError as error:
            raise SpecError([f"recipe {path} is not valid YAML: {error}"]) from error
        if data is None:  # an empty file would otherwise train every default, unasked
            raise SpecError([f"recipe {path} is empty: write at least the trainer, model and dataset (e.g. "
                             "studio: {trainer: sft}, model_name_or_path, dataset_name; see recipes/)"])
        return cls.from_dict(data)

    def to_yaml(self) -> str:
        return yaml.dump(self.to_dict(), Dumper=_RecipeDumper, sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())

    def with_overrides(self, assignments: list[str]) -> RunSpec:
        """Apply `key=value` strings (values read as YAML), as `--set` does."""
        data = self.to_dict()
        for item in assignments:
            key, sep, raw = item.partition("=")
            if not sep or not key:
                raise SpecError([f"--set {item!r}: write it as key=value, e.g. max_steps=100"])
            value = read_yaml(raw) if raw else None
            in_studio = key.startswith("studio.")  # an unknown one is then told as studio.KEY
            key = key.removeprefix("studio.")
            if in_studio or key in STUDIO_KEYS or key in {f.name for f in fields(Layout)}:
                data["studio"][key] = value
            else:
                data[key] = value
        return RunSpec.from_dict(data)

    @property
    def display_name(self) -> str:
        return self.run_name or f"{self.trainer}-{Path(self.model_name_or_path).name}"


def validate(spec: RunSpec, run_user_code: bool = False, warnings: list[str] | None = None,
             elsewhere: bool = False) -> list[str]:
    """Every problem that stops this spec from launching, each saying what to change. A user's
    reward files are imported and called only with `run_user_code` (Start, "Check reward
    functions"); otherwise (a plan, a preview) they are only read. What is worth saying but
    does not stop it (records that train, likely not as meant) goes to `warnings`. For a plan
    of another machine (`elsewhere`), a Hub model or dataset not on this one is not fetched
    nor checked: `warnings` says so."""
    warnings = warnings if warnings is not None else []
    problems: list[str] = []
    try:
        trainers.get(spec.trainer)
    except KeyError as error:
        return [str(error).strip("'\"")]
    secrets = secret_problems(spec)
    if secrets:  # alone: other messages would show the value
        return secrets
    problems += check_args(spec.trainer, spec.args)
    seen = {p.split(":", 1)[0] for p in problems}  # a LoRA value of the wrong type is already named
    problems += [p for p in peft_check.peft_problems(spec.args) if p.split(":", 1)[0] not in seen]
    problems += _check_numbers(spec)
    problems += _check_layout(spec.layout)
    if spec.args.get("push_to_hub") is True and any(isinstance(r, dict) and "file" in r for r in spec.rewards or []):
        # the run drops the Hub token before it imports the user's reward file (trainer_setup)
        problems.append("push_to_hub: a run with your reward file has no Hub token once that file is imported, so "
                        "it could not push; leave push_to_hub out and export the finished run to the Hub instead")
    # YAML reads `run_name: 2024-06-01` as a date and `dataset_name: 7` as a number.
    names = {"model_name_or_path": spec.model_name_or_path, "dataset_name": spec.dataset_name,
             "dataset_train_split": spec.dataset_train_split}
    names |= {k: v for k, v in (("dataset_config", spec.dataset_config), ("run_name", spec.run_name)) if v is not None}
    not_text = [name for name, value in names.items() if not isinstance(value, str)]
    problems += [f"{name}: {names[name]!r} is not text; write it in quotes" for name in not_text]
    if isinstance(spec.run_name, str) and not RUN_NAME.fullmatch(spec.run_name):
        problems.append(f"run_name: {spec.run_name!r} must be 1-64 letters, digits, '.', '_' or '-'")
    skipped = sources.not_here(*names_of(spec)) if elsewhere and not not_text else []
    if skipped:
        warnings.append(f"not checked here: {' and '.join(skipped)} (not on this machine, which plans for another; "
                        "the run downloads them there, and checks them before it trains)")
    if "model_name_or_path" not in not_text and not any(s.startswith("model ") for s in skipped):
        problems += sources.check_model(spec.model_name_or_path, bool(spec.args.get("trust_remote_code")))
    train_rows = None
    if "dataset_name" not in not_text:
        found, train_rows = _check_data(spec, run_user_code, warnings,
                                        here=not any(s.startswith("dataset ") for s in skipped))
        problems += found
    problems += eval_data.check(spec, train_rows, warnings)
    warnings += eval_data.warnings(spec)
    return problems


def names_of(spec: RunSpec) -> tuple[str, str]:
    """The run's model and dataset, as the recipe names them."""
    return spec.model_name_or_path, spec.dataset_name


def secret_problems(spec: RunSpec) -> list[str]:
    """The token rule (check_args': a secret field, or a value that looks like a token) over
    every value of the spec: the run's and dataset's names, the studio block, TRL's settings."""
    data = spec.to_dict()
    named = {f"studio.{key}": value for key, value in data.pop("studio").items()} | data
    return [_secret_message(key) for key, value in named.items()
            if key.rpartition(".")[2] in SECRET_FIELDS or holds_token(value)]


def _secret_message(key: str) -> str:
    return (f"{key}: a secret does not belong in a recipe or the form (it would be written to the run folder and "
            f"the model card); remove it and {TOKEN_WAYS}")


def finite_problems(value, name: str) -> list[str]:
    """inf, -inf or nan anywhere in `value` (YAML reads 1e999 as inf): TRL takes them and trains
    to NaN, or forever."""
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{name}: {value} is not a finite number; write a number (e.g. 2e-5 for a learning rate)"]
    if isinstance(value, dict):
        return [p for key, item in value.items() for p in finite_problems(item, f"{name}.{key}")]
    if isinstance(value, (list, tuple)):
        return [p for i, item in enumerate(value) for p in finite_problems(item, f"{name}[{i}]")]
    return []


def check_args(trainer: str, args: dict) -> list[str]:
    """Each TRL setting checked against the trainer's config: known name, right kind of value."""
    problems = []
    allowed = trainer_fields(trainer)
    for key, value in args.items():
        if key in STUDIO_OWNED:
            problems.append(f"{key}: set by the studio ({STUDIO_OWNED[key]}); remove it")
        elif key in SECRET_FIELDS or holds_token(value):
            problems.append(_secret_message(key))
        elif key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            config = trainers.get(trainer).config_class
            hint = f"; did you mean {close[0]}?" if close else f"; see {config}'s fields"
            problems.append(f"{key}: not a setting of TRL's {config}{hint}")
        else:
            message = check_value(key, value, peft_check.accepted(key, allowed[key]))
            if message:
                problems.append(message)
    return problems


def holds_token(value) -> bool:
    """Does this setting's value (or anything in it) look like a Hugging Face access token?"""
    if isinstance(value, str):
        return bool(TOKEN_VALUE.search(value))
    if isinstance(value, dict):
        return any(holds_token(v) or holds_token(k) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(holds_token(v) for v in value)
    return False


def _reward_check(spec: RunSpec, run_user_code: bool):
    """How the reward functions are checked: a user's files imported and called in a child
    process (without the Hub token) when that is asked for; else read only, in this process."""
    if run_user_code and any(isinstance(r, dict) and "file" in r for r in spec.rewards):
        return rewards.check_rewards_in_subprocess
    return lambda entries, rows: rewards.check_rewards(entries, rows, user_code=False)


def _check_data(spec: RunSpec, run_user_code: bool, warnings: list[str],
                here: bool = True) -> tuple[list[str], int | None]:
    """The dataset's source, then (for a local file) its first rows against the trainer and the
    GRPO reward functions called once on them, then every record (data_scan.scan_file). A Hub
    dataset or a folder is not read here: its rewards are only imported, and the worker runs
    `check_rows` on its first rows before it loads the model. -> (problems, the training rows
    when the whole file was read, for the held-out fraction's check)."""
    problems = sources.check_dataset(spec.dataset_name) if here else []  # not here: a Hub dataset, not looked for
    if problems:
        return problems, None
    takes_rewards = trainers.get(spec.trainer).rewards
    path = sources.dataset_file(spec.dataset_name)
    train_rows = None
    if path is None:
        problems = data_check.check_mapping(None, spec.column_map, spec.keep_columns)
        if takes_rewards and not problems:  # imported and looked up (with run_user_code), not called
            problems += _reward_check(spec, run_user_code)(spec.rewards, None)
    else:
        try:
            rows = read_rows(path, 5)
        except ValueError as error:
            return [f"dataset_name: {error}"], None
        problems = check_rows(spec, rows, check_rewards=_reward_check(spec, run_user_code))
        if not problems:
            scan = data_scan.check_spec_file(spec, path)
            problems, warnings[:], train_rows = list(scan), [*warnings, *scan.warnings], scan.rows
    if not takes_rewards and spec.rewards:
        using = ", ".join(t.key for t in trainers.TRAINERS.values() if t.rewards)
        problems.append(f"studio.rewards: {trainers.get(spec.trainer).name} takes no reward functions; remove them "
                        f"or choose a trainer that does ({using})")
    return problems, train_rows


def check_rows(spec: RunSpec, rows: list[dict], check_rewards=rewards.check_rewards) -> list[str]:
    """The dataset's first rows against the spec: its column map, TRL's type and format of the
    result against the trainer, and for the trainers with rewards `check_rewards` (each called once on
    them). One check for a local file before launch and for any dataset in the worker."""
    if not rows:
        return [f"dataset_name: {spec.dataset_name} (split {spec.dataset_train_split}) has no rows; "
                "give a dataset, config or split that holds some"]
    mapping = data_check.check_mapping(list(rows[0]), spec.column_map, spec.keep_columns)
    if mapping:
        return mapping
    rows = data_check.apply_column_map(rows, spec.column_map, spec.keep_columns)
    kind = data_check.detect(rows, text_field=spec.args.get("dataset_text_field", "text"))
    problems = data_check.fit_problems(kind, spec.trainer)
    if trainers.get(spec.trainer).rewards and not problems:
        problems += check_rewards(spec.rewards, rows)
    return problems


def validated(spec: RunSpec, run_user_code: bool = False, warnings: list[str] | None = None,
              elsewhere: bool = False) -> RunSpec:
    problems = validate(spec, run_user_code, warnings, elsewhere)
    if problems:
        raise SpecError(problems)
    return spec


def _check_numbers(spec: RunSpec) -> list[str]:
    data = spec.to_dict()
    problems = [p for key, value in data.pop("studio").items() for p in finite_problems(value, f"studio.{key}")]
    problems += [p for key, value in data.items() for p in finite_problems(value, key)]
    args = spec.args
    positive = ("learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps")
    for key in positive:
        value = args.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and -math.inf < value <= 0:
            problems.append(f"{key}: must be above 0, got {value}")
    steps, epochs = args.get("max_steps", -1), args.get("num_train_epochs", 3.0)
    if isinstance(steps, int) and isinstance(epochs, (int, float)) and steps <= 0 and epochs <= 0:
        problems.append("max_steps / num_train_epochs: set max_steps above 0 or num_train_epochs above 0")
    max_length = args.get("max_length")
    if isinstance(max_length, int) and max_length < 1:
        problems.append(f"max_length: must be at least 1 (or null for no truncation), got {max_length}")
    if not isinstance(spec.precompile, bool):
        problems.append(f"studio.precompile: true or false, got {spec.precompile!r}")
    jobs = spec.precompile_jobs
    if jobs is not None and (not isinstance(jobs, int) or isinstance(jobs, bool)
                             or not 1 <= jobs <= MAX_PRECOMPILE_JOBS):
        problems.append(f"studio.precompile_jobs: a whole number from 1 to {MAX_PRECOMPILE_JOBS} (parallel "
                        f"compile processes), got {jobs!r}")
    return problems


def trackers(report_to) -> list[str]:
    """Which of TensorBoard and Trackio TRL's report_to (a name, a list, "all" or "none") logs to.
    "all" is every integration installed, and the studio installs both."""
    names = report_to if isinstance(report_to, list) else [report_to]
    return list(TRACKERS) if "all" in names else [name for name in TRACKERS if name in names]


def _check_layout(layout: Layout) -> list[str]:
    """The hardware-free layout rules; the planner checks the rest against the hardware."""
    problems = check_sizes(layout.nproc, layout.tp_size, layout.fsdp_size)
    if layout.cores is not None and not isinstance(layout.cores, str):
        problems.append(f"studio.cores: {layout.cores!r} is not a core set; write it like \"0-3\" or \"0,1\"")
    if not isinstance(layout.nodes, int) or isinstance(layout.nodes, bool) or layout.nodes < 1:
        problems.append(f"studio.nodes: {layout.nodes!r} must be a whole number of machines, 1 or more")
    elif layout.nodes > 1 and layout.run_on == "local":
        problems.append(f"studio.nodes: {layout.nodes} nodes need a cluster: set studio.run_on: slurm (or "
                        "nodes: 1 to run on this machine)")
    return problems + _check_slurm(layout)


def _check_slurm(layout: Layout) -> list[str]:
    """The studio.slurm block, without asking the cluster (the Slurm backend checks the
    partition and its nodes when the run starts)."""
    options = layout.slurm
    if not isinstance(options, dict):
        return ["studio.slurm: must be a mapping of " + ", ".join(SLURM_KEYS)]
    if options and layout.run_on != "slurm":
        return [f"studio.slurm: these settings are for studio.run_on: slurm, but the run is {layout.run_on}"]
    problems = [f"studio.slurm.{key}: unknown key; it takes " + "; ".join(f"{k} ({why})" for k, why in
                                                                            SLURM_KEYS.items())
                for key in options if key not in SLURM_KEYS]
    problems += slurm.check_options(options)  # the one rule for Slurm values: the CLI, form and backend's too
    if not isinstance(options.get("auto_resume", False), bool):
        problems.append("studio.slurm.auto_resume: write true or false")
    if layout.run_on == "slurm" and layout.cores:
        problems.append("studio.cores: Slurm picks the nodes and the job has each node to itself; leave cores "
                        "empty for a Slurm run")
    return problems


def with_absolute_paths(spec: RunSpec) -> RunSpec:
    """Local model, dataset and reward files as absolute paths: the worker runs in the run folder."""
    def absolute(name):
        if not isinstance(name, str):
            return name
        path = Path(name).expanduser()
        return str(path.resolve()) if path.exists() else name

    out = replace(spec, model_name_or_path=absolute(spec.model_name_or_path),
                  dataset_name=absolute(spec.dataset_name), eval_dataset=absolute(spec.eval_dataset))
    out.rewards = [{**r, "file": absolute(r["file"])} if isinstance(r, dict) and "file" in r else r
                   for r in spec.rewards]
    return out


def resolved(spec: RunSpec, args: dict) -> RunSpec:
    """A copy of the spec with the planner's final TRL arguments."""
    return replace(spec, args=dict(args), layout=replace(spec.layout, slurm=dict(spec.layout.slurm)),
                   column_map=dict(spec.column_map),
                   keep_columns=list(spec.keep_columns) if spec.keep_columns else None,
                   rewards=[dict(r) for r in spec.rewards])


def load_spec(run_dir: Path):
    """The run's RunSpec, as every command and the app read it: DamagedRun when spec.yaml cannot
    be read whole (not UTF-8, not YAML, not a mapping, cut short) or is no spec the studio takes."""
    data = folder.read_spec(run_dir)
    try:
        return RunSpec.from_dict(data)
    except (SpecError, TypeError) as error:
        raise folder.DamagedRun(f"{folder.SPEC} of run {Path(run_dir).name} is no spec the studio can read ({error}): the "
                         "run's settings are unknown") from None
