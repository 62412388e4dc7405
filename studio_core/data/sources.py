"""Where a run's model and dataset come from, and the checks made before launch.

A model is the built-in tiny one, a local folder, or a Hub id; a dataset is a built-in
sample, a local file (JSONL, JSON, CSV, Parquet) or folder, or a Hub id. The checks here are
cheap enough for every plan: a model on this machine is checked whole by model_check (config,
weight headers, tokenizer; no weights loaded), a Hub model not on it by its config.json (a few
kB), its list of files and its weights' headers read on the Hub; data_check reads a file's first rows, and the worker does the real
loading and checks a Hub dataset's first rows.
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import constants  # light: the client's own modules are imported where they are used

from studio_core.data import model_check
from studio_core.data.builtin import BUILTIN_DATASETS, BUILTIN_MODEL, TINY_ARCHITECTURE, TINY_VOCAB
from studio_core.data.builtin import ensure_tiny_model
from studio_core.data.builtin_vlm import BUILTIN_VLM, TINY_VLM_CONFIG, ensure_tiny_vlm
from studio_core.data.files import check_folder

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
BUILTIN_MODELS = (BUILTIN_MODEL, BUILTIN_VLM)  # each made on first use from a config, no download
HUB_CHECK_TIMEOUT_S = 5  # a model's config.json, fetched before launch: the page must not wait long
# any one of them: a Hub model has a tokenizer to load
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _looks_local(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or Path(name).expanduser().exists()


def not_here(model: str, dataset: str) -> list[str]:
    """The Hub model and dataset of a run that are not on this machine (not in the local Hugging
    Face cache; a model whose config alone is there counts as not here), each in a few words; a
    plan for another machine does not check them here."""
    missing = []
    if HUB_ID.match(model or "") and not _looks_local(model) and not _downloaded(model):
        missing.append(f"model {model}")
    if (HUB_ID.match(dataset or "") and dataset_file(dataset) is None and not _looks_local(dataset)
            and not (Path(constants.HF_HUB_CACHE) / f"datasets--{dataset.replace('/', '--')}").exists()):
        missing.append(f"dataset {dataset}")
    return missing


def check_model(name: str, trust_remote_code: bool = False) -> list[str]:
    """What stops the model from loading, each saying what to change; [] when it loads. A folder
    (or a Hub model in the local cache) is checked whole by model_check: config, weights, tokenizer;
    a Hub model not downloaded by its config.json, its list of files and its weights' headers on the Hub."""
    if not name:
        return ["model_name_or_path: empty; give a Hub id, a local folder, or builtin:tiny-qwen3"]
    if name in BUILTIN_MODELS:
        return []
    if name.startswith("builtin:"):
        return [f"model_name_or_path: {name!r} is not a built-in model; the built-in ones are "
                f"{' and '.join(BUILTIN_MODELS)}"]
    if _looks_local(name):
        folder = Path(name).expanduser()
        if not folder.is_dir():
            return [f"model_name_or_path: folder {folder} not found; give an existing model folder or a Hub id"]
        if not (folder / "config.json").is_file():
            return [f"model_name_or_path: {folder} has no config.json, so it is not a saved "
                    "Transformers model; give the folder that save_pretrained wrote"]
        return _named(name, model_check.check_folder(folder, trust_remote_code))
    if not HUB_ID.match(name):
        return [f"model_name_or_path: {name!r} is neither an existing folder nor a Hub id like Qwen/Qwen3-0.6B"]
    snapshot = _downloaded(name)
    if snapshot is not None:
        return _named(name, model_check.check_folder(snapshot, trust_remote_code))
    if constants.HF_HUB_OFFLINE:
        what = ("only its config.json is in the local Hugging Face cache, not its weights" if _cached_config(name)
                else "it is not in the local Hugging Face cache")
        return [f"model_name_or_path: {name}: {what}, and the Hub is off (HF_HUB_OFFLINE=1): download it first "
                f"(hf download {name}, with the Hub on), or give a local folder"]
    return _check_on_the_hub(name, trust_remote_code)


def builtin_folder(name: str) -> Path | None:
    """A built-in model's folder, built on first use (imports torch and Transformers: not for the
    web app's process); None for any other name."""
    if name == BUILTIN_MODEL:
        return ensure_tiny_model()
    if name == BUILTIN_VLM:
        return ensure_tiny_vlm()
    return None


def is_vision_model(name: str) -> bool:
    """Whether the model (built-in, a folder, or a Hub model in the cache) is a vision-language model,
    by its config.json alone (False where it is not on this machine)."""
    return model_check.is_vision(model_config(name) or {})


def _named(name: str, problems: list[str]) -> list[str]:
    return [f"model_name_or_path: {name}: {problem}" for problem in problems]


def _cached_config(name: str, cache: str | Path | None = None) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json", cache_dir=cache)
    return Path(cached) if isinstance(cached, str) else None


def _downloaded(name: str, cache: str | Path | None = None) -> Path | None:
    """The Hub model's folder in the local Hugging Face cache when its weights are there too (the
    check of a model not downloaded leaves its config.json alone there)."""
    config = _cached_config(name, cache)
    return config.parent if config is not None and model_check.has_weights(config.parent) else None


