"""The training and evaluation sets as a run reads them: the worker loads them before the
model, the shape forecast walks their batches, and the evaluation process reads the same
held-out rows (studio_core.recipe.eval_data says where they come from). A local file's or
folder's images are loaded as TRL's collators take them (with_images). Imports `datasets` (not for
the web app's process).
"""

from __future__ import annotations

from pathlib import Path

from studio_core.recipe import data_scan, eval_data
from studio_core.recipe.data_check import IMAGE_COLUMNS
from studio_core.recipe.dataset_check import check_rows
from studio_core.data import sources
from studio_core.data.image_size import resize_dataset
from studio_core.rundir import events as ev
from studio_core.recipe.data_check import prepare_dataset
from studio_core.data.downloads import download_dataset_split
from studio_core.recipe.spec import RunSpec, SpecError

# characters a token at most, as far as cutting for the forecast goes: far more than any
# tokenizer's characters a token on real text, so a text cut there is still longer than max_length
CHARS_PER_TOKEN = 64


def load_checked_datasets(spec: RunSpec, events: Path | None):
    """(training set, evaluation set or None), renamed and trimmed as the spec says, after the
    checks a local file gets before launch (dataset_check.check_rows: column map, TRL type against the
    trainer, GRPO rewards called on the first rows). A Hub dataset or a folder is read only
    here, so this is where it is refused."""
    return load_datasets(spec, events, checked=True)


def load_datasets(spec: RunSpec, events: Path | None = None, checked: bool = False, shapes_only: bool = False):
    """(training set, evaluation set or None) as the run trains and evaluates on them, prepared
    (column map, keep-columns, images resized to studio.image_size): the training split less the
    held-out rows, if any. `checked`: each one's first rows through dataset_check.check_rows first
    (SpecError). `shapes_only` (the shape forecast): each text cut to what max_length can keep (cut_texts)."""
    train, held = split_off_eval(spec, load_train_dataset(spec, events), events)
    limit = data_scan.max_length(spec) if shapes_only else None
    packing = spec.args.get("packing") and spec.args.get("packing_strategy") == "wrapped"  # splits, keeps all
    if limit and not packing:
        train, held = (cut_texts(d, limit * CHARS_PER_TOKEN) if d is not None else None for d in (train, held))
    for dataset, what in ((train, ""), (held, "evaluation set: ")):
        problems = check_rows(spec, dataset.select(range(min(5, len(dataset)))).to_list()) \
            if checked and dataset is not None else []
        if problems:
            raise SpecError([what + p for p in problems])
        if checked and dataset is not None:
            _scan(spec, dataset, what, events)
    prepared = [resize_dataset(prepare_dataset(d, spec.column_map, spec.keep_columns), spec.image_size)
                if d is not None else None for d in (train, held)]
    return prepared[0], prepared[1]


def cut_texts(dataset, chars: int):
    """The dataset with every text (a string, a message's content) cut to `chars` characters.
    The forecast tokenizes every record whole, through TRL, several times: a 20 MB record took
    minutes and gigabytes, for a sample TRL cuts to max_length tokens anyway. Cut at
    CHARS_PER_TOKEN characters a token, it is still cut at max_length, so the shapes and the
    count of truncated samples are the same (its length shows as the cut one's)."""
    def cut(value):
        if isinstance(value, str):
            return value[:chars]
        if isinstance(value, list):
            return [{**m, "content": m["content"][:chars]} if isinstance(m, dict) and isinstance(m.get("content"), str)
                    else m for m in value]
        return value

    def long(value) -> bool:
        return len(value) > chars if isinstance(value, str) else isinstance(value, list) and any(
            isinstance(m, dict) and isinstance(m.get("content"), str) and len(m["content"]) > chars for m in value)

    texts = [c for c in dataset.column_names if c not in IMAGE_COLUMNS]  # images are not read, nor decoded
    if not any(long(v) for row in dataset.select_columns(texts) for v in row.values()):
        return dataset
    return dataset.map(lambda *values: {k: cut(v) for k, v in zip(texts, values)}, input_columns=texts)


