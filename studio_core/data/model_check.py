"""A model's folder, checked before anything loads it: a local folder, a model in the Hugging
Face cache, or (`config_only`) a Hub model's config.json fetched alone, with its weights' headers
read on the Hub (sources.check_model).

First here, with JSON only: config.json is an object of settings, its `architectures` a list
naming a causal LM, no code of its own unless that is allowed, its sizes whole numbers above 0;
the weight files are there (model.safetensors, or model.safetensors.index.json and every shard
it names, or pytorch_model.bin), each safetensors header reads and each file is as long as its
header says (a file cut off after its header is named incomplete). Then Transformers says the
rest, in a child process (model_child.py), as Transformers and torch stay out of the web app's
process: the config through AutoConfig (an architecture it knows), the weights' names and shapes
against the model that config builds on the meta device (no tensor is read or made), the
tokenizer through AutoTokenizer. A folder that passed is remembered in the studio's cache while
its files, the check and Transformers' version stay the same, so each plan does not ask again.

Checked less, and said so here (a damage left unchecked fails when the model loads):
- pytorch_model.bin (a pickle: never loaded before launch, as loading one can run code): only that
  it is there; not its tensors, their names and shapes, nor the shards of pytorch_model.bin.index.json.
- a quantized model (quantization_config): everything but the tensors' names and shapes (packed).
- a model with its own code (auto_map, allowed by trust_remote_code): the JSON checks and the
  weight files only; no AutoConfig, meta model or tokenizer, as its code is not run before launch.

A run's saved model (`output_problems`, for chat, evaluation and serving of a run) is checked by
its files only: the run wrote it with save_pretrained, Transformers took it then, and what can
change since is its files. Each problem is a phrase that follows the model's name.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

from studio_core.machine import children
from studio_core.machine.cache import cache_dir

# Sizes a config may hold (Transformers' names, and the older ones some families keep); each,
# when present and not null, a whole number above 0. Expert counts may be 0 (a dense model).
SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
         "moe_intermediate_size", "vocab_size", "head_dim", "max_position_embeddings",
         "n_embd", "n_layer", "n_head", "n_positions", "n_inner", "d_model", "num_layers", "num_heads", "ffn_dim")
COUNTS = ("num_experts", "num_local_experts")
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
TORCH_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # PEFT's save_pretrained
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on a header
SAVED_WHOLE = "give the whole folder save_pretrained wrote"
REDO = "download it again, or save the model again"  # a weight file cut off
CHECK_VERSION = 2  # bump when the checks change: a folder passed by older checks is checked again
CHILD_TIMEOUT_S = 180  # importing torch and Transformers on a busy machine, then a meta model
# Where a process keeps a child that has imported Transformers and torch already (the TRL config
# check's, recipe/trl_schema.py, which sets this), that child answers the check instead of a new
# one: check_here(ARGV, timeout) gives what `python -m studio_core.data.model_child ARGV` would
# (a CompletedProcess), or None, and then the model check's own child runs.
check_here: Callable[[list[str], float], subprocess.CompletedProcess | None] | None = None


def check_folder(folder: Path, trust_remote_code: bool = False, config_only: bool = False,
                 hub_weights: dict[str, list] | None = None) -> list[str]:
    """What stops the model in `folder` from loading, each a phrase after its name; [] when it
    loads. `config_only`: the folder holds config.json alone (a Hub model not downloaded), and
    `hub_weights` ({tensor name: [shape, file name]}, read from the headers on the Hub) stands for
    its weight files' headers, or None where the Hub has none to read (pytorch_model.bin)."""
    config, problems = json_problems(folder, trust_remote_code)
    if not problems and not config_only:
        problems = weight_file_problems(folder)
    if problems or (trust_remote_code and auto_map(config)):
        return problems  # a model's own code is not run before launch
    return transformers_problems(folder, config_only, hub_weights)


def json_problems(folder: Path, trust_remote_code: bool) -> tuple[dict | None, list[str]]:
    """(config.json's settings or None, what its JSON alone says is wrong): no child, no Transformers."""
    config, problems = read_config(folder / "config.json")
    return config, (config_problems(config, trust_remote_code) if config is not None else problems)