def _check_on_the_hub(name: str, trust_remote_code: bool) -> list[str]:
    """A Hub model not on this machine: only its config.json (a few kB) is fetched, its list of
    files asked and its safetensors headers read (huggingface_hub reads each file's first 100 kB),
    each with a short timeout, so that a typo, a gated or private repo, a model that is not a causal
    LM, has no weights or weights of another shape, or a Hub that cannot be reached is refused
    before launch, not as a raw error in the run."""
    from httpx2 import TransportError  # huggingface_hub's HTTP client
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_download, hf_hub_url

    try:
        # one request without retries first: hf_hub_download retries an unreachable Hub for ~20 s
        get_hf_file_metadata(hf_hub_url(name, "config.json"), timeout=HUB_CHECK_TIMEOUT_S)
        path = Path(hf_hub_download(name, "config.json", etag_timeout=HUB_CHECK_TIMEOUT_S))
        _, problems = model_check.json_problems(path.parent, trust_remote_code)
        if problems:  # not a causal LM, say: nothing more is asked of the Hub
            return _named(name, problems)
        files = [sibling.rfilename for sibling in HfApi().model_info(name, timeout=HUB_CHECK_TIMEOUT_S).siblings or []]
        file_problems = _hub_file_problems(name, files)
        hub_weights, header_problems = (None, []) if file_problems else _hub_weights(name, files)
    except (OSError, TransportError) as error:  # the Hub's own errors are OSErrors
        return _hub_problem(name, error)
    problems = model_check.check_folder(path.parent, trust_remote_code, config_only=True, hub_weights=hub_weights)
    return _named(name, problems) or file_problems or header_problems


def _hub_weights(name: str, files: list[str]) -> tuple[dict[str, list] | None, list[str]]:
    """({tensor name: [shape, file]} from the safetensors headers on the Hub, or None where it has
    only pytorch_model.bin, whose pickle has no header), and what is wrong with a header."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RemoteEntryNotFoundError, SafetensorsParsingError

    if not any(f in files for f in (model_check.SAFETENSORS, model_check.SAFETENSORS_INDEX)):
        return None, []
    try:
        found = HfApi().get_safetensors_metadata(name, timeout=HUB_CHECK_TIMEOUT_S)
    except SafetensorsParsingError as error:
        return None, [f"model_name_or_path: {name}: a weight file's header on the Hub cannot be read ({error}); "
                      "the repo's weights are damaged: tell its owner, or give another model"]
    except RemoteEntryNotFoundError as error:  # a shard its index names
        return None, [f"model_name_or_path: {name}: a weight file its {model_check.SAFETENSORS_INDEX} names is not "
                      f"on the Hub ({error.response.url if error.response is not None else error}); the repo is "
                      "incomplete: tell its owner, or give another model"]
    return {tensor: [info.shape, file] for file, metadata in found.files_metadata.items()
            for tensor, info in metadata.tensors.items()}, []


def _hub_file_problems(name: str, files: list[str]) -> list[str]:
    """A Hub model's weights and tokenizer, by the names of its files."""
    where = f"model_name_or_path: {name}"
    weights = (model_check.SAFETENSORS, model_check.SAFETENSORS_INDEX, *model_check.TORCH_WEIGHTS)
    if not any(f in files for f in weights):
        return [f"{where} has no weights on the Hub ({model_check.SAFETENSORS} or {model_check.TORCH_WEIGHTS[0]}, "
                "or their index and shards), so it cannot be loaded; check the id, or give a model that has them"]
    if not any(f in files for f in TOKENIZER_FILES):
        return [f"{where} has no tokenizer on the Hub (none of {', '.join(TOKENIZER_FILES)}); give a model that "
                "has one"]
    return []


def _hub_problem(name: str, error: Exception) -> list[str]:
    """What a failed request to the Hub means for the model, with what to do."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RemoteEntryNotFoundError, RepositoryNotFoundError

    where = f"model_name_or_path: {name}"
    login = "log in (hf auth login) or set HF_TOKEN to a token of an account that has access"
    if isinstance(error, GatedRepoError):
        return [f"{where} is gated on the Hub: accept its terms on its page, then {login}"]
    if isinstance(error, RepositoryNotFoundError):
        return [f"{where} not found on the Hub: check the id (owner/name, e.g. Qwen/Qwen3-0.6B); "
                f"if it is private, {login}"]
    if isinstance(error, RemoteEntryNotFoundError):
        return [f"{where} has no config.json on the Hub, so it is not a Transformers model; give one that "
                "has (a ...ForCausalLM), e.g. Qwen/Qwen3-0.6B"]
    if isinstance(error, HfHubHTTPError):
        status = error.response.status_code if error.response is not None else None
        if status in (401, 403):
            return [f"{where}: the Hub refused access ({status}); {login}"]
        return [f"{where}: the Hub answered {status} when asked about the model; try again later"]
    # unreachable, timed out, or its answer cut off
    return [f"{where} is not on this machine and the Hub ({constants.ENDPOINT}) cannot be reached "
            f"({type(error).__name__}: {error}): connect this machine to the Hub, or download the model where "
            f"the Hub can be reached (hf download {name}) and bring its folder here (or the Hugging Face cache, "
            "then set HF_HUB_OFFLINE=1); a plan for another instance type does not need it on this machine"]


def model_config(name: str) -> dict | None:
    """The model's config.json when it is on this machine (a folder, or the Hub cache), else None
    (also when it is not a JSON object: check_model says what is wrong with it).
    The built-in model's shape is known without building it."""
    if name == BUILTIN_MODEL:
        return {**TINY_ARCHITECTURE, "model_type": "qwen3", "vocab_size": TINY_VOCAB, "tie_word_embeddings": True}
    if name == BUILTIN_VLM:
        return TINY_VLM_CONFIG
    if _looks_local(name):
        path = Path(name).expanduser() / "config.json"
    else:
        path = _cached_config(name) if HUB_ID.match(name) else None
    return model_check.read_config(path)[0] if path else None


def cached_models(cache: str | Path | None = None) -> list[str]:
    """Models in the local Hugging Face cache, by Hub id: usable without the network."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        repos = scan_cache_dir(cache).repos
    except CacheNotFound:
        return []
    return sorted(repo.repo_id for repo in repos if repo.repo_type == "model" and _downloaded(repo.repo_id, cache))


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
