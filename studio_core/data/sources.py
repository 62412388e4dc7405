"""Where a run's model and dataset come from, and the checks made before launch.

A model is the built-in tiny one, a local folder, or a Hub id; a dataset is a built-in
sample, a local file (JSONL, JSON, CSV, Parquet) or folder, or a Hub id. The checks here
only look whether they are there (for a Hub model not on this machine: fetch its config.json,
a few kB), so they are cheap enough for the web app; data_check reads a file's first rows, and
the worker does the real loading and checks a Hub dataset's first rows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from huggingface_hub import constants, try_to_load_from_cache

from studio_core.data.builtin import BUILTIN_DATASETS, BUILTIN_MODEL, TINY_ARCHITECTURE, TINY_VOCAB
from studio_core.data.files import check_folder

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
HUB_CHECK_TIMEOUT_S = 5  # a model's config.json, fetched before launch: the page must not wait long


def _looks_local(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or Path(name).expanduser().exists()


def not_here(model: str, dataset: str) -> list[str]:
    """The Hub model and dataset of a run that are not on this machine (not in the local Hugging
    Face cache), each in a few words; a plan for another machine does not check them here."""
    missing = []
    if HUB_ID.match(model or "") and not _looks_local(model) and not isinstance(
            try_to_load_from_cache(model, "config.json"), str):
        missing.append(f"model {model}")
    if (HUB_ID.match(dataset or "") and dataset_file(dataset) is None and not _looks_local(dataset)
            and not (Path(constants.HF_HUB_CACHE) / f"datasets--{dataset.replace('/', '--')}").exists()):
        missing.append(f"dataset {dataset}")
    return missing


def check_model(name: str, trust_remote_code: bool = False) -> list[str]:
    if not name:
        return ["model_name_or_path: empty; give a Hub id, a local folder, or builtin:tiny-qwen3"]
    if name == BUILTIN_MODEL:
        return []
    if name.startswith("builtin:"):
        return [f"model_name_or_path: {name!r} is not a built-in model; the built-in one is {BUILTIN_MODEL}"]
    if _looks_local(name):
        folder = Path(name).expanduser()
        if not folder.is_dir():
            return [f"model_name_or_path: folder {folder} not found; give an existing model folder or a Hub id"]
        if not (folder / "config.json").is_file():
            return [f"model_name_or_path: {folder} has no config.json, so it is not a saved "
                    "Transformers model; give the folder that save_pretrained wrote"]
        return _check_config(folder / "config.json", name, trust_remote_code)
    if not HUB_ID.match(name):
        return [f"model_name_or_path: {name!r} is neither an existing folder nor a Hub id like Qwen/Qwen3-0.6B"]
    cached = try_to_load_from_cache(name, "config.json")
    if isinstance(cached, str):
        return _check_config(Path(cached), name, trust_remote_code)
    if constants.HF_HUB_OFFLINE:
        return [f"model_name_or_path: {name} is not in the local Hugging Face cache and the Hub is off "
                "(HF_HUB_OFFLINE=1): download it first, or give a local folder"]
    return _check_on_the_hub(name, trust_remote_code)


def _check_on_the_hub(name: str, trust_remote_code: bool) -> list[str]:
    """A Hub model not on this machine: only its config.json (a few kB) is fetched, with a short
    timeout, so that a typo, a gated or private repo or a model that is not a causal LM is refused
    before launch, not as a raw error minutes into the run."""
    from httpx2 import TransportError  # huggingface_hub's HTTP client
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RemoteEntryNotFoundError, RepositoryNotFoundError

    where = f"model_name_or_path: {name}"
    login = "log in (hf auth login) or set HF_TOKEN to a token of an account that has access"
    try:
        # one request without retries first: hf_hub_download retries an unreachable Hub for ~20 s
        get_hf_file_metadata(hf_hub_url(name, "config.json"), timeout=HUB_CHECK_TIMEOUT_S)
        path = hf_hub_download(name, "config.json", etag_timeout=HUB_CHECK_TIMEOUT_S)
    except GatedRepoError:
        return [f"{where} is gated on the Hub: accept its terms on its page, then {login}"]
    except RepositoryNotFoundError:
        return [f"{where} not found on the Hub: check the id (owner/name, e.g. Qwen/Qwen3-0.6B); "
                f"if it is private, {login}"]
    except RemoteEntryNotFoundError:
        return [f"{where} has no config.json on the Hub, so it is not a Transformers model; give one that "
                "has (a ...ForCausalLM), e.g. Qwen/Qwen3-0.6B"]
    except HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else None
        if status in (401, 403):
            return [f"{where}: the Hub refused access ({status}); {login}"]
        return [f"{where}: the Hub answered {status} when asked for its config.json; try again later"]
    except (OSError, TransportError):
        # Unreachable or timed out: not checked here. A plan for another machine must not need
        # this one's network; a run here says so when it downloads.
        return []
    return _check_config(Path(path), name, trust_remote_code)


def model_config(name: str) -> dict | None:
    """The model's config.json when it is on this machine (a folder, or the Hub cache), else None.
    The built-in model's shape is known without building it."""
    if name == BUILTIN_MODEL:
        return {**TINY_ARCHITECTURE, "model_type": "qwen3", "vocab_size": TINY_VOCAB, "tie_word_embeddings": True}
    if _looks_local(name):
        path = Path(name).expanduser() / "config.json"
    else:
        cached = try_to_load_from_cache(name, "config.json") if HUB_ID.match(name) else None
        path = Path(cached) if isinstance(cached, str) else None
    try:
        return json.loads(path.read_text()) if path else None
    except (OSError, json.JSONDecodeError):
        return None  # check_model has said what is wrong with it