def _scan(spec: RunSpec, dataset, what: str, events: Path | None) -> None:
    """Every record of a dataset read only here (a Hub dataset, a folder) through the checks a
    local file gets before launch (data_scan): its bad records stop the run before the model
    loads (SpecError), its warnings go to the run's log (`events`: rank 0's)."""
    name = spec.dataset_name if not what or spec.eval_dataset is None else spec.eval_dataset
    if sources.dataset_file(str(name)) is not None:
        return  # a local file: checked before launch, the same way
    scan = data_scan.scan_dataset(dataset, spec.column_map, spec.args.get("dataset_text_field", "text"),
                                  what=f"{what}dataset: {name}")
    if scan:
        raise SpecError(list(scan))
    if events is not None:
        ev.append_all(events, [ev.log(f"warning: {w}") for w in scan.warnings])


def split_off_eval(spec: RunSpec, dataset, events: Path | None = None):
    """(rows to train on, evaluation rows or None) for the spec's evaluation source."""
    source = eval_data.eval_source(spec)
    if source is None:
        return dataset, None
    if source.kind == eval_data.FRACTION:
        return held_out(dataset, source.fraction, source.seed)
    try:
        return dataset, load_split(source.name, source.config, source.split, events)
    except ValueError as error:  # datasets': no such split ("Unknown split ...")
        raise SpecError([f"evaluation set {source.describe()}: {error}; name a split the dataset has with "
                         "dataset_test_split, or hold out part of the training split with "
                         "studio.eval_fraction"]) from error


def held_out(dataset, fraction: float, seed: int):
    """(the rest, the held-out rows): the same rows for the same data, fraction and seed."""
    parts = dataset.train_test_split(test_size=fraction, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


def load_train_dataset(spec: RunSpec, events: Path | None = None):
    """The spec's training split (load_split)."""
    return load_split(spec.dataset_name, spec.dataset_config, spec.dataset_train_split, events)


def load_split(name: str, config: str | None, split: str, events: Path | None = None):
    """A file or folder as it is, its images taken from its folder (with_images); a Hub dataset's
    split downloaded first (progress as `download` events when `events` is given: rank 0's), then
    read from the local files. Offline, `datasets` reads its own cache."""
    from datasets import load_dataset
    from huggingface_hub import constants

    path = sources.dataset_file(name)
    if path is not None:
        dataset = load_dataset(sources.FILE_FORMATS[path.suffix.lower()], data_files=str(path), split="train")
        return with_images(dataset, path.parent)
    if sources.HUB_ID.match(name) and not Path(name).expanduser().exists() and not constants.HF_HUB_OFFLINE:
        found = download_dataset_split(name, config, split, events)
        if found is not None:
            builder, files = found
            return load_dataset(builder, data_files={split.split("[")[0]: files}, split=split)
    dataset = load_dataset(name, name=config, split=split)
    folder = Path(name).expanduser()
    return with_images(dataset, folder) if folder.is_dir() else dataset


def with_images(dataset, folder: Path):
    """The dataset with an `images` column of file paths (text) cast to a list of `datasets` images,
    an `image` column to one, each relative path taken from `folder` (the data file's, or the
    dataset folder's) first: TRL hands a path on to transformers' load_image, which would read it
    from the current directory (and download a URL). An absolute path stays as it is, and so
    do a URL (data_scan refuses it before training) and images that are `datasets` images already
    (Parquet's, the Hub's). A record without images (null) gets an empty list: it trains as text.
    The images are read when TRL's collator reads the record, as PIL images."""
    from datasets import Image, List, Value

    def resolve(path):
        return str(folder / Path(path).expanduser()) if isinstance(path, str) and not data_scan.URL.match(path) \
            else path

    for column, text, feature in (("images", List(Value("string")), List(Image())),
                                  ("image", Value("string"), Image())):
        if column in dataset.column_names and dataset.features[column] == text:
            dataset = dataset.map(lambda value: {column: [resolve(p) for p in value or []] if column == "images"
                                                 else resolve(value)}, input_columns=column)
            dataset = dataset.cast_column(column, feature)
    return dataset
