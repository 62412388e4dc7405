"""Where a run's evaluation set comes from, and its checks before launch. Pure and light (no
`datasets` import): the spec's checks, the planner and the evaluation read it in the web app.

Three sources, as a recipe says them:

    studio.eval_fraction: 0.1      hold out 10% of the training split (seeded by `seed`, so a
                                   clone of the run holds out the same rows)
    studio.eval_dataset: FILE|ID   a separate file or Hub dataset (a file's one split, `train`;
                                   a Hub dataset's `dataset_test_split`)
    eval_strategy: steps           TRL's own way: the dataset's `dataset_test_split` split
                                   (TRL's default name: test)

The held-out rows are the ones `datasets.Dataset.train_test_split(test_size=fraction,
seed=seed)` gives, which studio_core.training.train_data applies in the worker, the shape forecast
and the evaluation process alike: ceil(fraction x rows) held out, the rest trained on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from studio_core.data import sources
from studio_core.recipe import dataset_check

FRACTION, DATASET, SPLIT = "fraction", "dataset", "split"
TRL_TEST_SPLIT = "test"  # TRL's ScriptArguments.dataset_test_split default
DEFAULT_SEED = 42  # TRL's TrainingArguments.seed default


@dataclass(frozen=True)
class EvalSource:
    kind: str  # FRACTION, DATASET or SPLIT
    name: str  # the dataset the rows come from
    split: str
    config: str | None = None
    fraction: float | None = None  # FRACTION: of the training split
    seed: int = DEFAULT_SEED

    def describe(self) -> str:
        if self.kind == FRACTION:
            return f"{self.fraction:g} of {self.name} held out (seed {self.seed})"
        return f"{self.name}, split {self.split}"


def eval_source(spec) -> EvalSource | None:
    """The run's evaluation set (None: it has none). Reads a spec that may not be valid yet:
    check() says what is wrong with it."""
    args = spec.args
    seed = args.get("seed", DEFAULT_SEED)
    seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else DEFAULT_SEED
    if spec.eval_fraction is not None:
        return EvalSource(FRACTION, spec.dataset_name, spec.dataset_train_split, spec.dataset_config,
                          spec.eval_fraction, seed)
    if spec.eval_dataset is not None:
        split = args.get("dataset_test_split") or ("train" if sources.dataset_file(str(spec.eval_dataset))
                                                   else TRL_TEST_SPLIT)
        return EvalSource(DATASET, spec.eval_dataset, split, None, None, seed)
    if args.get("eval_strategy", "no") not in ("no", None):
        return EvalSource(SPLIT, spec.dataset_name, args.get("dataset_test_split") or TRL_TEST_SPLIT,
                          spec.dataset_config, None, seed)
    return None


def held_out_rows(rows: int, fraction: float) -> tuple[int, int]:
    """(rows trained on, rows held out) of `rows`, as datasets' train_test_split counts them."""
    held = math.ceil(fraction * rows)
    return rows - held, held


def check(spec, train_rows: int | None = None, warnings: list[str] | None = None) -> list[str]:
    """What stops this evaluation set, each saying what to change; `train_rows`: the training
    split's row count when known (a local file). A local eval_dataset file gets the checks of a
    training file (readable, not empty, the columns and format the trainer needs, every record);
    its warnings go to `warnings`."""
    fraction, other = spec.eval_fraction, spec.eval_dataset
    if fraction is not None and other is not None:
        return ["studio.eval_fraction and studio.eval_dataset: choose one evaluation set (a held-out fraction of "
                "the training data, or a separate dataset)"]
    if fraction is not None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
            return [f"studio.eval_fraction: {fraction!r} must be a number between 0 and 1 (e.g. 0.1 holds out a "
                    "tenth of the training rows); leave it out for no held-out set"]
        if train_rows is not None:
            kept, held = held_out_rows(train_rows, fraction)
            if kept < 1:
                return [f"studio.eval_fraction: {fraction:g} of {train_rows} rows holds out all {held} and leaves "
                        "none to train on; use a smaller fraction"]
        return []
    if other is not None:
        if not isinstance(other, str) or not other:
            return [f"studio.eval_dataset: {other!r} is not a dataset; give a file path, a built-in sample or a "
                    "Hub id, in quotes"]
        problems = [p.replace("dataset_name:", "studio.eval_dataset:", 1) for p in sources.check_dataset(other)]
        path = sources.dataset_file(other)
        return problems if problems or path is None else _check_file(spec, path, warnings)
    source = eval_source(spec)
    if source is not None and sources.dataset_file(str(spec.dataset_name)) is not None and source.split != "train":
        return [f"eval_strategy: {spec.args['eval_strategy']!r} evaluates the dataset's {source.split!r} split "
                f"(dataset_test_split), and a file has one split, train: hold out part of it with "
                "studio.eval_fraction (e.g. 0.1) or give a separate file with studio.eval_dataset"]
    return []


def _check_file(spec, path, warnings: list[str] | None) -> list[str]:
    """An eval_dataset file as the trainer will evaluate on it: a training file's check
    (dataset_check.check_file), its reward functions aside (they run on the training rows)."""
    what = "studio.eval_dataset"
    try:
        check = dataset_check.check_file(spec, path, what)
    except ValueError as error:
        return [f"{what}: {error}"]
    if check.scan is None:  # its first rows do not fit (the same column map applies to both sets)
        return [f"{what} {path}: {p.removeprefix('dataset: ')}" for p in check.problems]
    if warnings is not None:
        warnings += check.warnings
    return check.problems


def warnings(spec) -> list[str]:
    """What is worth saying about the evaluation set, though it does not stop the run."""
    source = eval_source(spec)
    if source is not None and source.kind != SPLIT and spec.args.get("eval_strategy") == "no":
        return [f"eval_strategy: no: the evaluation set ({source.describe()}) is not evaluated during training; "
                "`launch.py eval` and the Evaluate tab still use it"]
    return []
