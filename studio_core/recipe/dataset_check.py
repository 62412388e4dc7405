"""The check of a dataset against a run spec before it trains: its first rows (the column map,
TRL's type and format of the result against the trainer, the reward functions called once on
them), then, for a local file, every record (data_scan.check_spec_file). The spec's validation,
the evaluation set's check, the worker (any dataset, on its first rows) and the Train tab's
"Check dataset" all run this one check, so they say the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from studio_core.data import model_check, sources
from studio_core.data.files import read_rows
from studio_core.recipe import data_check, data_scan, rewards
from studio_core.recipe.data_check import DatasetKind


@dataclass
class DatasetCheck:
    """What the check found. `read`: the first rows as read; `rows`: those after the column map and
    keep-columns (None when these do not fit the columns); `kind`: TRL's type and format of them;
    `problems`: what stops the run, each saying what to change, from the first step that failed;
    `scan`: every record's check (a local file whose first rows fit), with its warnings and the
    number of rows it read."""

    read: list[dict]
    rows: list[dict] | None = None
    kind: DatasetKind | None = None
    problems: list[str] = field(default_factory=list)
    scan: data_scan.Scan | None = None

    @property
    def warnings(self) -> list[str]:
        """Records that train, but likely not as meant."""
        return self.scan.warnings if self.scan is not None else []


def check_first_rows(spec, rows: list[dict], check_rewards=None) -> DatasetCheck:
    """The dataset's first rows against the spec: its column map, TRL's type and format of the
    result against the trainer, and, for a trainer with rewards, `check_rewards` (each reward
    function called once on them; None: not checked)."""
    check = DatasetCheck(rows)
    if not rows:
        check.problems = [f"dataset_name: {spec.dataset_name} (split {spec.dataset_train_split}) has no rows; "
                          "give a dataset, config or split that holds some"]
        return check
    columns = list(dict.fromkeys(key for row in rows for key in row))
    check.problems = data_check.check_mapping(columns, spec.column_map, spec.keep_columns)
    if check.problems:
        return check
    check.rows = data_check.apply_column_map(rows, spec.column_map, spec.keep_columns)
    check.kind = data_check.detect(check.rows, text_field=spec.args.get("dataset_text_field", "text"))
    check.problems = data_check.fit_problems(check.kind, spec.trainer) + model_problems(spec, check.kind)
    if check_rewards is not None and spec.trainer_entry.rewards and not check.problems:
        check.problems += check_rewards(spec.rewards, check.rows)
    return check


def model_problems(spec, kind: DatasetKind) -> list[str]:
    """Images for a vision-language model, text for a text model: TRL hands images to a VLM's
    processor, and a text model has none (its run would fail at the first batch); a VLM trained on
    text alone learns nothing of its images. By the model's config.json, where it is on this machine
    (else the run checks again once it has downloaded it)."""
    name = spec.model_name_or_path
    config = sources.model_config(name) if isinstance(name, str) else None  # validate says a name that is not text
    if config is None:
        return []
    vision = model_check.is_vision(config)
    if kind.vision and not vision:
        return [f"dataset: it has images (`{kind.images}`), and {spec.model_name_or_path} is a text model: give a "
                "vision-language model (e.g. builtin:tiny-vlm, or HuggingFaceTB/SmolVLM-256M-Instruct), or leave the "
                "images out with studio.keep_columns"]
    if vision and not kind.vision:
        return [f"dataset: it has no images, and {spec.model_name_or_path} is a vision-language model: give data "
                "with an `images` column (each record's image files, one {\"type\": \"image\"} part per image in "
                "its messages), e.g. builtin:shapes, or train a text model on this data"]
    return []


def check_rows(spec, rows: list[dict], check_rewards=rewards.check_rewards) -> list[str]:
    """What stops a run on the first rows of its dataset (check_first_rows): the worker's check of
    any dataset before it loads the model."""
    return check_first_rows(spec, rows, check_rewards).problems


def check_file(spec, path: Path, what: str = "dataset", check_rewards=None) -> DatasetCheck:
    """A local file's first rows (check_first_rows), then, when they fit, every record with the
    model's tokenizer where it is on this machine (data_scan.check_spec_file; `what` begins its
    messages). ValueError when the file cannot be read."""
    check = check_first_rows(spec, read_rows(path, 5), check_rewards)
    if not check.problems:
        check.scan = data_scan.check_spec_file(spec, path, what)
        check.problems = list(check.scan)
    return check
