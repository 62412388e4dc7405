"""The training split as a run reads it: the worker loads it before the model, and the shape
forecast walks its batches. Imports `datasets` (not for the web app's process).
"""

from __future__ import annotations

from pathlib import Path

from studio_core import sources
from studio_core.data_check import prepare_dataset
from studio_core.downloads import download_dataset_split
from studio_core.spec import RunSpec, SpecError, check_rows


def load_checked_dataset(spec: RunSpec, events: Path | None):
    """The training split, renamed and trimmed as the spec says, after the checks a local file gets
    before launch (spec.check_rows: column map, TRL type against the trainer, GRPO rewards called on
    the first rows). A Hub dataset or a folder is read only here, so this is where it is refused."""
    dataset = load_train_dataset(spec, events)
    problems = check_rows(spec, dataset.select(range(min(5, len(dataset)))).to_list())
    if problems:
        raise SpecError(problems)
    return prepare_dataset(dataset, spec.column_map, spec.keep_columns)


def load_train_dataset(spec: RunSpec, events: Path | None = None):
    """The spec's training split (load_split)."""
    return load_split(spec.dataset_name, spec.dataset_config, spec.dataset_train_split, events)


def load_split(name: str, config: str | None, split: str, events: Path | None = None):
    """A file or folder as it is; a Hub dataset's split downloaded first (progress as `download`
    events when `events` is given: rank 0's), then read from the local files. Offline, `datasets`
    reads its own cache."""
    from datasets import load_dataset
    from huggingface_hub import constants

    path = sources.dataset_file(name)
    if path is not None:
        return load_dataset(sources.FILE_FORMATS[path.suffix.lower()], data_files=str(path), split="train")
    if sources.HUB_ID.match(name) and not Path(name).expanduser().exists() and not constants.HF_HUB_OFFLINE:
        found = download_dataset_split(name, config, split, events)
        if found is not None:
            builder, files = found
            return load_dataset(builder, data_files={split.split("[")[0]: files}, split=split)
    return load_dataset(name, name=config, split=split)
