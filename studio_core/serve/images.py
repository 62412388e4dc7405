"""Images in a conversation with a vision-language model: how they travel and how they are read.

A user message's content may be a list of parts, as TRL's vision data and OpenAI's API write it:
text parts ({"type": "text", "text": ...}) and image parts. Between the studio and its chat
process an image part carries the image itself, base64 in JSON ({"type": "image", "data": ...}):
the process never opens a file or a URL it is handed. Before it is sent, an image is checked as
the data check checks a training image (recipe/data_scan.image_problem: Pillow opens and verifies
it; not animated, not CMYK or 16-bit, within Pillow's pixel limit). OpenAI image parts are taken
only as base64 data URLs (`data:image/png;base64,...`): a server that fetched a URL a request
names would reach whatever that URL points at, from inside the user's network.

In the chat process (`take_images`) each image part becomes TRL's placeholder {"type": "image"}
and its image, in the order the parts come, goes to the model's processor beside the rendered
text, as TRL's vision collator gives them in training, each first resized to the run's
studio.image_size where it set one (serve/generation.encode_vision), as its training resized them.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path

from studio_core.recipe.data_scan import image_problem

# The most bytes one image may take in a request (base64 of it: a third more). A photo as a
# PNG is a few MB; the processor makes it far smaller anyway.
MAX_IMAGE_BYTES = 20 * 1024 * 1024


class ImageError(ValueError):
    """An image that cannot be sent; the message says what to change."""


def image_part(source: Path | bytes, what: str) -> dict:
    """The chat process's image part for a file or its bytes, checked first (`what` names it in
    the message: "--image cat.png")."""
    if isinstance(source, Path):
        try:
            if source.stat().st_size > MAX_IMAGE_BYTES:
                raise ImageError(f"{what} is {source.stat().st_size / 2**20:.0f} MiB, over the "
                                 f"{MAX_IMAGE_BYTES // 2**20} MiB an image may take: shrink it")
            data = source.read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            raise ImageError(f"{what}: no image file there; give the path of a PNG or JPEG file") from None
        except OSError as error:
            raise ImageError(f"{what}: cannot read it ({error.strerror})") from None
    else:
        data = source
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"{what} is {len(data) / 2**20:.0f} MiB, over the {MAX_IMAGE_BYTES // 2**20} MiB an image "
                         "may take: shrink it")
    problem = image_problem(data)
    if problem:
        raise ImageError(f"{what} {problem}")
    return {"type": "image", "data": base64.b64encode(data).decode("ascii")}


def data_url_bytes(url: str, what: str) -> bytes:
    """The image of an OpenAI `image_url` that is a base64 data URL; ImageError for anything else
    (a web address is never fetched)."""
    head, comma, payload = url.partition(",")
    if not url.startswith("data:") or not comma:
        raise ImageError(f"{what} is a web address; this server never fetches one: send the image inline, as a "
                         "base64 data URL (data:image/png;base64,...)")
    if not head.endswith(";base64") or not head.removeprefix("data:").startswith("image/"):
        raise ImageError(f"{what} is a data URL of {head.removeprefix('data:') or 'no type'}; send "
                         "data:image/png;base64,... (or image/jpeg)")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageError(f"{what} is over the {MAX_IMAGE_BYTES // 2**20} MiB an image may take: shrink it")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{what} is not valid base64 after `;base64,`") from None


def user_content(text: str, image: dict | None) -> str | list[dict]:
    """A user message's content: its text alone, or with an image part, the image first (as
    TRL's vision data puts it)."""
    return [image, {"type": "text", "text": text}] if image else text


def has_images(messages: list[dict] | None) -> bool:
    return any(isinstance(m.get("content"), list) and any(is_image(p) for p in m["content"]) for m in messages or [])


def is_image(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "image"


def take_images(messages: list[dict]) -> tuple[list[dict], list]:
    """In the chat process: (the messages with each image part as TRL's placeholder, the images as
    RGB Pillow images in their order). An image part holds its image base64 (`data`, as sent), or as
    a Pillow image (`image`, as TRL's prepare_multimodal_messages fills a dataset row's)."""
    from PIL import Image

    images, placed = [], []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            placed.append(message)
            continue
        parts = []
        for part in content:
            if is_image(part) and "data" in part:
                with Image.open(io.BytesIO(base64.b64decode(part["data"]))) as image:
                    images.append(image.convert("RGB"))
            elif is_image(part):
                images.append(part["image"].convert("RGB"))
            parts.append({"type": "image"} if is_image(part) else part)
        placed.append({**message, "content": parts})
    return placed, images


def without_images(messages: list[dict]) -> list[dict]:
    """The messages with each image part as TRL's bare placeholder, to be written as JSON."""
    return [{**m, "content": [{"type": "image"} if is_image(p) else p for p in m["content"]]}
            if isinstance(m.get("content"), list) else m for m in messages]


def text_of(content) -> str:
    """A message's text alone (its image parts left out), as a history shows it."""
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content or ""
