"""Checkpoints: listing them, "stop and save", and the first download of a Hub model or dataset.

TRL's trainers save checkpoints to RUN_DIR/output/checkpoint-<step> (TRL's save
settings: save_strategy, save_steps, save_total_limit). Resuming from one restores the
model, optimizer, scheduler and RNG states, and the step count goes on (studio_core.runs
RunManager.resume).

"Stop and save" is a request file, RUN_DIR/control.json, that every rank reads at each
step end. Rank 0 answers it with the step at which all ranks stop: the next one with a
single process, two steps on with several, so that every rank (they are at most a step
apart, held together by the gradient all-reduce) reads the answer before that step ends.
There they all save a checkpoint and stop.

A Hub model, or the train split of a Hub dataset, is downloaded by the run itself (rank 0
reports `download` events, with `model` or `dataset`, for the run's page and `launch.py train`).

No torch or transformers import at module level: the web app lists checkpoints too.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from urllib.parse import unquote

from studio_core.events import append_event

CONTROL = "control.json"
RESUME_ENV = "STUDIO_RESUME_FROM"  # set by RunManager.resume: the checkpoint folder the worker goes on from
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
DOWNLOAD_EVENT_EVERY_S = 1.0
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")  # a model is on this machine when one is


def list_checkpoints(run_dir: Path) -> list[dict]:
    """The run's complete checkpoints, oldest first: {step, path, size_bytes}."""
    found = []
    for path in (Path(run_dir) / "output").glob("checkpoint-*"):
        match = CHECKPOINT.match(path.name)
        if match and (path / "trainer_state.json").exists():  # written last: the checkpoint is whole
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            found.append({"step": int(match.group(1)), "path": str(path), "size_bytes": size})
    return sorted(found, key=lambda c: c["step"])


def request_save_and_stop(run_dir: Path) -> None:
    _write_control(Path(run_dir), {"save_and_stop": True, "asked": time.time()})


def clear_control(run_dir: Path) -> None:
    (Path(run_dir) / CONTROL).unlink(missing_ok=True)


def _write_control(run_dir: Path, data: dict) -> None:
    tmp = run_dir / f".{CONTROL}.tmp"
    tmp.write_text(json.dumps(data))
    tmp.replace(run_dir / CONTROL)


def stop_and_save_callback(run_dir: Path, rank: int, world_size: int):
    """A TrainerCallback, on every rank, that carries out a save-and-stop request."""
    from transformers import TrainerCallback

    control_file = run_dir / CONTROL

    class StopAndSave(TrainerCallback):
        stopped_at: int | None = None

        def on_step_end(self, args, state, control, **kwargs):
            try:
                request = json.loads(control_file.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                return  # no request (or one being written: read again at the next step)
            if not request.get("save_and_stop"):
                return
            if "stop_at" not in request:
                if rank != 0:
                    return
                request["stop_at"] = state.global_step + (0 if world_size == 1 else 2)
                _write_control(run_dir, request)
            if state.global_step >= request["stop_at"]:
                control.should_save = True
                control.should_training_stop = True
                self.stopped_at = state.global_step

    return StopAndSave()


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
                append_event(events, "download", **what, done_bytes=int(self.n), total_bytes=int(self.total))
            return shown

    return Progress


def download_with_progress(name: str, events: Path) -> None:
    """The first use of a Hub model: download it with `download` events for the run's page."""
    from huggingface_hub import snapshot_download, try_to_load_from_cache

    # the weights, not config.json: the check before launch fetches that alone
    if any(isinstance(try_to_load_from_cache(name, f), str) for f in WEIGHTS):
        return  # already on this machine
    append_event(events, "log", message=f"downloading {name} from the Hub (first use)")
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
        append_event(events, "log", message=f"downloading {name} ({builder.config.name} config, {base} split) "
                     "from the Hub")
    folder = snapshot_download(name, repo_type="dataset", revision=unquote(revision), allow_patterns=paths,
                               tqdm_class=_progress_bar(events, dataset=name) if events is not None else None)
    return builder.__module__.split(".")[-1], [str(Path(folder) / path) for path in paths]