def _check_config(path: Path, name: str, trust_remote_code: bool) -> list[str]:
    """A causal language model, and one that needs no code of its own unless that is allowed."""
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        return [f"model_name_or_path: {path} is not readable JSON ({error})"]
    architectures = config.get("architectures") or []
    if architectures and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        return [f"model_name_or_path: {name} is a {', '.join(architectures)}, not a causal language model; "
                "SFT, DPO and GRPO train causal LMs (a ...ForCausalLM), e.g. Qwen/Qwen3-0.6B"]
    if "AutoModelForCausalLM" in (config.get("auto_map") or {}) and not trust_remote_code:
        return [f"model_name_or_path: {name} runs its own Python code (auto_map in config.json); set "
                "trust_remote_code: true only if you trust its authors"]
    return []


def cached_models(cache: str | Path | None = None) -> list[str]:
    """Models in the local Hugging Face cache, by Hub id: usable without the network."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        repos = scan_cache_dir(cache).repos
    except CacheNotFound:
        return []
    return sorted(repo.repo_id for repo in repos if repo.repo_type == "model"
                  and isinstance(try_to_load_from_cache(repo.repo_id, "config.json", cache_dir=cache), str))


def dataset_file(name: str) -> Path | None:
    """The local file behind a built-in or file dataset name; None for folders and Hub ids."""
    if name in BUILTIN_DATASETS:
        return BUILTIN_DATASETS[name]
    path = Path(name).expanduser()
    return path if path.suffix.lower() in FILE_FORMATS else None  # a Hub id has no file suffix


def check_dataset(name: str) -> list[str]:
    """Is the dataset there? (Its rows are checked against the trainer by data_check.)"""
    if not name:
        return ["dataset_name: empty; give a built-in sample, a local file or a Hub id"]
    if name.startswith("builtin:") and name not in BUILTIN_DATASETS:
        return [f"dataset_name: {name!r} is not a built-in sample; choose {', '.join(BUILTIN_DATASETS)}"]
    path = dataset_file(name)
    if path is None:
        if _looks_local(name):
            folder = Path(name).expanduser()
            if not folder.exists():
                return [f"dataset_name: {folder} not found; give an existing JSONL, JSON, CSV or Parquet file"]
            if folder.is_file():
                return [f"dataset_name: {folder.suffix or 'this'} files are not read; use "
                        f"{', '.join(FILE_FORMATS)}"]
            # a dataset folder: the worker loads it with datasets.load_dataset, once its files fit
            return [f"dataset_name: {p}" for p in check_folder(folder)]
        if not HUB_ID.match(name):
            return [f"dataset_name: {name!r} is neither an existing file nor a Hub id like trl-lib/Capybara"]
        cached = Path(constants.HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}"
        if constants.HF_HUB_OFFLINE and not cached.exists():
            return [f"dataset_name: {name} is not in the local Hugging Face cache and the Hub is off "
                    "(HF_HUB_OFFLINE=1): download it first, or give a local file"]
        return []
    if not path.is_file():
        return [f"dataset_name: file {path} not found (relative paths start from {Path.cwd()})"]
    return []
