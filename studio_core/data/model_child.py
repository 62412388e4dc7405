"""The model check's Transformers side, in a child process (model_check.transformers_problems
starts it, or has the TRL config check's child, where one is up, run `main` in it), so that
Transformers and torch stay out of the web app's process:

    python -m studio_core.data.model_child FOLDER [--config-only [--hub-weights FILE]]

prints a JSON list of problems, each a phrase after the model's name ([]: Transformers takes it).
The config through AutoConfig (an architecture this Transformers knows, its own validation of the
fields, sizes whole numbers above 0 by Transformers' names); unless --config-only, the weights'
names and shapes (the safetensors headers; not of pytorch_model.bin, nor of a quantized model)
against the model the config builds on the meta device, each name mapped as Transformers' loader
maps it (its renamings, the base model's prefix), and the tokenizer through AutoTokenizer. A Hub
model not downloaded (--config-only) has its weights' names and shapes checked where the studio
read their headers on the Hub (--hub-weights: a JSON {name: [shape, file]}); its tokenizer is not
on this machine to load. No tensor is read or made; the tokenizer is loaded.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from studio_core.data.model_check import SAVED_WHOLE, read_header, safetensors_files, size_problem

TEXT_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "vocab_size", "head_dim")
SHOWN = 3  # names shown of a list of tensors


def problems(folder: Path, config_only: bool, hub_weights: Path | None = None) -> list[str]:
    config, found = load_config(folder)
    if found or (config_only and hub_weights is None):
        return found
    model, found = meta_model(config)
    if found:
        return found
    if hub_weights is not None:
        saved = {name: (shape, file) for name, (shape, file) in json.loads(hub_weights.read_text()).items()}
        return weight_problems(model, saved)
    files, _ = safetensors_files(folder)  # model_check has said what is wrong with them
    saved = {name: (shape, path.name) for path in files for name, shape in read_header(path).items()}
    vision = getattr(model.config, "vision_config", None) is not None
    return weight_problems(model, saved) + (processor_problems(folder) if vision else tokenizer_problems(folder))


def load_config(folder: Path):
    """(the config, []) or (None, what is wrong): AutoConfig's answer, then the sizes it resolved."""
    from transformers import AutoConfig, __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    if not model_type:
        return None, ["config.json names no model_type, which Transformers needs to know the architecture; "
                      f"{SAVED_WHOLE}"]
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return None, [f"its model_type {model_type!r} is not an architecture Transformers {__version__} knows: if "
                      "the model is newer than it, upgrade Transformers (pip install -U transformers); else give a "
                      "model of a known architecture, e.g. Qwen/Qwen3-0.6B"]
    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as error:  # Transformers' own validation, in whatever type it raises
        return None, [f"Transformers does not take its config.json ({one_line(error)}); {SAVED_WHOLE}"]
    text = config.get_text_config()
    sizes = [size_problem(key, getattr(text, key, None)) for key in TEXT_SIZES]
    return config, [f"its config's {said}; write the model's own size in config.json" for said in sizes if said]