def read_config(path: Path) -> tuple[dict | None, list[str]]:
    """config.json as a dict, or None and what is wrong with it."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # ValueError: not JSON, or not UTF-8
        return None, [f"{path} is not readable JSON ({error}); give the config.json that save_pretrained wrote"]
    if not isinstance(config, dict):
        return None, [f"{path} holds {json_kind(config)}, not an object of settings ({{\"model_type\": ...}}); give "
                      "the config.json that save_pretrained wrote"]
    return config, []


def json_kind(value) -> str:
    if isinstance(value, list):
        return "a JSON array"
    if isinstance(value, str):
        return "a JSON string"
    if isinstance(value, bool) or value is None:
        return f"JSON {json.dumps(value)}"
    return f"the number {json.dumps(value)}"


def is_vision(config: dict) -> bool:
    """A vision-language model: its config holds a vision tower's (LLaVA, Qwen2.5-VL, Idefics3 and
    SmolVLM, Gemma 3 all write `vision_config`); Transformers' own mapping has the last word
    (model_child)."""
    return isinstance(config.get("vision_config"), dict)


def config_problems(config: dict, trust_remote_code: bool) -> list[str]:
    """A causal LM or a vision-language model, one that needs no code of its own unless that is
    allowed, with sane sizes."""
    architectures = config.get("architectures")
    if architectures is not None and not (isinstance(architectures, list)
                                          and all(isinstance(a, str) for a in architectures)):
        return [f"config.json's architectures is {architectures!r}; write a list of class names, e.g. "
                "[\"Qwen3ForCausalLM\"]"]
    generates = ("ForCausalLM", "LMHeadModel") + (("ForConditionalGeneration",) if is_vision(config) else ())
    if architectures and not any(a.endswith(generates) for a in architectures):
        return [f"it is a {', '.join(architectures)}, not a causal language model; SFT, DPO and GRPO train causal "
                "LMs (a ...ForCausalLM), e.g. Qwen/Qwen3-0.6B, or vision-language models (a "
                "...ForConditionalGeneration with a vision_config), e.g. HuggingFaceTB/SmolVLM-256M-Instruct"]
    if "AutoModelForCausalLM" in auto_map(config) and not trust_remote_code:
        return ["it runs its own Python code (auto_map in config.json); set trust_remote_code: true only if you "
                "trust its authors"]
    return size_problems(config)


def auto_map(config: dict) -> dict:
    """The classes of the model's own code that config.json names (its auto_map)."""
    found = config.get("auto_map")
    return found if isinstance(found, dict) else {}


def size_problems(config: dict) -> list[str]:
    """Each size of the config (and of its text_config) that is not a whole number above 0."""
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        return [f"config.json's text_config is {text!r}, not an object of settings; give the config.json that "
                "save_pretrained wrote"]
    problems = []
    for prefix, section in (("", config), ("text_config.", text or {})):
        found = [(key, size_problem(key, section.get(key))) for key in SIZES] + [
            (key, size_problem(key, section.get(key), least=0)) for key in COUNTS]
        problems += [f"config.json's {prefix}{said}; write the model's own size there, a whole number like 2048 "
                     "(no quotes, no decimals)" for key, said in found if said]
    return problems


