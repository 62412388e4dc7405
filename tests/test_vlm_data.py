"""Issue 49, the data side of vision-language fine-tuning: image data is told apart from text
(data_check.detect), refused for a trainer TRL does not train on images with, checked record by
record before launch (every image opened with Pillow, its placeholders counted) and loaded as
TRL's collators take it: each relative path from the data file's folder, as PIL images.

Real PNG, GIF and JPEG files made with Pillow in tmp_path, the real check (recipe.validate.validate)
and the real `datasets` loader (train_data); no run is started.
"""

from __future__ import annotations

import io
import json
import time

import numpy as np
import pytest
from PIL import Image

from studio_core.data.builtin_images import ensure_shapes_dataset
from studio_core.data.files import read_rows
from studio_core.recipe.data_check import detect, fit_problems
from studio_core.recipe.data_scan import scan_file
from studio_core.recipe.spec import RunSpec, SpecError
from studio_core.recipe.validate import validate
from studio_core.training.train_data import cut_texts, load_checked_datasets
from test_runs import REPO

pytestmark = pytest.mark.fast  # starts no run, torchrun, browser or app

QUESTION = {"type": "text", "text": "What shape is this?"}
ANSWER = {"role": "assistant", "content": [{"type": "text", "text": "a red circle"}]}
PLACEHOLDER = '({"type": "image"} parts)'


def chat(images: list, placeholders: int = 1) -> dict:
    """A record in TRL's vision format: a user turn with `placeholders` image parts, an answer."""
    user = {"role": "user", "content": [{"type": "image"}] * placeholders + [QUESTION]}
    return {"messages": [user, ANSWER], "images": images}


def pictures(folder, count: int = 4) -> list[str]:
    """`count` 32x32 RGB PNGs in folder/pics, their paths relative to `folder`."""
    (folder / "pics").mkdir(parents=True, exist_ok=True)
    for number in range(count):
        Image.new("RGB", (32, 32), (60 * number, 100, 200)).save(folder / "pics" / f"{number}.png")
    return [f"pics/{number}.png" for number in range(count)]


def write(path, rows: list[dict]):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def vlm(*overrides: str) -> RunSpec:
    return RunSpec.load(REPO / "recipes" / "tiny-sft.yaml").with_overrides(
        ["model_name_or_path=builtin:tiny-vlm", *overrides])


# --- detection and trainers ----------------------------------------------------------------------

