"""Built-in default model and datasets that work fully offline.

The studio must be usable (and testable) without access to the Hugging Face Hub.
This module provides:

* ``BUILTIN_MODEL`` - the id of a tiny Qwen3-architecture causal LM (~0.1M
  parameters) whose folder :func:`ensure_tiny_model` builds locally from
  scratch: a byte-level BPE tokenizer trained on the sample datasets, the Qwen3
  chat template that ships with ``trl``, and deterministically initialised
  weights. It is small enough to fine-tune on a CPU in seconds, and it
  memorises ``builtin:qa`` in a few hundred SFT steps.
* ``BUILTIN_DATASETS`` - small conversational JSONL datasets in TRL's formats, one per
  trainer: ``builtin:qa`` (made-up facts no base model knows, for checking that
  fine-tuning works) and ``builtin:chat`` (small talk) as ``{"messages": [...]}`` for
  SFT; ``builtin:preference`` (the same facts, prompt / chosen / rejected) for DPO and
  reward modeling; ``builtin:feedback`` (each chosen and rejected answer on its own, with a
  desirable ``label``: unpaired preference data) for KTO;
  ``builtin:prompts`` (the same questions as prompts, with a ``reference`` answer) for GRPO and RLOO.

Generation after SFT: the Qwen3 template renders the last assistant turn with an
empty ``<think>\\n\\n</think>\\n\\n`` block, so prompt with
``apply_chat_template(..., add_generation_prompt=True, enable_thinking=False)``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path

BUILTIN_MODEL = "builtin:tiny-qwen3"
# Bump when the recipe below changes, so a cached folder from an older recipe is not reused.
TINY_MODEL_FOLDER = "tiny-qwen3-v1"

_DATA_DIR = Path(__file__).parent / "data"
BUILTIN_DATASETS: dict[str, Path] = {
    "builtin:qa": _DATA_DIR / "qa.jsonl",
    "builtin:chat": _DATA_DIR / "chat.jsonl",
    "builtin:preference": _DATA_DIR / "preference.jsonl",  # DPO, reward modeling: prompt / chosen / rejected
    "builtin:feedback": _DATA_DIR / "feedback.jsonl",  # KTO: prompt / completion / label (unpaired)
    "builtin:prompts": _DATA_DIR / "prompts.jsonl",  # GRPO: prompt and a reference answer
}

# The tokenizer is trained on these (conversational "messages") samples.
CORPUS_DATASETS = ("builtin:chat", "builtin:qa")
_SEED = 0
# The tiny model's shape, known without building it (the layout check reads its heads)
TINY_ARCHITECTURE = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
# Serialises builds within one process: seeding torch's global RNG is not thread-safe.
_BUILD_LOCK = threading.Lock()
_VOCAB_SIZE = 1000
# Qwen3 registers <think>/</think> as added but non-special tokens, so
# decode(skip_special_tokens=True) keeps them; we do the same.
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_THINK_TOKENS = ["<think>", "</think>"]
_EOS, _PAD = "<|im_end|>", "<|endoftext|>"
# Qwen2/3's pre-tokenizer split. Unlike plain GPT-2 ByteLevel it keeps a newline run
# in one piece whether or not text follows, so the generation prompt's trailing
# "</think>\n\n" tokenizes exactly as it did inside the training sequences.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def cache_dir() -> Path:
    """Root of the studio's local cache (``$STUDIO_CACHE_DIR`` or ~/.cache/trn-studio)."""
    return Path(os.environ.get("STUDIO_CACHE_DIR", "~/.cache/trn-studio")).expanduser()


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def ensure_tiny_model(root: Path | None = None) -> Path:
    """Return the tiny model's folder, building it there on first use.

    ``root`` is the model folder itself (default ``cache_dir()/models/<TINY_MODEL_FOLDER>``).
    The build happens in a temporary sibling folder that is renamed into place,
    so concurrent callers (e.g. torchrun ranks) never see a half-written folder.
    """
    root = Path(root) if root is not None else cache_dir() / "models" / TINY_MODEL_FOLDER
    with _BUILD_LOCK:
        if _is_complete(root):
            return root
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared
        try:
            _build(tmp)
            try:
                os.rename(tmp, root)
            except OSError:
                # Another process renamed its build into place first: use theirs.
                if not _is_complete(root):
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    return root


def _chat_template() -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()


def _corpus(chat_template: str) -> list[str]:
    """Text of the sample datasets rendered through the chat template, special tokens removed."""
    import jinja2

    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(chat_template)
    split = re.compile("|".join(re.escape(t) for t in _SPECIAL_TOKENS + _THINK_TOKENS))
    pieces = []
    for name in CORPUS_DATASETS:  # the other samples reuse these facts
        for line in BUILTIN_DATASETS[name].read_text(encoding="utf-8").splitlines():
            messages = json.loads(line)["messages"]
            for rendered in (
                template.render(messages=messages, add_generation_prompt=False),
                template.render(messages=messages[:-1], add_generation_prompt=True, enable_thinking=False),
            ):
                pieces.extend(p for p in split.split(rendered) if p)
    return pieces


def _build_tokenizer():
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    chat_template = _chat_template()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(chat_template), trainer=trainer)
    # Register the markers on the `tokenizers` object itself, before wrapping.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in _THINK_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=_EOS,
        pad_token=_PAD,
        chat_template=chat_template,
        model_max_length=1024,
    )


def _build(folder: Path) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = _build_tokenizer()
    eos_id, pad_id = tokenizer.convert_tokens_to_ids([_EOS, _PAD])
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        **{k: v for k, v in TINY_ARCHITECTURE.items() if k != "architectures"},
        tie_word_embeddings=True,
        max_position_embeddings=1024,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = Qwen3ForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
