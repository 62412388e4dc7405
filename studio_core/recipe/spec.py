"""The run spec: one typed description of a training run, loaded from and saved to a recipe.

A recipe is a YAML file in TRL's own CLI format (`model_name_or_path`, `dataset_name`,
then any field of the trainer's TRL config), plus one `studio:` block for what only the
studio knows: the trainer and the process layout. Without that block the same file
works with `trl sft --config recipe.yaml`.

What can be checked before launch is checked in recipe/validate.py; a spec that cannot be
launched raises `SpecError`, which carries the problems.
"""

from __future__ import annotations

import re
from copy import deepcopy
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import yaml

from studio_core import backends
from studio_core.data.builtin import BUILTIN_MODEL
from studio_core.recipe import trainers
from studio_core.rundir import folder

# The studio block's keys besides the layout's.
STUDIO_KEYS = {"trainer", "column_map", "keep_columns", "rewards", "eval_fraction", "eval_dataset", "precompile",
               "precompile_jobs", "image_size"}
TRACKERS = ("tensorboard", "trackio")  # TRL's report_to values the studio installs, offers and places


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
    # A field's metadata: its command line flag and form label (cli/fields.py, app/train_form.py)
    nproc: int = field(default=1, metadata={"flag": "--nproc", "label": "Processes (torchrun nproc)"})  # one per core
    cores: str | None = field(default=None, metadata={"flag": "--cores", "label": "Cores"})  # "0-3"; None: first free
    tp_size: int = field(default=1, metadata={"flag": "--tp", "label": "TP size"})
    fsdp_size: int = field(default=1, metadata={"flag": "--fsdp", "label": "FSDP size"})
    run_on: str = "local"  # where the run executes: a run backend (studio_core.backends)
    nodes: int = field(default=1, metadata={"flag": "--nodes", "label": "Nodes"})  # machines, each running nproc
    # What the user chose for the place the run executes (its backend's options_type), read from
    # and written to the recipe key studio.<backend name>; None: nothing chosen.
    options: object = None


def layout_keys() -> list[str]:
    """The layout's keys in a recipe's studio block: its fields, the options under their backend's name."""
    return [f.name for f in fields(Layout) if f.name != "options"] + [b.name for b in backends.with_options()]


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
    image_size: int | None = None  # every image resized to this many pixels a side (data/image_size.py)

    # --- recipe YAML -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict) -> RunSpec:
        if not isinstance(data, dict):
            raise SpecError(["a recipe must be a YAML mapping of keys to values"])
        data = dict(data)
        studio = data.pop("studio", None) or {}
        if not isinstance(studio, dict):
            raise SpecError([f"studio: must be a mapping (trainer, {', '.join(layout_keys())})"])
        keys = set(layout_keys())
        unknown = set(studio) - keys - STUDIO_KEYS
        if unknown:
            raise SpecError([f"studio.{k}: unknown key; the studio block takes "
                             f"{', '.join(sorted(keys | STUDIO_KEYS))}" for k in sorted(unknown)])
        options, problems = backends.read_options(studio)  # the options of the backend they are named after
        if problems:
            raise SpecError(problems)
        layout = {k: v for k, v in studio.items() if k in keys and k not in backends.BACKENDS} | {"options": options}
        if isinstance(layout.get("cores"), int) and not isinstance(layout["cores"], bool):
            layout["cores"] = str(layout["cores"])  # `cores: 3` is the one-core set "3"
        spec = cls(trainer=studio.get("trainer", trainers.DEFAULT), layout=Layout(**layout),
                   column_map=studio.get("column_map") or {}, keep_columns=studio.get("keep_columns"),
                   rewards=studio.get("rewards") or [], eval_fraction=studio.get("eval_fraction"),
                   eval_dataset=studio.get("eval_dataset"), precompile=studio.get("precompile", False),
                   precompile_jobs=studio.get("precompile_jobs"), image_size=studio.get("image_size"))
        for name in ("model_name_or_path", "dataset_name", "dataset_config",
                     "dataset_train_split", "run_name"):
            if name in data:
                setattr(spec, name, data.pop(name))
        spec.args = data
        return spec

    def to_dict(self) -> dict:
        layout = {f.name: getattr(self.layout, f.name) for f in fields(Layout) if f.name != "options"}
        if layout["nodes"] == 1:  # written only when it says something
            del layout["nodes"]
        options, owner = self.layout.options, backends.owner(self.layout.options)
        if owner is not None and options.to_dict():  # under its backend's name: studio.<name>
            layout[owner.name] = options.to_dict()
        studio = {"trainer": self.trainer, **layout}
        studio |= {k: getattr(self, k) for k in ("column_map", "keep_columns", "rewards") if getattr(self, k)}
        studio |= {k: getattr(self, k) for k in ("eval_fraction", "eval_dataset") if getattr(self, k) is not None}
        if self.precompile:
            studio["precompile"] = self.precompile
        if self.precompile_jobs is not None:
            studio["precompile_jobs"] = self.precompile_jobs
        if self.image_size is not None:
            studio["image_size"] = self.image_size
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
            block, dot, inner = key.partition(".")
            if in_studio and dot:  # a key inside a block of the studio's: studio.ray.address, studio.slurm.time
                if not isinstance(data["studio"].setdefault(block, {}), dict):
                    raise SpecError([f"--set {item!r}: studio.{block} is not a block of keys"])
                data["studio"][block][inner] = value
            elif in_studio or key in STUDIO_KEYS or key in layout_keys():
                data["studio"][key] = value
            else:
                data[key] = value
        return RunSpec.from_dict(data)

    @property
    def display_name(self) -> str:
        return self.run_name or f"{self.trainer}-{Path(self.model_name_or_path).name}"

    @property
    def trainer_entry(self) -> trainers.Trainer:
        """The trainer's registry entry (`trainer` is its key, as spec.yaml and recipes write it);
        KeyError saying which there are."""
        return trainers.get(self.trainer)


def trackers(report_to) -> list[str]:
    """Which of TensorBoard and Trackio TRL's report_to (a name, a list, "all" or "none") logs to.
    "all" is every integration installed, and the studio installs both."""
    names = report_to if isinstance(report_to, list) else [report_to]
    return list(TRACKERS) if "all" in names else [name for name in TRACKERS if name in names]


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
    return replace(spec, args=dict(args), layout=replace(spec.layout, options=deepcopy(spec.layout.options)),
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
