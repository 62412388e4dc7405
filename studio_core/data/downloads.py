"""The run's own downloads from the Hub: a model on its first use, the train split of a dataset.

Rank 0 reports them as `download` events (`model` or `dataset`, `done_bytes`, `total_bytes`) for
the run's page and `launch.py train`. No torch import here.
"""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import unquote

from studio_core.rundir import events as ev

DOWNLOAD_EVENT_EVERY_S = 1.0
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")  # a model is on this machine when one is


def _progress_bar(events: Path, **what):
    """A tqdm class for huggingface_hub that turns its byte counts into `download` events
    (with `what`: model= or dataset=), at most one a second, and always the last one."""
    from tqdm.auto import tqdm

    last = [0.0]

    class Progress(tqdm):
        def update(self, n=1):
            shown = super().update(n)
            finished = self.total and self.n >= self.total
            if n and self.unit == "B" and self.total and (finished or time.time() - last[0] > DOWNLOAD_EVENT_EVERY_S):
                last[0] = time.time()
                ev.append(events, ev.download(int(self.n), int(self.total), **what))
            return shown

    return Progress


def download_with_progress(name: str, events: Path) -> None:
    """The first use of a Hub model: download it with `download` events for the run's page."""
    from huggingface_hub import snapshot_download, try_to_load_from_cache

    # the weights, not config.json: the check before launch fetches that alone
    if any(isinstance(try_to_load_from_cache(name, f), str) for f in WEIGHTS):
        return  # already on this machine
    ev.append(events, ev.log(f"downloading {name} from the Hub (first use)"))
    snapshot_download(name, tqdm_class=_progress_bar(events, model=name),
                      allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py"])


def download_dataset_split(name: str, config: str | None, split: str,
                           events: Path | None) -> tuple[str, list[str]] | None:
    """A Hub dataset's split: its data files, found as `datasets` resolves them (the config's
    data_files, from the dataset card or the file layout), downloaded into the Hugging Face cache,
    with `download` events when `events` is given (rank 0). -> (datasets' packaged builder, e.g.
    "parquet" or "json"; the local paths), or None when the files are not all in the dataset's
    own repository. Only this split's files are fetched: load_dataset by name would download and
    prepare every split of the config, with no progress to show."""
    from datasets import load_dataset_builder
    from huggingface_hub import snapshot_download

    builder = load_dataset_builder(name, config)
    files = builder.config.data_files or {}
    base = split.split("[")[0]  # "train[:1000]" reads the train files
    if not files.get(base):
        raise ValueError(f"dataset_train_split: {name} ({builder.config.name} config) has no split {base!r}; "
                         f"it has {', '.join(map(str, files)) or 'none'}")
    prefix, revision, paths = f"hf://datasets/{name}@", None, []
    for url in map(str, files[base]):
        if not url.startswith(prefix):
            return None
        revision, _, path = url[len(prefix):].partition("/")
        paths.append(path)
    if events is not None:
        ev.append(events, ev.log(f"downloading {name} ({builder.config.name} config, {base} split) from the Hub"))
    folder = snapshot_download(name, repo_type="dataset", revision=unquote(revision), allow_patterns=paths,
                               tqdm_class=_progress_bar(events, dataset=name) if events is not None else None)
    return builder.__module__.split(".")[-1], [str(Path(folder) / path) for path in paths]
