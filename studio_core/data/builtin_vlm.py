"""``builtin:tiny-vlm``: a tiny vision-language model built offline from a config.

A LLaVA (:func:`ensure_tiny_vlm`): a SigLIP vision tower (32x32 pixel images, 4x4 patches, so
always ``VLM_IMAGE_TOKENS`` = 64 image tokens per image: a static shape, as Trainium wants), a
two-layer MLP projector and a Qwen3 text model shaped like ``builtin:tiny-qwen3``, with seeded
random weights. LLaVA over the other families TRL documents because its image token count is
fixed by the image size alone (Qwen2.5-VL's follows each image's size, and needs rope position
ids of its own). Its tokenizer is the tiny model's (:mod:`studio_core.data.builtin`) plus an
``<image>`` special token; its ChatML chat template renders ``{"type": "image"}`` content parts
as ``<image>`` (which the processor expands to 64 tokens) and wraps assistant turns in
``{% generation %}`` markers, so SFT's ``assistant_only_loss`` works. It loads with plain
``AutoModelForImageTextToText.from_pretrained(folder)`` and ``AutoProcessor.from_pretrained(folder)``,
and learns ``builtin:shapes`` (:mod:`studio_core.data.builtin_images`): bench/vlm_learns.py.
"""

from __future__ import annotations

from pathlib import Path

from studio_core.data.builtin import _BUILD_LOCK, TINY_ARCHITECTURE, ensure_tiny_model
from studio_core.data.builtin_images import IMAGE_SIZE
from studio_core.machine.cache import build_atomically, cache_dir

BUILTIN_VLM = "builtin:tiny-vlm"
# Bump when a recipe below changes, so a cached folder from an older recipe is not reused.
TINY_VLM_FOLDER = "tiny-vlm-v1"

VLM_IMAGE_SIZE = IMAGE_SIZE  # pixels, each side; the processor resizes every image to this
VLM_PATCH_SIZE = 4
VLM_IMAGE_TOKENS = (VLM_IMAGE_SIZE // VLM_PATCH_SIZE) ** 2
IMAGE_TOKEN = "<image>"
VLM_VOCAB = 1003  # the tiny model's 1,002 and <image>
# The tiny VLM's shape, known without building it (the plan reads it in the web app's process)
TINY_VLM_VISION = {"model_type": "siglip_vision_model", "hidden_size": 64, "intermediate_size": 128,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": VLM_IMAGE_SIZE,
                   "patch_size": VLM_PATCH_SIZE, "num_channels": 3}
TINY_VLM_CONFIG = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
                   "vision_config": TINY_VLM_VISION, "image_seq_length": VLM_IMAGE_TOKENS,
                   "tie_word_embeddings": True,
                   "text_config": {**{k: v for k, v in TINY_ARCHITECTURE.items() if k != "architectures"},
                                   "model_type": "qwen3", "vocab_size": VLM_VOCAB,
                                   "tie_word_embeddings": False}}  # as Transformers writes it: the top level ties
_SEED = 0

# ChatML like Qwen's, with image parts and generation markers (for assistant-only loss).
VLM_CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}{{ '" + IMAGE_TOKEN + "\\n' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- generation -%}{{ render(message['content']) + '<|im_end|>\\n' }}{%- endgeneration -%}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + render(message['content']) + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


# --- builtin:tiny-vlm ----------------------------------------------------------------------------


def _vlm_is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in ("config.json", "model.safetensors", "processor_config.json"))


def ensure_tiny_vlm(root: Path | None = None) -> Path:
    """Return the tiny VLM's folder (default ``cache_dir()/models/<TINY_VLM_FOLDER>``), building it on first use."""
    root = Path(root) if root is not None else cache_dir() / "models" / TINY_VLM_FOLDER
    if _vlm_is_complete(root):
        return root
    text_folder = ensure_tiny_model()  # before the lock: it takes the same one
    with _BUILD_LOCK:  # it seeds torch's global RNG
        return build_atomically(root, _vlm_is_complete, lambda folder: _build_vlm(folder, text_folder))


def _build_vlm(folder: Path, text_folder: Path) -> None:
    import torch
    from transformers import (AutoTokenizer, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor,
                              Qwen3Config, SiglipImageProcessorPil, SiglipVisionConfig)

    tokenizer = AutoTokenizer.from_pretrained(text_folder)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    image_processor = SiglipImageProcessorPil(
        size={"height": VLM_IMAGE_SIZE, "width": VLM_IMAGE_SIZE},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=VLM_PATCH_SIZE,
        vision_feature_select_strategy="full",  # SigLIP has no CLS token to drop
        chat_template=VLM_CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
    )

    if len(tokenizer) != VLM_VOCAB:
        raise RuntimeError(f"the tiny VLM's tokenizer has {len(tokenizer)} tokens, not {VLM_VOCAB}")
    text_config = Qwen3Config(
        vocab_size=VLM_VOCAB,
        **{key: TINY_ARCHITECTURE[key] for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                   "num_attention_heads", "num_key_value_heads", "head_dim")},
        max_position_embeddings=1024,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision_config = SiglipVisionConfig(**{k: v for k, v in TINY_VLM_VISION.items() if k != "model_type"})
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=VLM_IMAGE_TOKENS,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        tie_word_embeddings=True,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = LlavaForConditionalGeneration(config).to(torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder, safe_serialization=True)
    processor.save_pretrained(folder)