def test_image_data_is_told_apart_from_text():
    kind = detect([chat(["a.png"])])
    assert kind.vision and kind.images == "images"
    assert kind.description == "language-modeling data (conversational) in `messages`, with images in `images`"
    single = detect([{"prompt": "Describe the picture.", "completion": "a cat", "image": "cat.png"}])
    assert single.vision and single.images == "image" and single.type == "prompt_completion"
    text = detect([{"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]}])
    assert not text.vision and text.images == ""


def test_trainers_that_trl_does_not_train_on_images_with_are_refused_naming_the_one_to_use():
    user = [{"role": "user", "content": [{"type": "image"}, QUESTION]}]
    pairs = detect([{"prompt": user, "chosen": [ANSWER], "rejected": [ANSWER], "images": ["a.png"]}])
    assert fit_problems(pairs, "dpo") == []
    assert fit_problems(pairs, "reward") == [
        "dataset: reward modeling does not train on images (TRL's RewardTrainer reads no `images` column); train on "
        "this data with DPO, or leave the images out with studio.keep_columns: [prompt, chosen, rejected]"]
    (kto,) = fit_problems(pairs, "kto")
    assert kto.startswith("dataset: KTO trains on images only in unpaired-preference data (TRL's KTOTrainer); this "
                          "dataset has preference data (conversational) in `prompt`, `chosen`, `rejected`, with images "
                          "in `images`: unpair it: one record per answer")
    assert kto.endswith("; or train it with DPO")
    implicit = detect([{"chosen": user + [ANSWER], "rejected": user + [ANSWER], "images": ["a.png"]}])
    (dpo,) = fit_problems(implicit, "dpo")
    assert dpo.startswith("dataset: DPO trains on images only in preference data (TRL's DPOTrainer)")
    assert dpo.endswith("give each record its prompt, with the image placeholders, in a `prompt` column, and only "
                        "the answers in `chosen` and `rejected`")
    (grpo,) = fit_problems(detect([{"prompt": "<image> What is it?", "images": ["a.png"]}]), "grpo")
    assert grpo.startswith("dataset: GRPO trains on images only with conversational prompts (TRL's GRPOTrainer)")
    assert fit_problems(detect([{"prompt": user, "images": ["a.png"]}]), "grpo") == []
    (both,) = fit_problems(detect([{**chat(["a.png"]), "image": "a.png"}]), "sft")
    assert both == ("dataset: has both `image` and `images`; TRL makes `image` each record's only image and drops "
                    "`images`: keep one of them, e.g. studio.keep_columns: [messages, image]")


# --- a good dataset, checked and loaded -------------------------------------------------------------

def test_a_good_image_dataset_passes_and_loads_as_pil_images_from_its_own_folder(tmp_path, monkeypatch):
    data = tmp_path / "data"
    paths = pictures(data)
    text_user = {"role": "user", "content": "What shape is this?"}  # TRL puts the image before it
    rows = [chat([paths[0]]), chat([paths[1], paths[2]], placeholders=2), chat([str(data / paths[3])]),
            {"messages": [text_user, ANSWER], "images": [paths[0]]},
            {"messages": [{"role": "user", "content": [QUESTION]}, ANSWER], "images": []}]  # trains as text
    path = write(data / "train.jsonl", rows)
    spec = vlm(f"dataset_name={path}")
    assert validate(spec) == []
    elsewhere = tmp_path / "elsewhere"  # relative paths start from the file's folder, not the current one
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    train, held = load_checked_datasets(spec, None)
    assert held is None and len(train) == 5
    images = [row["images"] for row in train]
    assert [[image.filename for image in row] for row in images] == [
        [str(data / paths[0])], [str(data / paths[1]), str(data / paths[2])], [str(data / paths[3])],
        [str(data / paths[0])], []]
    assert all(isinstance(image, Image.Image) and image.size == (32, 32) for row in images for image in row)


def test_one_image_a_record_in_an_image_column_loads_as_one_pil_image(tmp_path):
    paths = pictures(tmp_path, 2)
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, QUESTION]}],
             "completion": [ANSWER], "image": paths[number % 2]} for number in range(4)]
    path = write(tmp_path / "train.jsonl", rows)
    assert validate(vlm(f"dataset_name={path}")) == []
    train, _ = load_checked_datasets(vlm(f"dataset_name={path}"), None)
    assert isinstance(train[1]["image"], Image.Image) and train[1]["image"].filename == str(tmp_path / paths[1])
    missing = write(tmp_path / "missing.jsonl", rows[:2] + [{**rows[2], "image": None}])
    assert validate(vlm(f"dataset_name={missing}")) == [
        f"dataset: {missing}: line 3: `image` is missing; every record needs one, as TRL makes it the record's only "
        "image: give it, or put the images in an `images` list, empty for a record without one"]


def test_images_already_in_a_parquet_file_are_checked_and_left_as_they_are(tmp_path):
    from datasets import Dataset
    from datasets import Image as ImageFeature
    from datasets import List

    pictures(tmp_path, 2)
    images = [[Image.open(tmp_path / "pics" / f"{number % 2}.png")] for number in range(4)]
    table = Dataset.from_dict({"messages": [chat([])["messages"]] * 4, "images": images})
    path = tmp_path / "train.parquet"
    table.cast_column("images", List(ImageFeature())).to_parquet(str(path))
    assert validate(vlm(f"dataset_name={path}")) == []
    train, _ = load_checked_datasets(vlm(f"dataset_name={path}"), None)
    assert isinstance(train[0]["images"][0], Image.Image) and train[3]["images"][0].size == (32, 32)


def test_the_builtin_shapes_images_are_all_opened_quickly(tmp_path):
    folder = ensure_shapes_dataset(tmp_path / "shapes")
    started = time.monotonic()
    scan = scan_file(folder / "train.jsonl")
    assert (list(scan), scan.rows) == ([], 900)
    assert time.monotonic() - started < 20  # 0.1 s here: each of 900 small PNGs opened once


