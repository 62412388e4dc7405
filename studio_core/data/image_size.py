"""`studio.image_size`: every image resized to one square resolution, for a fixed image token count.

On Trainium every new tensor shape is a new compilation. A vision-language model's image turns into
a number of image tokens, and for some families that number follows the image's own size:
Qwen2-VL, Qwen2.5-VL and Qwen3-VL keep each image near its size (a grid of 14-pixel patches,
merged 2x2, between a least and a most pixel count), SmolVLM and Idefics3 cut a large image into
tiles by its longest side, LLaVA-NeXT and LLaVA-OneVision pick a grid by the image's aspect ratio
(the image processors of these families in Transformers). A dataset of photos of many sizes then
makes many sequence lengths and pixel tensors, each a compile. Other families resize every image
to one square themselves (LLaVA-1.5's CLIP, SigLIP as in builtin:tiny-vlm, Gemma 3 at 896x896 with
pan-and-scan off, PaliGemma) and need nothing.

`studio.image_size: N` resizes each image to N x N pixels before the processor sees it, wherever the
run's model reads an image: training and the shape forecast (train_data), evaluation, chat and the
OpenAI endpoint (serve.generation.encode_vision). Left out, the processor's own default is kept.
Resizing to a square changes a photo's aspect ratio, as Gemma 3's processor does. A size the
processor would round is rounded the same way for every image (Qwen2.5-VL keeps a multiple of 28,
its 14-pixel patch times its 2x2 merge), so the count stays fixed.
"""

from __future__ import annotations

MAX_IMAGE_SIZE = 4096  # pixels a side: past any vision tower's resolution
# model_type values whose processor gives an image a token count that follows its size (see above)
SIZE_FOLLOWS_IMAGE = {
    "qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL", "qwen3_vl_moe": "Qwen3-VL",
    "idefics3": "Idefics3", "smolvlm": "SmolVLM", "llava_next": "LLaVA-NeXT", "llava_onevision": "LLaVA-OneVision",
}


def problems(value, vision: bool | None) -> list[str]:
    """What is wrong with `studio.image_size` (None: not set); `vision`: whether the model is a
    vision-language model (None: not known here)."""
    if value is None:
        return []
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_IMAGE_SIZE:
        return [f"studio.image_size: {value!r} must be a whole number of pixels a side, 1 to {MAX_IMAGE_SIZE} "
                "(e.g. 448: every image resized to 448x448); leave it out for the processor's own size"]
    if vision is False:
        return ["studio.image_size: the model takes text alone; it is for a vision-language model's images: "
                "leave it out, or pick a vision-language model"]
    return []


def follows_image(config: dict) -> str | None:
    """The model family's name when its processor gives each image a token count that follows
    the image's size (`config`: the model's config.json); None otherwise."""
    return SIZE_FOLLOWS_IMAGE.get(config.get("model_type")) if isinstance(config, dict) else None


def resize(image, size: int):
    """A Pillow image as N x N (`size`) pixels, RGB; the image as it is when it has that size already."""
    from PIL import Image

    image = image.convert("RGB") if image.mode != "RGB" else image
    return image if image.size == (size, size) else image.resize((size, size), Image.Resampling.BICUBIC)


def resize_dataset(dataset, size: int | None):
    """The dataset with every image of its `images` (a list a record) or `image` column resized
    (datasets decodes each as a Pillow image and stores the new one); the dataset as it is when
    `size` is None."""
    if size is None:
        return dataset
    for column in ("images", "image"):
        if column in dataset.column_names:
            dataset = dataset.map(
                lambda value: {column: [resize(i, size) for i in value or []] if column == "images"
                               else (resize(value, size) if value is not None else None)},
                input_columns=column, desc=f"resizing images to {size}x{size}")
    return dataset