def size_problem(key: str, value, least: int = 1) -> str | None:
    """None for a size that is absent (null) or a whole number of at least `least`, else what it is."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= least):
        return None
    return f"{key} is {value!r}, not a whole number {'above 0' if least == 1 else 'of 0 or more'}"


def has_weights(folder: Path) -> bool:
    return any((folder / name).is_file() for name in (SAFETENSORS, SAFETENSORS_INDEX, *TORCH_WEIGHTS))


def weight_file_problems(folder: Path, fix: str = REDO) -> list[str]:
    """Weight files there, every shard an index names there, each safetensors file whole (header_problems)."""
    if not has_weights(folder):
        return [f"it has a config.json but no weights ({SAFETENSORS}, or {SAFETENSORS_INDEX} and its shards, or "
                f"{TORCH_WEIGHTS[0]}); {SAVED_WHOLE}, or copy its weight files in"]
    files, problems = safetensors_files(folder)
    return problems + header_problems(files, fix)


def header_problems(files: list[Path], fix: str = REDO) -> list[str]:
    """Each safetensors file's header readable, and the file as long as it says (no tensor read);
    `fix`: what to do with a file cut off."""
    problems = []
    for path in files:
        try:
            read_header(path)
        except Incomplete as error:
            problems.append(f"{path} is incomplete ({error}): its download or save was cut off; {fix}")
        except ValueError as error:
            problems.append(f"{path} is not a readable safetensors file ({error}); copy it again from where the "
                            "model was saved")
    return problems


def output_problems(folder: Path, adapter: bool) -> list[str]:
    """A run's saved model (a LoRA run's adapter) by its files: config.json, the weight files, each
    safetensors file's header and length. The run wrote it with save_pretrained: Transformers'
    side is not asked again."""
    fix = "copy the run's output folder back whole, or train the run again"
    if not adapter:
        _, problems = read_config(folder / "config.json")
        return problems or weight_file_problems(folder, fix)
    found = [folder / name for name in ADAPTER_WEIGHTS if (folder / name).is_file()]
    if not found:
        return [f"it has no adapter weights ({ADAPTER_WEIGHTS[0]}); {fix}"]
    return header_problems([path for path in found if path.suffix == ".safetensors"], fix)


def safetensors_files(folder: Path) -> tuple[list[Path], list[str]]:
    """The safetensors files Transformers loads the model from (model.safetensors first, as it
    does, else the shards of the index; none for pytorch_model.bin), and what is wrong with them."""
    if (folder / SAFETENSORS).is_file():
        return [folder / SAFETENSORS], []
    index = folder / SAFETENSORS_INDEX
    if not index.is_file():
        return [], []
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return [], [f"{index} is not a readable index of weight shards ({type(error).__name__}: {error}); copy it "
                    "again from where the model was saved"]
    missing = [name for name in shards if not (folder / str(name)).is_file()]
    if missing:
        return [], [f"{len(missing)} of the {len(shards)} weight shards its {SAFETENSORS_INDEX} names are not in "
                    f"{folder} ({', '.join(map(str, missing[:3]))}{', ...' if len(missing) > 3 else ''}); copy them "
                    "in, or download the model again"]
    return [folder / name for name in shards], []


class Incomplete(ValueError):
    """A safetensors file shorter than its header says: the end of its tensors is missing."""


def read_header(path: Path) -> dict[str, list[int]]:
    """{tensor name: shape} from a safetensors file's JSON header (its 8-byte length, then the JSON);
    no tensor is read. ValueError says what is wrong; Incomplete when the file ends before the
    tensors its header places (data_offsets) do."""
    with path.open("rb") as handle:
        start = handle.read(8)
        if len(start) < 8:
            raise ValueError(f"{len(start)} bytes, shorter than a header")
        size = int.from_bytes(start, "little")
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"its header claims {size} bytes")
        raw = handle.read(size)
    if len(raw) < size:
        raise ValueError("it ends inside its header")
    header = json.loads(raw)  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    shapes, end = {}, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise ValueError(f"its header gives tensor {name} no shape")
        offsets = entry.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) for n in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"its header gives tensor {name} no place in the file (data_offsets)")
        shapes[name] = shape
        end = max(end, offsets[1])
    length = path.stat().st_size
    if 8 + size + end > length:
        raise Incomplete(f"its header says its tensors end at byte {8 + size + end}, the file has {length} bytes")
    return shapes


def transformers_problems(folder: Path, config_only: bool, hub_weights: dict | None = None) -> list[str]:
    """What Transformers finds (model_child.py, in a child process); a pass is remembered."""
    checks = cache_dir() / "model-checks"
    key = stamp(folder, config_only, hub_weights)
    passed = checks / f"{key}.passed"
    if passed.exists():
        return []
    args: list[object] = ["--config-only"] if config_only else []
    if hub_weights:  # too long for a command line: a file beside the passes, gone after the check
        checks.mkdir(parents=True, exist_ok=True)
        weights_file = checks / f"{key}.{os.getpid()}.hub-weights.json"
        weights_file.write_text(json.dumps(hub_weights), encoding="utf-8")
        args += ["--hub-weights", weights_file]
    try:
        done = check_here([str(folder), *map(str, args)], CHILD_TIMEOUT_S) if check_here else None
        if done is None:
            done = children.run("studio_core.data.model_child", folder, *args,
                                env={"HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [f"Transformers' check of it did not finish within {CHILD_TIMEOUT_S} s (is the machine very busy?); "
                "try again"]
    finally:
        if hub_weights:
            weights_file.unlink(missing_ok=True)
    problems = answer(done)
    if problems is None:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return [f"Transformers' check of it failed ({tail}); {SAVED_WHOLE}"]
    if not problems:
        passed.parent.mkdir(parents=True, exist_ok=True)
        passed.touch()
    return problems


def answer(done: subprocess.CompletedProcess) -> list[str] | None:
    """The child's list of problems (its last line of output), or None where it gave none."""
    lines = done.stdout.strip().splitlines()
    try:
        problems = json.loads(lines[-1]) if done.returncode == 0 and lines else None
    except ValueError:
        return None
    return problems if isinstance(problems, list) and all(isinstance(p, str) for p in problems) else None


def stamp(folder: Path, config_only: bool, hub_weights: dict | None = None) -> str:
    """The check's and Transformers' versions and what is checked, as one key: config.json's text
    and the Hub's weight headers (the same config passes wherever it is), else the folder and its
    files' sizes and times."""
    if config_only:
        checked = ["config", hashlib.sha256((folder / "config.json").read_bytes()).hexdigest(), hub_weights]
    else:
        checked = [str(folder.resolve()), sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                                                 for p in folder.iterdir() if p.is_file())]
    key = [CHECK_VERSION, version("transformers"), *checked]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]
