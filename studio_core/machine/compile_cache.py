"""The persistent compile cache: where runs keep their compiled graphs, its size, and clearing it.

One folder per backend under the compile cache root (`$STUDIO_COMPILE_CACHE`, else
`<studio cache>/compile-cache`), so every run with the same compiler stack shares it:

    <root>/neuron/neff/       TorchNeuron's NEFF cache (TORCH_NEURONX_NEFF_CACHE_DIR):
                              <key>.neff files two shard folders down (ab/cd/), and its
                              kernel path's <hash>/<hash>.neff one folder down
    <root>/<backend>/inductor/  TORCHINDUCTOR_CACHE_DIR: Inductor's FX graph cache (fxgraph/)
                              and the AOTAutograd cache (aotautograd/), with the C++ and
                              Python code they load; used only by the inductor backend

The planner puts these folders in a run's environment (`compile_cache_env`); the Runs tab
and `launch.py cache` show them and clear them. `neff_cache_folder` and `neff_keys` are the
NEFF cache as a Neuron process sees it, for telling a cache hit from a compile
(studio_core/training/neff_watch.py).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from studio_core.machine.cache import cache_dir
from studio_core.machine.hardware import DEVICES
from studio_core.machine.sizes import format_size

# TorchNeuron's NEFF cache settings (torch-neuronx source: the Python cache configuration's
# get_nfs_cache_dir and is_caching_disabled, and the C++ PersistentCacheBackend, which reads
# the same two variables); read in the source, not run on a device here.
NEFF_DIR_ENV, NEFF_DEFAULT_DIR = "TORCH_NEURONX_NEFF_CACHE_DIR", "/tmp/neff_cache"
NEFF_DISABLE_ENV = "TORCH_NEURONX_NEFF_DISABLE_CACHE"
NEFF = "neff"
INDUCTOR = "inductor"
# Inductor's own cache layout (checked on torch 2.13, CPU): one file per entry in these
# folders, under a folder per key; the other files in inductor/ are the code they load.
INDUCTOR_ENTRIES = {"fxgraph": "Inductor FX graphs", "aotautograd": "AOTAutograd entries"}


class CacheInUse(RuntimeError):
    """Clearing was refused because runs are active; the message names them."""


@dataclass
class CacheSummary:
    path: Path
    exists: bool
    size_bytes: int = 0
    entries: dict[str, int] = field(default_factory=dict)  # kind of entry -> how many
    newest: float | None = None  # mtime of the newest file, Unix seconds

    def describe(self) -> str:
        if not self.exists:
            return f"{self.path}: not created yet (nothing compiled)"
        counts = ", ".join(f"{kind}: {n}" for kind, n in self.entries.items()) or "no entries"
        return f"{self.path}: {format_size(self.size_bytes)}; {counts}"


def compile_cache_root() -> Path:
    """The configured root: `$STUDIO_COMPILE_CACHE`, else `<studio cache>/compile-cache`."""
    configured = os.environ.get("STUDIO_COMPILE_CACHE")
    return Path(configured).expanduser() if configured else cache_dir() / "compile-cache"


def compile_cache_dir(backend: str, root: str | Path | None = None) -> Path:
    """The folder for one backend's compiled graphs (`root` defaults to the configured one)."""
    if backend not in DEVICES:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(DEVICES)}")
    return Path(root if root is not None else compile_cache_root()) / backend


def compile_cache_env(backend: str, root: str | Path) -> dict[str, str]:
    """The environment that points a run's compilers at the cache. Pure: `root` is given."""
    folder = compile_cache_dir(backend, root)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(folder / INDUCTOR)}
    if backend == "neuron":
        env[NEFF_DIR_ENV] = str(folder / NEFF)
    return env


def neff_cache_folder(environ=os.environ) -> Path | None:
    """The NEFF cache folder a Neuron process of this environment writes to, None when its
    cache is turned off (the variable set to true, 1 or yes, as torch-neuronx reads it)."""
    if environ.get(NEFF_DISABLE_ENV, "").lower() in ("true", "1", "yes"):
        return None
    return Path(environ.get(NEFF_DIR_ENV) or NEFF_DEFAULT_DIR)


def neff_keys(folder: Path) -> set[str]:
    """The keys (file names less `.neff`) of the NEFFs in a NEFF cache folder, at any depth.
    TorchNeuron writes them at more than one depth (torch-neuronx source): its persistent cache
    as <folder>/ab/cd/<key>.neff (PersistentCacheBackend: two shard folders from the key's first
    four characters, written to a temporary file and renamed), its Python kernel path as
    <folder>/<hash>/<hash>.neff. Only `.neff` files count (a file being written, a lock, the
    folders are not NEFFs), and only names are read, no file is opened: os.scandir down the
    tree, symlinked folders not followed, tens of milliseconds for thousands of NEFFs. A
    folder that goes away meanwhile (a clear) or cannot be read is skipped."""
    found: set[str] = set()
    pending = [os.fspath(folder)]
    while pending:
        try:
            with os.scandir(pending.pop()) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(entry.path)
                    elif entry.name.endswith(".neff") and entry.is_file():
                        found.add(entry.name[:-5])
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue  # gone (a clear) or not ours to read: what it held cannot be counted
    return found


def summary(path: str | Path) -> CacheSummary:
    """Size, entry counts and newest file of a backend's cache folder."""
    path = Path(path)
    if not path.is_dir():
        return CacheSummary(path, exists=False)
    size, newest = 0, None
    for file in (p for p in path.rglob("*") if p.is_file() and not p.is_symlink()):
        stat = file.stat()
        size += stat.st_size
        newest = max(newest or 0.0, stat.st_mtime)
    entries = {}
    if (path / NEFF).is_dir():
        # TorchNeuron keeps NEFFs two levels down (<dir>/ab/cd/<key>.neff) and one level down
        # (<dir>/<hash>/<hash>.neff, its kernel path; read in the torch-neuronx source): count the
        # NEFF files at any depth, not the folders.
        entries["NEFFs"] = sum(1 for p in (path / NEFF).rglob("*.neff") if p.is_file())
    for folder, kind in INDUCTOR_ENTRIES.items():
        if (path / INDUCTOR / folder).is_dir():
            entries[kind] = sum(1 for p in (path / INDUCTOR / folder).rglob("*") if p.is_file())
    return CacheSummary(path, True, size, entries, newest)


def clear(path: str | Path, running: list[str]) -> CacheSummary:
    """Delete everything in the cache folder; refused (CacheInUse) while a run is active
    (`running`: RunManager.active_runs()), since a running compiler may be reading or writing
    it. Runs from another runs folder that share this cache are not seen."""
    path = Path(path)
    if running:
        raise CacheInUse(f"Cannot clear the compile cache while runs are active: {', '.join(running)}. "
                         "Stop them or wait until they end, then clear it.")
    if path.is_dir():
        for item in path.iterdir():
            if item.is_dir() and not item.is_symlink():
                shutil.rmtree(item)
            else:
                item.unlink()
    return summary(path)
