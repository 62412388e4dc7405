"""Answers remembered across processes while nothing they read has changed.

The shape forecast (a child process that imports TRL: seconds) and the data scan's tokenizer
pass (it imports Transformers: a second or two) answer the same for the same spec and files, and
the same spec is asked again and again: `launch.py plan` twice, the page after an edit undone,
Start after a plan, a test worker's next run. Each answer is kept under
<cache>/<kind>/<key>.json. The key holds what the caller passes (the spec as YAML, the backend),
the versions of the libraries that shape the answer, the studio's own code that computes it
(training/, recipe/, data/: the built-in model and data are made there), and the size and
modification time of every local file or folder the spec names (the data, the model's
tokenizer, a chat template). A Hub model or dataset counts by the revision its local Hugging
Face cache points to; one not in that cache is not remembered (the caller downloads it, and what
the Hub holds may change).
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from studio_core.data.sources import HUB_ID, _looks_local
from studio_core.machine.cache import cache_dir

KEPT = 200  # the newest answers of a kind kept; older ones are deleted as new ones are written
LIBRARIES = ("trl", "transformers", "datasets", "tokenizers", "accelerate", "torch")
STUDIO = Path(__file__).resolve().parent.parent  # studio_core/
CODE = ("training", "recipe", "data")  # the forecast's walk, the spec and its trainers, the data scan, the built-ins
MAX_FILES = 2000  # a folder with more files than this is not remembered by (too slow to stamp)


class NotStamped(Exception):
    """Something the answer reads cannot be told unchanged from here: it is not remembered."""


def key(kind: str, parts: list, named: dict) -> str | None:
    """The key of a `kind` of answer (a folder name: "forecasts"), or None when it cannot be
    remembered: `parts` (JSON), and every file or folder a string in `named` (a spec as a dict)
    names, stamped."""
    try:
        stamps = sorted({str(value): _stamp(value) for value in _strings(named)}.items())
    except NotStamped:
        return None
    whole = [kind, parts, [_version(name) for name in LIBRARIES], _code_digest(), stamps]
    return f"{kind}/{hashlib.sha256(json.dumps(whole, default=str).encode()).hexdigest()}"


def load(digest: str):
    """The answer kept under `digest` (key's), or None: none kept, or damaged (asked again)."""
    try:
        return json.loads(_path(digest).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def save(digest: str, answer) -> None:
    path = _path(digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(answer), encoding="utf-8")
    tmp.replace(path)
    kept = sorted(path.parent.glob("*.json"), key=_mtime, reverse=True)
    for old in kept[KEPT:]:
        old.unlink(missing_ok=True)


def _path(digest: str) -> Path:
    return cache_dir() / f"{digest}.json"


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # deleted by another process meanwhile
        return 0.0


def _strings(value):
    """Every string in the spec's values (nested lists and dicts too)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def _stamp(value: str):
    """What tells the thing a spec value names unchanged: a local file's or folder's sizes and
    times, a Hub repository's cached revision; None for a value that names neither (a built-in
    model or dataset is made by the studio's code, which the key holds)."""
    from huggingface_hub import constants

    if value.startswith("builtin:"):
        return None
    if "\n" not in value and len(value) < 4096 and _looks_local(value):
        return _files(Path(value).expanduser())
    if HUB_ID.match(value) and "/" in value:
        for kind in ("models", "datasets"):
            refs = Path(constants.HF_HUB_CACHE) / f"{kind}--{value.replace('/', '--')}" / "refs"
            if refs.is_dir():  # refs/main holds the revision the cache serves
                return [(kind, str(ref.relative_to(refs)), ref.read_text(encoding="utf-8"))
                        for ref in sorted(refs.rglob("*")) if ref.is_file()]
        raise NotStamped(value)  # a Hub name not downloaded, or a word that only looks like one
    return None


def _files(path: Path) -> list:
    if path.is_file():
        stat = path.stat()
        return [(path.name, stat.st_size, stat.st_mtime_ns)]
    if not path.is_dir():
        return [(path.name, "missing")]
    found = []
    for root, _dirs, names in os.walk(path):
        for name in names:
            file = Path(root, name)
            stat = file.stat()
            found.append((str(file.relative_to(path)), stat.st_size, stat.st_mtime_ns))
            if len(found) > MAX_FILES:
                raise NotStamped(str(path))
    return sorted(found)


@lru_cache(maxsize=1)
def _code_digest() -> str:
    """The studio code this process runs (read once: a file edited since is not the code running)."""
    digest = hashlib.sha256()
    for part in CODE:
        for file in sorted((STUDIO / part).glob("*.py")):
            digest.update(file.name.encode() + file.read_bytes())
    return digest.hexdigest()


@lru_cache(maxsize=None)
def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None
