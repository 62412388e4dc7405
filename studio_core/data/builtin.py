"""Built-in default model and datasets that work fully offline.

The studio must be usable (and testable) without access to the Hugging Face Hub.
This module provides:

* ``BUILTIN_MODEL`` - the id of a tiny Qwen3-architecture causal LM (~0.2M
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
  ``builtin:wide`` (:func:`ensure_wide_sample`): 2,000 SFT conversations of 20 to 2,000 tokens,
  made on first use into the cache, for what a real chat set's spread of lengths does to
  compilations and padding.

Generation after SFT: the Qwen3 template renders the last assistant turn with an
empty ``<think>\\n\\n</think>\\n\\n`` block, so prompt with
``apply_chat_template(..., add_generation_prompt=True, enable_thinking=False)``.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

from studio_core.data.builtin_images import IMAGE_DATASET, ensure_shapes_dataset
from studio_core.machine.cache import build_atomically, cache_dir, one_maker

BUILTIN_MODEL = "builtin:tiny-qwen3"
# Bump when the recipe below changes, so a cached folder from an older recipe is not reused.
TINY_MODEL_FOLDER = "tiny-qwen3-v2"

_DATA_DIR = Path(__file__).parent / "samples"
_SAMPLE_FILES: dict[str, Path] = {
    "builtin:qa": _DATA_DIR / "qa.jsonl",
    "builtin:chat": _DATA_DIR / "chat.jsonl",
    "builtin:preference": _DATA_DIR / "preference.jsonl",  # DPO, reward modeling: prompt / chosen / rejected
    "builtin:feedback": _DATA_DIR / "feedback.jsonl",  # KTO: prompt / completion / label (unpaired)
    "builtin:prompts": _DATA_DIR / "prompts.jsonl",  # GRPO: prompt and a reference answer
}
WIDE_DATASET = "builtin:wide"
# Bump when the wide sample's recipe (or the tokenizer it counts with) changes.
WIDE_SAMPLE_FILE = "wide-v1.jsonl"


class _BuiltinDatasets(Mapping):
    """Name -> the JSONL file. The wide sample is made on first lookup (a few MB: generated
    into the cache rather than committed), so every reader of a path finds the file there."""

    def __getitem__(self, name: str) -> Path:
        if name == WIDE_DATASET:
            return ensure_wide_sample()
        if name == IMAGE_DATASET:  # images made on first use
            return ensure_shapes_dataset() / "train.jsonl"
        return _SAMPLE_FILES[name]

    def __contains__(self, name) -> bool:  # without making the file
        return name in _SAMPLE_FILES or name in (WIDE_DATASET, IMAGE_DATASET)

    def __iter__(self):
        return iter([*_SAMPLE_FILES, WIDE_DATASET, IMAGE_DATASET])

    def __len__(self) -> int:
        return len(_SAMPLE_FILES) + 2


BUILTIN_DATASETS: Mapping[str, Path] = _BuiltinDatasets()

# The tokenizer is trained on these (conversational "messages") samples.
CORPUS_DATASETS = ("builtin:chat", "builtin:qa")
_SEED = 0
# The tiny model's shape, known without building it (the layout check reads its heads)
# head_dim 64, not hidden_size / heads (16): vLLM's CPU attention serves head sizes of 32 and up only
TINY_ARCHITECTURE = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
TINY_VOCAB = 1002  # its tokenizer's: the 1000 of _VOCAB_SIZE, and the added tokens that are not special
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


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def ensure_tiny_model(root: Path | None = None) -> Path:
    """Return the tiny model's folder, building it there on first use.

    ``root`` is the model folder itself (default ``cache_dir()/models/<TINY_MODEL_FOLDER>``).
    The build happens in a temporary sibling folder that is renamed into place,
    so concurrent callers (e.g. torchrun ranks) never see a half-written folder.
    """
    root = Path(root) if root is not None else cache_dir() / "models" / TINY_MODEL_FOLDER
    if _is_complete(root):
        return root
    with _BUILD_LOCK:  # it seeds torch's global RNG
        return build_atomically(root, _is_complete, _build)


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


# --- builtin:wide: a sample with a long-tailed spread of lengths ---------------------------------
# Token lengths (the tiny tokenizer and chat template, as SFT counts them) are drawn from a
# log-normal: median 250, sigma 0.9, clipped to 20..2000. That is the shape length histograms of
# public chat SFT sets tend to have (a bulk of short-to-middle conversations, a long right tail),
# not the statistics of any one set: the median and spread are chosen, not measured. With
# these figures about 6% of the rows are over 1,000 tokens and about 1% reach the 2,000 clip.
WIDE_ROWS, WIDE_MEDIAN, WIDE_SIGMA, WIDE_MIN, WIDE_MAX = 2000, 250, 0.9, 20, 2000
_WIDE_SEED = 1
_WIDE_SOURCES = ("builtin:qa", "builtin:chat", "builtin:preference", "builtin:feedback", "builtin:prompts")


def ensure_wide_sample(path: Path | None = None) -> Path:
    """Return the ``builtin:wide`` JSONL file, making it on first use (default
    ``cache_dir()/data/<WIDE_SAMPLE_FILE>``). The same bytes on every machine with the same
    library versions: a seeded draw, counted with the tiny model's tokenizer, built here
    (no model needed). Written to a temporary sibling and renamed into place, so concurrent
    callers (torchrun ranks, the page) never read half a file."""
    path = Path(path) if path is not None else cache_dir() / "data" / WIDE_SAMPLE_FILE
    if path.is_file():
        return path
    with _BUILD_LOCK, one_maker(f"data-{path.name}"):
        if path.is_file():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps({"messages": messages}) + "\n" for messages in _wide_conversations())
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(text)
            os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the cache may be shared
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def _sample_turns() -> tuple[list[str], list[str]]:
    """(user turns, assistant turns) of the other built-in samples, each once, in file order."""
    users, assistants = {}, {}
    for name in _WIDE_SOURCES:
        for line in _SAMPLE_FILES[name].read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            turns = row.get("messages") or [*row.get("prompt", []), *row.get("chosen", []),
                                            *row.get("rejected", []), *row.get("completion", [])]
            for turn in turns:
                if turn["role"] in ("user", "assistant"):  # not the system prompts
                    (users if turn["role"] == "user" else assistants)[turn["content"]] = None
            if "reference" in row:
                assistants[row["reference"]] = None
    return list(users), list(assistants)


def _wide_conversations() -> list[list[dict]]:
    import random

    tokenizer = _build_tokenizer()
    empty = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
    overhead = len(tokenizer.apply_chat_template(empty, tokenize=True, return_dict=True)["input_ids"])
    counts: dict[str, int] = {}

    def count(piece: str) -> int:  # the pre-tokenizer splits at each word, so counts add up
        if piece not in counts:
            counts[piece] = len(tokenizer(piece, add_special_tokens=False)["input_ids"])
        return counts[piece]

    def fill(turns: list[str], budget: int) -> tuple[str, int]:
        """Words of randomly drawn turns, up to exactly `budget` tokens where words allow."""
        words, used, misses = [], 0, 0
        while used < budget and misses < 50:
            for word in rng.choice(turns).split():
                n = count(word if not words else " " + word)
                if used + n <= budget:
                    words.append(word)
                    used += n
                else:
                    misses += 1
                if used == budget:
                    break
        if not words:
            raise RuntimeError(f"wide sample: no word fits in {budget} tokens")
        return " ".join(words), used

    rng = random.Random(_WIDE_SEED)
    users, assistants = _sample_turns()
    rows = []
    for _ in range(WIDE_ROWS):
        length = round(rng.lognormvariate(math.log(WIDE_MEDIAN), WIDE_SIGMA))
        content = min(max(length, WIDE_MIN), WIDE_MAX) - overhead
        question, asked = fill(users, max(3, round(content * rng.uniform(0.05, 0.4))))
        answer, _ = fill(assistants, content - asked)
        rows.append([{"role": "user", "content": question}, {"role": "assistant", "content": answer}])
    return rows
