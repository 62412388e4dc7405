"""``builtin:shapes``: a generated image dataset for vision-language fine-tuning, offline.

PNG images of one coloured shape (circle, square or triangle; red, green or blue) of random size
and place on a light grey background, with ``train.jsonl`` (900 rows) and ``test.jsonl`` (180)
in TRL's vision format: ``messages`` whose user turn has an ``{"type": "image"}`` part, and
``images``, paths relative to the JSONL's folder. The answer is ``"a <colour> <shape>"``, so
guessing scores 1 in 9. Made on first use into the cache, the same bytes every time (a seeded
draw). TRL's SFTTrainer reads image paths relative to the working directory: the studio's loader
(training/train_data.py) resolves them against the JSONL's folder; :func:`load_shapes_split`
does the same for a script.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from studio_core.machine.cache import build_atomically, cache_dir

IMAGE_DATASET = "builtin:shapes"
SHAPES_FOLDER = "shapes-v1"  # bump when the draw below changes
IMAGE_SIZE = 32  # pixels, each side


# --- builtin:shapes ------------------------------------------------------------------------------

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220)}
QUESTIONS = ("What shape is this?", "What is in the picture?", "Describe the image.")
SHAPES_TRAIN_ROWS, SHAPES_TEST_ROWS = 900, 180
_SHAPES_SEED = 2
_DRAW_SCALE = 4  # drawn this many times larger, then downsampled: smooth edges


def _shapes_is_complete(folder: Path) -> bool:
    return (folder / "train.jsonl").is_file() and (folder / "test.jsonl").is_file()


def ensure_shapes_dataset(root: Path | None = None) -> Path:
    """Return the ``builtin:shapes`` folder (default ``cache_dir()/data/<SHAPES_FOLDER>``), making it on
    first use: ``images/*.png``, ``train.jsonl`` and ``test.jsonl``. A seeded draw: the same rows every time."""
    root = Path(root) if root is not None else cache_dir() / "data" / SHAPES_FOLDER
    if _shapes_is_complete(root):
        return root
    return build_atomically(root, _shapes_is_complete, _build_shapes)


def _draw(shape: str, colour: tuple[int, int, int], rng: random.Random):
    from PIL import Image, ImageDraw

    big = IMAGE_SIZE * _DRAW_SCALE
    grey = rng.randint(200, 255)
    image = Image.new("RGB", (big, big), (grey, grey, grey))
    side = rng.uniform(0.5, 0.9) * big
    left, top = rng.uniform(0, big - side), rng.uniform(0, big - side)
    fill = tuple(min(255, max(0, c + rng.randint(-25, 25))) for c in colour)
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse((left, top, left + side, top + side), fill=fill)
    elif shape == "square":
        draw.rectangle((left, top, left + side, top + side), fill=fill)
    else:
        draw.polygon([(left + side / 2, top), (left, top + side), (left + side, top + side)], fill=fill)
    return image.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.LANCZOS)


def _build_shapes(folder: Path) -> None:
    rng = random.Random(_SHAPES_SEED)
    (folder / "images").mkdir()
    classes = [(colour, shape) for colour in COLOURS for shape in SHAPES]
    splits = {"train": SHAPES_TRAIN_ROWS, "test": SHAPES_TEST_ROWS}
    number = 0
    for split, rows in splits.items():
        lines = []
        for row in range(rows):
            colour, shape = classes[row % len(classes)]  # balanced classes
            number += 1
            name = f"images/{number:04d}.png"
            _draw(shape, COLOURS[colour], rng).save(folder / name)
            messages = [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": rng.choice(QUESTIONS)}]},
                {"role": "assistant", "content": [{"type": "text", "text": f"a {colour} {shape}"}]},
            ]
            lines.append(json.dumps({"messages": messages, "images": [name]}))
        rng.shuffle(lines)
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def load_shapes_split(split: str, root: Path | None = None):
    """A ``datasets.Dataset`` of one split whose ``images`` column holds PIL images, as
    TRL's SFTTrainer wants (it passes strings on to the processor, which would read them
    relative to the working directory)."""
    from datasets import Image, List, load_dataset

    folder = ensure_shapes_dataset(root)
    dataset = load_dataset("json", data_files=str(folder / f"{split}.jsonl"), split="train")
    dataset = dataset.map(lambda row: {"images": [str(folder / path) for path in row["images"]]})
    return dataset.cast_column("images", List(Image()))