# --- each refusal, naming the record and what to change ---------------------------------------------

def bad_image(folder, case: str) -> str:
    """The path (relative to `folder`) of a real file that is wrong in the way `case` says."""
    if case == "missing":
        return "pics/missing.png"
    if case == "url":
        return "https://example.com/cat.png"
    path = folder / "pics" / {"not an image": "notes.png", "animated": "spin.gif", "cmyk": "print.jpg",
                              "cut short": "photo.jpg"}.get(case, f"{case.replace(' ', '-')}.png")
    if case == "not an image":
        path.write_text("a shopping list, not a picture\n")
    elif case == "animated":
        frames = [Image.new("RGB", (32, 32), (80 * n, 0, 0)) for n in range(3)]
        frames[0].save(path, save_all=True, append_images=frames[1:])
    elif case == "cmyk":
        Image.new("CMYK", (32, 32), (0, 255, 255, 0)).save(path)
    elif case == "16-bit":
        Image.fromarray(np.full((32, 32), 40_000, dtype=np.uint16)).save(path)
        with Image.open(path) as image:
            assert image.mode == "I;16"
    elif case == "cut short":  # a copy that stopped half way: Pillow's verify() passes it, a decode does not
        photo = io.BytesIO()
        Image.effect_noise((320, 240), 60).convert("RGB").save(photo, format="JPEG")
        path.write_bytes(photo.getvalue()[: len(photo.getvalue()) // 2])
    elif case == "too many pixels":
        Image.new("L", (9_500, 9_500), 200).save(path)  # 90.25 megapixels of one colour: 110 kB
    return str(path.relative_to(folder))


REFUSALS = {
    "missing": "is not found (looked for {file}); fix the path (a relative one starts from the data file's folder) or "
               "add the file",
    "not an image": "is not an image Pillow can read (cannot identify image file",
    "animated": "is animated (3 frames): only its first frame would be used; give a still image, e.g. its first "
                "frame saved as PNG",
    "cmyk": "is a CMYK (print colours) image (mode CMYK), which the model's processor does not read as 8-bit "
            'colours; convert it to RGB, e.g. with Pillow: Image.open(path).convert("RGB").save("new.png")',
    "16-bit": "is a 16-bit greyscale image (mode I;16), which the model's processor does not read as 8-bit colours; "
              "convert it to RGB after scaling its values to 0-255 (.convert clips higher ones)",
    "cut short": "is a JPEG that is cut short or damaged (image file is truncated",
    "too many pixels": "is 9,500 x 9,500 pixels (90.2 megapixels), more than Pillow's limit of 89.5 megapixels "
                       "(PIL.Image.MAX_IMAGE_PIXELS, its guard against decompression bombs); shrink it",
    "url": "is a URL or inline data, not a file: the run reads images from files and never downloads one; save the "
           "image as a file and give its path",
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_bad_image_is_refused_before_launch_naming_the_record(tmp_path, case):
    paths = pictures(tmp_path)
    image = bad_image(tmp_path, case)
    path = write(tmp_path / "train.jsonl", [chat([p]) for p in paths[:2]] + [chat([image])] + [chat([paths[3]])])
    (problem,) = validate(vlm(f"dataset_name={path}"))
    assert problem.startswith(f"dataset: {path}: line 3: `images` image 1 ({image}) "
                              + REFUSALS[case].format(file=tmp_path / image)), problem
    assert len(problem) < 700


def test_image_placeholders_that_do_not_match_the_images_are_refused_with_both_counts(tmp_path):
    paths = pictures(tmp_path)
    rows = [chat([paths[0]]), chat([paths[1]], placeholders=2), chat([], placeholders=1),
            {"messages": [{"role": "user", "content": "What shape is this?"}, ANSWER], "images": [paths[2]]}]
    path = write(tmp_path / "train.jsonl", rows + [
        {"messages": [{"role": "system", "content": "Be brief."}, *chat([])["messages"][:1],
                      {"role": "user", "content": "And this one?"}, ANSWER], "images": [paths[3]]}])
    assert validate(vlm(f"dataset_name={path}")) == [
        f"dataset: {path}: line 2: `messages` has 2 image placeholders {PLACEHOLDER} but `images` has 1 image; TRL "
        "fills the placeholders with the images in order: give one placeholder per image",
        f"dataset: {path}: line 3: `messages` has 1 image placeholder {PLACEHOLDER} but `images` has 0 images; TRL "
        "fills the placeholders with the images in order: give one placeholder per image",
        f"dataset: {path}: line 5: `messages` has 2 image placeholders ({{\"type\": \"image\"}} parts, counting the 1 "
        "TRL puts before the first user message whose content is text) but `images` has 1 image; TRL fills the "
        "placeholders with the images in order: give one placeholder per image"]


def test_message_parts_and_the_images_column_are_checked(tmp_path):
    paths = pictures(tmp_path)
    inline = {"role": "user", "content": [{"type": "image", "image": "pics/0.png"}, QUESTION]}
    odd = {"role": "user", "content": [{"type": "video"}, QUESTION]}
    path = write(tmp_path / "train.jsonl", [chat([paths[0]]), {"messages": [inline, ANSWER], "images": []},
                                            {"messages": [odd, ANSWER], "images": []}, chat(paths[1])])
    assert validate(vlm(f"dataset_name={path}")) == [
        f"dataset: {path}: line 2: `messages` message 1 (`user`) part 1 holds its image (`image`); the studio checks "
        "and loads images from the record's `images` list: put the image's path there and leave "
        '{"type": "image"} here',
        f"dataset: {path}: line 3: `messages` message 1 (`user`) part 1 is neither a text part "
        '({"type": "text", "text": "..."}) nor an image placeholder ({"type": "image"}); write it as one of them',
        f"dataset: {path}: line 4: `images` is text, not a list; write it as a list of image files, e.g. "
        '["images/0001.png"]']
    # image placeholders in a dataset without images: the `images` column is what is missing
    forgot = write(tmp_path / "forgot.jsonl", [{"messages": chat([])["messages"]}] * 3)
    text_model = RunSpec.load(REPO / "recipes" / "tiny-sft.yaml").with_overrides([f"dataset_name={forgot}"])
    problem = validate(text_model)[0]
    assert problem.startswith(f"dataset: {forgot}: line 1: `messages` message 1 (`user`) has a list as its `content`")
    assert problem.endswith('give each record its image files in an `images` column, e.g. "images": '
                            '["images/0001.png"], or write the message\'s text as one string')


def test_a_dataset_folders_images_are_resolved_there_and_checked_in_the_run(tmp_path, monkeypatch):
    folder = tmp_path / "folder"
    paths = pictures(folder)
    write(folder / "train.jsonl", [chat([p]) for p in paths])
    monkeypatch.chdir(tmp_path)
    train, _ = load_checked_datasets(vlm(f"dataset_name={folder}"), None)
    assert train[2]["images"][0].filename == str(folder / paths[2])
    write(folder / "train.jsonl", [chat([p]) for p in paths[:2]] + [chat(["pics/gone.png"])])
    with pytest.raises(SpecError) as refused:
        load_checked_datasets(vlm(f"dataset_name={folder}"), None)
    assert refused.value.problems == [
        f"dataset: {folder}: row 3: `images` image 1 ({folder / 'pics/gone.png'}) is not found; fix the path or add "
        "the file"]


def test_the_forecasts_cut_keeps_the_images_as_they_are(tmp_path):
    paths = pictures(tmp_path, 2)
    long = chat([paths[0]])
    long["messages"] = [long["messages"][0], {"role": "assistant", "content": "word " * 200}]
    path = write(tmp_path / "train.jsonl", [long, chat([paths[1]])])
    train, _ = load_checked_datasets(vlm(f"dataset_name={path}"), None)
    cut = cut_texts(train, 50)
    assert cut.features["images"] == train.features["images"]
    assert len(cut[0]["messages"][1]["content"]) == 50 and cut[1]["images"][0].filename == str(tmp_path / paths[1])
