"""What the Train tab's "Check dataset" shows of a vision dataset beside its first rows: the rows'
images as small captioned thumbnails, and each image's name for the preview table. Images are read
from files only, from the data file's folder as the run's loader takes them
(training/train_data.with_images); a URL is never fetched. Pillow is imported when an image is
opened.
"""

from __future__ import annotations

import io
from pathlib import Path

from studio_core.data.files import read_rows
from studio_core.recipe import data_check, data_scan

THUMBNAIL_PIXELS = 128  # a thumbnail's longer side, at most
CAPTION_CHARS = 40  # a thumbnail's caption: its row number and the start of the row's first user text


def image_refs(value) -> list:
    """A record's images as a list: TRL's `images` column holds a list of them, `image` one."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def image_name(ref) -> str:
    """How the preview names an image: its file's name, a URL as it is, an inline one in words."""
    path = ref.get("path") if isinstance(ref, dict) else ref
    if not isinstance(path, str) or not path:
        return "(image bytes)"
    if path.startswith("data:"):
        return "(inline image)"
    return path if data_scan.URL.match(path) else Path(path).name


def open_thumbnail(ref, folder: Path):
    """An image of a record, shrunk to THUMBNAIL_PIXELS: a path taken from the data file's folder
    as the engine's loader takes it (training/train_data.with_images: a relative path from
    `folder`, an absolute one as it is), or a `datasets` image's bytes. None for a URL or a data:
    URI: the page fetches nothing. OSError (Pillow's UnidentifiedImageError is one) when the file is
    missing or not an image."""
    if isinstance(ref, dict) and isinstance(ref.get("bytes"), bytes):
        source = io.BytesIO(ref["bytes"])
    else:
        path = ref.get("path") if isinstance(ref, dict) else ref
        if not isinstance(path, str) or not path or data_scan.URL.match(path):
            return None
        source = folder / Path(path).expanduser()
    from PIL import Image

    with Image.open(source) as image:
        image.thumbnail((THUMBNAIL_PIXELS, THUMBNAIL_PIXELS))
        return image.copy()


def first_user_text(row: dict) -> str:
    """The first thing a record's user says: a string prompt, or the first text of the first user
    turn of its prompt or messages; "" if it has none."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return prompt
    turns = prompt if isinstance(prompt, list) else row.get("messages")
    for turn in turns if isinstance(turns, list) else []:
        if not isinstance(turn, dict) or turn.get("role") != "user":
            continue
        content = turn.get("content")
        if isinstance(content, str):
            return content
        texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"] \
            if isinstance(content, list) else []
        return next((text for text in texts if isinstance(text, str)), "")
    return ""


def caption(number: int, row: dict) -> str:
    """A thumbnail's caption: its row's number (the first is 1), and the start of its first user text."""
    text = " ".join(first_user_text(row).split())
    text = text if len(text) <= CAPTION_CHARS else text[:CAPTION_CHARS - 1].rstrip() + "…"
    return f"row {number}: {text}" if text else f"row {number}"


def thumbnails(spec, path: Path, column: str, count: int) -> list:
    """The images of a local vision dataset's first rows (after the spec's column map and kept
    columns, as the check reads them), at most `count`, each with its caption: [(PIL image, caption)]. An image given
    as a URL is left out (never fetched), and so is one that is missing or not an image: the
    check's scan (data_scan.ImageCheck) names that record in the report, saying what to change."""
    rows = data_check.apply_column_map(read_rows(path, count), spec.column_map, spec.keep_columns)
    shown = []
    for number, row in enumerate(rows, start=1):
        for ref in image_refs(row.get(column))[:count - len(shown)]:
            try:
                image = open_thumbnail(ref, path.parent)
            except OSError:  # the report says it (data_scan refuses the record before launch)
                continue
            if image is not None:
                shown.append((image, caption(number, row)))
    return shown