def meta_model(config):
    """The causal LM (or vision-language model: a config with a vision tower's) the config
    describes, on the meta device (shapes only, no memory)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING)

    vision = getattr(config, "vision_config", None) is not None
    mapping, auto = ((MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING, AutoModelForImageTextToText) if vision
                     else (MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM))
    if type(config) not in mapping:
        what = "vision-language model (image-text-to-text)" if vision else "causal language model"
        return None, [f"Transformers has no {what} for its model_type {config.model_type!r}; give a "
                      "causal LM (a ...ForCausalLM), e.g. Qwen/Qwen3-0.6B, or a vision-language model Transformers "
                      "loads with AutoModelForImageTextToText"]
    try:
        with torch.device("meta"):
            return auto.from_config(config), []
    except Exception as error:  # whatever the model's own constructor raises on this config
        return None, [f"Transformers cannot build the model its config.json describes ({one_line(error)}); "
                      f"{SAVED_WHOLE}"]


def weight_problems(model, saved: dict[str, tuple[list[int], str]]) -> list[str]:
    """The saved tensors ({name: (shape, file name)}) against the model's parameters: none missing,
    none of another shape. Not for quantized weights (packed shapes) nor pytorch_model.bin (a
    pickle, never loaded here: it has no header to read, so `saved` is empty)."""
    if getattr(model.config, "quantization_config", None) or not saved:
        return []
    expected = {name: list(parameter.shape) for name, parameter in model.named_parameters()}  # tied ones once
    mapped = loaded_names(model, list(saved))
    found = {name for name, _ in mapped.values() if name is not None}
    unexpected = sorted(key for key, (name, _) in mapped.items() if name is None)
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or []]
    missing = sorted(n for n in expected if n not in found and not any(p.search(n) for p in ignored))
    wrong = [(key, saved[key], expected[name]) for key, (name, converted) in sorted(mapped.items())
             if name in expected and not converted and saved[key][0] != expected[name]]
    if wrong:
        key, (shape, file), should = wrong[0]
        more = f" ({len(wrong)} tensors differ)" if len(wrong) > 1 else ""
        return [f"its weights do not fit its config.json: {key} is {shape} in {file}, the config makes it "
                f"{should}{more}; config.json and the weights are of different models: give the config.json saved "
                "with these weights"]
    if missing:
        instead = f", and hold {len(unexpected)} it does not know ({listed(unexpected)})" if unexpected else ""
        return [f"its weights lack {len(missing)} tensor(s) of the model its config.json describes "
                f"({listed(missing)}){instead}: a weight file was changed, or is of another model; {SAVED_WHOLE}"]
    return []


def loaded_names(model, keys: list[str]) -> dict[str, tuple[str | None, bool]]:
    """{saved name: (the model's name for it or None, whether a converter merges it with others)},
    as Transformers' loader maps them (core_model_loading.convert_and_load_state_dict_in_model)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    state = model.state_dict()
    prefix = model.base_model_prefix
    mapped = {}
    for key in keys:
        name, pattern = rename_source_key(key, renamings, converters, prefix, state)
        if name not in state and key in state:
            name, pattern = rename_source_key(key, [], [], prefix, state)
        mapped[key] = (name if name in state else None, pattern is not None)
    return mapped


def tokenizer_problems(folder: Path) -> list[str]:
    """AutoTokenizer loads it, and it has a vocabulary: Transformers makes an empty tokenizer of
    the model's family for a folder without tokenizer files, which encodes text to nothing."""
    from transformers import AutoTokenizer

    save = ("copy in the tokenizer files saved with the model (tokenizer.save_pretrained writes them: "
            "tokenizer.json, tokenizer_config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as error:  # a tokenizer's loading raises many types
        return [f"its tokenizer does not load ({one_line(error)}); {save}"]
    if not tokenizer("Hello world", add_special_tokens=False)["input_ids"]:
        return [f"it has no tokenizer (AutoTokenizer makes an empty one: it encodes text to no tokens); {save}"]
    return []


def processor_problems(folder: Path) -> list[str]:
    """A vision-language model's processor loads through AutoProcessor and has both halves: an
    image processor for its pictures and a tokenizer for its text."""
    from transformers import AutoProcessor

    save = "copy in the processor files saved with the model (processor.save_pretrained writes them)"
    try:
        processor = AutoProcessor.from_pretrained(folder)
    except Exception as error:  # a processor's loading raises many types
        if isinstance(error, ImportError) and "torchvision" in str(error).lower():
            return [torchvision_missing()]
        return [f"its processor does not load ({one_line(error)}); {save}"]
    missing = [part for part in ("image_processor", "tokenizer") if getattr(processor, part, None) is None]
    if missing:
        return [f"its processor has no {' and no '.join(missing)} (AutoProcessor gave a "
                f"{type(processor).__name__}); {save}"]
    return []


def listed(names: list[str]) -> str:
    return ", ".join(names[:SHOWN]) + (", ..." if len(names) > SHOWN else "")


def torchvision_missing() -> str:
    """What to do when a processor needs torchvision and this Python has none. Transformers 5 builds
    Qwen2-VL's, Qwen2.5-VL's and SmolVLM2's processors with a video processor that imports it. The
    studio does not install it: the package index's builds are CUDA ones, which fail to load beside
    a CPU build of torch (and then break Transformers' image code). torchvision's release pairs with
    torch's by its minor number plus 15 (torch 2.13 with torchvision 0.28), PyTorch's own table."""
    import torch

    minor = int(torch.__version__.split(".")[1])
    return (f"its processor needs torchvision (Transformers builds its video processor with it), which this "
            f"Python does not have: install the torchvision built for this torch {torch.__version__.split('+')[0]} "
            f"(`pip install torchvision==0.{minor + 15}.*`; for a CPU build of torch, from PyTorch's CPU index "
            "https://download.pytorch.org/whl/cpu), or pick a model whose processor needs none (LLaVA's, for one)")


def one_line(error: BaseException) -> str:
    """An error as one short line: its type and the first line of its message."""
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {first[:300]}" if first else type(error).__name__


def main(argv: list[str]) -> None:
    hub_weights = Path(argv[argv.index("--hub-weights") + 1]) if "--hub-weights" in argv else None
    print(json.dumps(problems(Path(argv[0]), "--config-only" in argv[1:], hub_weights)))


if __name__ == "__main__":
    from studio_core.machine.children import collection_off, skip_final_collection

    skip_final_collection()
    collection_off()  # for its whole life: it gives one short answer and ends (children.py)
    main(sys.argv[1:])
