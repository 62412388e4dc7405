"""The whole dataset, before launch: each record where the trainer will read it.

`scan_file` reads up to SCAN_LIMIT records of a local file (`scan_dataset`: the rows of a
`datasets.Dataset`, which the worker loaded from a Hub dataset or a folder) for the malformed
records and empty values TRL would stop at mid-run, and the turns a chat template would drop (an
unknown role, content that is not text). As warnings, counted by kind: turns out of order, and
records far longer than max_length. `check_spec_file` adds what only the model's tokenizer
tells, when it is on this machine: the first records rendered through its chat template as TRL
renders them, and the longest ones counted in its tokens (each text cut to what max_length can
keep first: a 20 MB record needs only enough of it to know that it will be cut). The type and format come from the first rows
(studio_core.recipe.data_check).

Vision data (an `images` or `image` column, data_check.DatasetKind.vision): messages may hold
parts ({"type": "text", "text": ...} and {"type": "image"} placeholders), and ImageCheck opens
each distinct image of a local file once, with Pillow, before launch: a path is relative to the
data file's folder (as train_data.with_images loads it); a missing file, one that is not an
image, a URL (the run never downloads one), more pixels than Pillow's MAX_IMAGE_PIXELS, an
animated image, a mode other than 8-bit RGB, greyscale or palette, and a record whose image
placeholders do not match its images (TRL's prepare_multimodal_messages would stop the run) are
refused. A record with no images and no placeholders trains as text: TRL's collators take an
empty list, and pass no images for a batch of such records.

This runs in the web app's process: stdlib, pyarrow and Pillow only (and transformers' tokenizer
classes, without torch), never `datasets`, torch or trl.
"""

from __future__ import annotations

import heapq
import io
import json
import re
import warnings
from pathlib import Path

from functools import lru_cache

from studio_core.data import sources
from studio_core.data.builtin import BUILTIN_MODEL, TINY_MODEL_FOLDER
from studio_core.data import remembered
from studio_core.machine.cache import cache_dir
from studio_core.recipe.data_check import DatasetKind, apply_column_map, detect
from studio_core.data.files import read_rows, records
from studio_core.recipe.trl_schema import trainer_fields

SCAN_LIMIT = 100_000  # records the pre-launch scan reads at most
FAR = 4  # a record this many times longer than max_length is warned about (truncation cuts most of it)
LONGEST = 20  # the longest records (in characters) kept to count in tokens
RENDERED = 8  # the first records rendered through the model's chat template before launch
# The roles a conversation may hold. Chat templates know system, user and assistant; Qwen3's (TRL's
# chat_templates/qwen3.jinja, also the built-in model's) drops a turn of any other role without a
# word and renders content that is not text as empty. `tool` is taken only in a record where an
# assistant message makes a call (`tool_calls`): that is the exchange TRL's supports_tool_calling
# expects (user, assistant with tool_calls, tool). Templates without tool support drop a tool turn
# (Phi-3's) or refuse it (Gemma's), and a tool answer to no call is most likely mislabelled data.
ROLES = ("system", "user", "assistant")
_ROLE_NAMES = {"human": "user", "customer": "user", "bot": "assistant", "gpt": "assistant", "model": "assistant",
               "ai": "assistant", "chatbot": "assistant", "developer": "system"}  # usual other names
_TRAINS_ANYWAY = "this trains, but likely not as meant"
# turns out of order, by kind: (what such records have, the fix)
ORDER_CASES = {
    "assistant first": ("start with an `assistant` turn, before any user turn", "put the user's message first"),
    "user twice": ("have two `user` turns in a row", "merge them or put the assistant's answer between them"),
    "assistant twice": ("have two `assistant` turns in a row", "merge them or put the user's message between them"),
}


# Pillow's image modes that processors read as they are (8 bits a channel, converted to RGB)
STILL_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA")
MODE_NAMES = {"CMYK": "CMYK (print colours)", "YCbCr": "YCbCr", "LAB": "Lab", "HSV": "HSV", "I": "32-bit integer",
              "F": "32-bit float", "I;16": "16-bit greyscale", "I;16B": "16-bit greyscale",
              "I;16L": "16-bit greyscale", "I;16N": "16-bit greyscale"}
URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://|data:)")  # a URL, or an image inline (a data: URI)
SHOWN = 160  # characters of a value (an image's path) a message shows at most


class Scan(list):
    """scan_file's answer: the refusals, a list of messages as before (empty: the file may be
    trained on), `warnings`: records that train, but likely not as meant, `rows`: the records
    read (all of them, up to the scan's limit), `first`: the first RENDERED good records as TRL
    names their columns, with where they are, and `longest`: the LONGEST longest records
    (characters of text TRL reads, where, the record as TRL names its columns)."""

    def __init__(self, problems=(), warnings=(), rows: int = 0, first=(), longest=()):
        super().__init__(problems)
        self.warnings, self.rows, self.first, self.longest = list(warnings), rows, list(first), list(longest)


def scan_file(path: Path, column_map: dict | None = None, keep_columns: list | None = None,
              text_field: str = "text", limit: int = SCAN_LIMIT, most: int = 5,
              max_length: int | None = None) -> Scan:
    """Each record of a local file (the first `limit`) where the trainer will read it: the columns
    TRL reads from data of the type and format of the first rows (after the column map and
    keep-columns, which `check_mapping` has passed). The first `most` bad records by line (or
    row) and column, then how many more; none if none. Mid-run, `datasets` or TRL would fail on
    such a record with their own error, or train on it, or (a turn of an unknown role, content
    that is not text) the chat template would drop it. `warnings`: conversations whose turns are
    out of order, counted by kind, and (with `max_length`) records far longer than it, their
    length guessed from their characters (check_spec_file counts them in the model's tokens)."""
    path = Path(path)
    try:
        kind = detect(apply_column_map(read_rows(path), column_map, keep_columns), text_field)
    except ValueError as error:
        return Scan([f"dataset: {error}"])
    renamed = {new: old for old, new in (column_map or {}).items()}
    columns = {renamed.get(c, c): c for c in kind.used}  # name in the file -> name TRL sees
    images = renamed.get(kind.images, kind.images)
    read = records(path, columns=list(columns) + [images] * kind.vision + [
        c for c in ("tools", "chat_template_kwargs") if path.suffix.lower() != ".parquet"])
    scan = scan_records(read, kind, columns, f"dataset: {path}", limit, most,
                        ImageCheck(images, path.parent) if kind.vision else None)
    if max_length:
        scan.warnings += long_warnings(scan, f"dataset: {path}", max_length, None, most)
    return scan


def check_spec_file(spec, path: Path, what: str = "dataset") -> Scan:
    """Every record of a spec's local file (scan_file), and with the model's tokenizer, when it is
    on this machine, the first RENDERED records rendered through its chat template (the first
    failure is a refusal) and the longest counted in its tokens against max_length; `what`
    begins every message."""
    text_field = spec.args.get("dataset_text_field", "text")
    scan = scan_file(path, spec.column_map, spec.keep_columns, text_field)
    if what != "dataset":
        scan[:] = [what + p.removeprefix("dataset") for p in scan]
        scan.warnings = [what + w.removeprefix("dataset") for w in scan.warnings]
    if scan:
        return scan
    # the tokenizer's part (Transformers' import alone takes a second or two) is kept on disk, by
    # what it reads: the model, the file, the column map, max_length and the template's settings
    # (not kept while the tokenizer is not here: the built-in model not yet built, a Hub model not downloaded)
    read = {key: spec.args.get(key) for key in ("dataset_text_field", "chat_template_path", "chat_template_kwargs")}
    digest = remembered.key("data-scans", [str(path), what, spec.trainer, spec.column_map, spec.keep_columns,
                                           max_length(spec), read], {"model": spec.model_name_or_path, **read,
                                                                     "path": str(path)}) \
        if tokenizer_folder(str(spec.model_name_or_path)) is not None else None
    kept = remembered.load(digest) if digest else None
    if not (isinstance(kept, list) and len(kept) == 2):
        kept = _tokenizer_pass(spec, path, what, scan)
        if digest:
            remembered.save(digest, kept)
    scan.extend(kept[0])
    scan.warnings += kept[1]
    return scan


def _tokenizer_pass(spec, path: Path, what: str, scan: Scan) -> list[list[str]]:
    """[the problems, the warnings] that the model's tokenizer finds (check_spec_file)."""
    problems, warnings = [], []
    limit = max_length(spec)
    tokenizer = local_tokenizer(str(spec.model_name_or_path))
    template = _template(spec.args)
    if tokenizer is not None and template is not False:
        problems = render_problems(scan.first, tokenizer, template, spec.args, f"{what}: {path}")
    if limit:
        count = _counter(tokenizer, limit, template, spec.args) if tokenizer is not None and template is not False \
            else None
        warnings = long_warnings(scan, f"{what}: {path}", limit, count)
    return [problems, warnings]


def max_length(spec) -> int | None:
    """The tokens TRL keeps of a record for this spec (its max_length, else TRL's default); None
    for a trainer that does not truncate its records (GRPO, RLOO)."""
    value = spec.args.get("max_length", trainer_fields(spec.trainer).get("max_length", {}).get("default"))
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def scan_dataset(dataset, column_map: dict | None, text_field: str = "text", limit: int = SCAN_LIMIT,
                 most: int = 5, what: str = "dataset") -> Scan:
    """scan_file over a `datasets.Dataset` as loaded (before the column map), rows numbered from 1:
    the same checks for a Hub dataset or a folder, which are read only in the run. Its images are
    read as stored (a path, or bytes), not decoded, and only looked for (ImageCheck without a folder)."""
    head = dataset.select(range(min(5, len(dataset)))).to_list()  # its images as stored, not opened
    if not head:
        return Scan()
    kind = detect(apply_column_map(head, column_map, None), text_field)
    renamed = {new: old for old, new in (column_map or {}).items()}
    columns = {renamed.get(c, c): c for c in kind.used}
    wanted = [c for c in [*columns, "tools", "chat_template_kwargs"] if c in dataset.column_names]
    rows = iter(dataset.select_columns(wanted))
    images = renamed.get(kind.images, kind.images)
    if kind.vision and images in dataset.column_names:
        stored = (row for batch in dataset.select_columns([images]).with_format("arrow").iter(batch_size=1024)
                  for row in batch.to_pylist())
        rows = ({**row, **image} for row, image in zip(rows, stored))
    rows = ((f"row {i + 1}", row) for i, row in enumerate(rows))
    return scan_records(rows, kind, columns, what, limit, most, ImageCheck(images, None) if kind.vision else None)


def scan_records(rows, kind: DatasetKind, columns: dict[str, str], what: str, limit: int = SCAN_LIMIT,
                 most: int = 5, images: ImageCheck | None = None) -> Scan:
    """The scan of (where, record or ValueError) pairs; `what` begins every message (e.g.
    "dataset: FILE"); `columns`: the record's name of each column TRL reads -> TRL's name;
    `images`: the check of each record's images, for vision data."""
    problems, bad, read, first, longest = [], 0, 0, [], []
    order: dict[str, list] = {}  # kind of disorder -> [records, places, the first one's detail]
    try:
        for where, record in rows:
            if read == limit:
                break
            read += 1
            problem = str(record) if isinstance(record, ValueError) else (
                _record_problem(record, columns, kind) or (images.problem(record, columns, kind) if images else ""))
            bad += bool(problem)
            if problem and bad <= most:
                problems.append(f"{what.split(':')[0]}: {problem}" if isinstance(record, ValueError)
                                else f"{what}: {where}: {problem}")
            if problem:
                continue
            for case, detail in _order_cases(record, columns).items():
                entry = order.setdefault(case, [0, [], detail])
                entry[0] += 1
                entry[1] += [where] * (len(entry[1]) < most)
            named = {**{name: record.get(c) for c, name in columns.items()},
                     **{k: record[k] for k in ("tools", "chat_template_kwargs") if record.get(k) is not None}}
            if len(first) < RENDERED:
                first.append((where, named))
            size = _characters(named)
            if len(longest) < LONGEST:
                heapq.heappush(longest, (size, -read, where, named))
            elif size > longest[0][0]:
                heapq.heapreplace(longest, (size, -read, where, named))
    except ValueError as error:  # the file cannot be read past here
        problems.append(f"{what.split(':')[0]}: {error}")
    if bad > most:
        problems.append(f"{what}: {bad - most} more bad records in the first {read:,}; fix or remove each of them")
    warnings = [_order_text(what, case, *order[case], read) for case in ORDER_CASES if case in order]
    longest = [(size, where, named) for size, _, where, named in sorted(longest, reverse=True)]
    return Scan(problems, warnings, read, first, longest)


def long_warnings(scan: Scan, what: str, max_length: int, count_tokens=None, most: int = 5) -> list[str]:
    """The records far (FAR times) longer than `max_length` tokens, which TRL truncates: counted with
    `count_tokens(record) -> tokens` (the model's tokenizer, which need only count far enough to
    know), else guessed at 4 characters a token. One warning: how many, the longest first."""
    found = []
    for size, where, named in scan.longest:
        if size <= max_length * (FAR if count_tokens else 4 * FAR):
            break  # sorted longest first; fewer characters than tokens needed cannot be far longer
        tokens = count_tokens(named) if count_tokens else size // 4
        if tokens > max_length * FAR:
            found.append((tokens, where))
    if not found:
        return []
    about = "" if count_tokens else " (guessed at 4 characters a token: the model's tokenizer is not on this machine)"
    (tokens, where), more = found[0], len(found) - 1
    others = f"; {more} more of the {len(scan.longest)} longest records are too ({', '.join(w for _, w in found[1:most + 1])}" \
             f"{', ...' if more > most else ''})" if more else ""
    return [f"{what}: {where} is {tokens // max_length:,} times longer than max_length ({tokens:,} tokens{about}, "
            f"max_length {max_length}) and will be cut (truncated) to max_length: the model never trains on the "
            f"rest{others}; split such records into shorter ones, or raise max_length ({_TRAINS_ANYWAY})"]


def _characters(named: dict) -> int:
    """Characters of the text TRL reads from a record (the prompt and the longer answer of a pair)."""
    def size(value) -> int:
        if isinstance(value, str):
            return len(value)
        return sum(len(m.get("content")) for m in value if isinstance(m, dict) and isinstance(m.get("content"), str)) \
            if isinstance(value, list) else 0

    answers = [size(named.get(c)) for c in ("completion", "chosen", "rejected") if c in named]
    return sum(size(v) for c, v in named.items() if c not in ("completion", "chosen", "rejected",
                                                              "tools", "chat_template_kwargs")) + max(answers, default=0)


def _record_problem(record: dict, columns: dict[str, str], kind: DatasetKind) -> str:
    calls = any(isinstance(m, dict) and m.get("tool_calls") for c in columns
                if isinstance(record.get(c), list) for m in record[c])
    for column, name in columns.items():
        value = record.get(column)
        problem = ("is missing; every record needs one" if value is None else "" if name == "label"
                   else _value_problem(value, kind.formats.get(name, ""))
                   or _messages_problem(value, calls, kind.vision))
        if problem:
            return f"`{column}` {problem}"
    return ""


def _value_problem(value, fmt: str) -> str:
    """What is wrong with one value TRL reads, `fmt` being the format of the first rows; "" if nothing."""
    want = {"standard": "text", "conversational": "a list of {role, content} messages"}.get(
        fmt, "text or a list of {role, content} messages")
    if isinstance(value, (str, list)) and not value:
        return f"is empty; it needs {want}"
    if isinstance(value, str):
        return "" if fmt != "conversational" else ("is text, but the first rows hold lists of {role, content} "
                                                   "messages; use one format throughout")
    if isinstance(value, list):
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and ("content" in m or "tool_calls" in m)
                   for m in value):
            return "is not a list of {role, content} messages"
        return "" if fmt != "standard" else "holds messages, but the first rows hold text; use one format throughout"
    return f"is a {type(value).__name__}; it needs {want}"


def _messages_problem(value, tool_calls: bool, parts: bool = False) -> str:
    """The first message (of a list `_value_problem` passed) whose turn the chat template would drop
    or empty; `tool_calls`: the record has a tool call, so `tool` messages are taken; `parts`: vision
    data, whose content may be a list of text parts and image placeholders. "" if none."""
    for number, message in enumerate(value if isinstance(value, list) else [], start=1):
        role, content = message["role"], message.get("content")
        if role == "tool" and not tool_calls:
            return (f"message {number} has the role `tool`, but no assistant message of this record makes a tool "
                    "call (`tool_calls`); give the call to the assistant message before it, or make it a `user` "
                    "message")
        if role not in ROLES and role != "tool":
            known = role.lower() if role.lower() in ROLES else _ROLE_NAMES.get(role.lower())
            use = f"`{known}`" if known else "`system`, `user` or `assistant` (`tool` for the answer to a tool call)"
            return (f"message {number} has the role `{role}`, which chat templates do not know (Qwen3's drops the "
                    f"turn); change it to {use} in the data")
        if parts and isinstance(content, list):
            problem = _parts_problem(content)
            if problem:
                return f"message {number} (`{role}`) {problem}"
            continue
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            if content is None:
                return f"message {number} (`{role}`) has no `content`; give it its text"
            what = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}.get(
                type(content), type(content).__name__)
            fix = (f"write it in quotes, {json.dumps(str(content))}" if what == "a number"
                   else "give each record its image files in an `images` column, e.g. \"images\": "
                   "[\"images/0001.png\"], or write the message's text as one string"
                   if what == "a list" and any(isinstance(p, dict) and p.get("type") == "image" for p in content)
                   else "write the message's text as one string")
            return (f"message {number} (`{role}`) has {what} as its `content`, not text (chat templates render it "
                    f"as empty or fail); {fix}")
    return ""


def _parts_problem(content: list) -> str:
    """What is wrong with a message's content of parts (vision data); "" if nothing."""
    for number, part in enumerate(content, start=1):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if kind == "image":
            inline = [key for key in ("image", "url", "path") if part.get(key) is not None]
            if inline:
                return (f"part {number} holds its image (`{inline[0]}`); the studio checks and loads images from the "
                        "record's `images` list: put the image's path there and leave {\"type\": \"image\"} here")
            continue
        return (f"part {number} is neither a text part ({{\"type\": \"text\", \"text\": \"...\"}}) nor an image "
                "placeholder ({\"type\": \"image\"}); write it as one of them")
    return ""


class ImageCheck:
    """The images of vision data's records, in their column `column` (TRL's `images`: a list a
    record, or `image`: one), each distinct file checked once (`seen`). `folder`: where a
    relative path starts (the data file's folder); each image is opened there (image_problem).
    Without a folder (a dataset loaded in the run, whose paths train_data made absolute) an image is
    only looked for: opening every image of a Hub dataset on every rank would take long."""

    def __init__(self, column: str, folder: Path | None):
        self.column, self.folder, self.seen = column, folder, {}

    def problem(self, record: dict, columns: dict[str, str], kind: DatasetKind) -> str:
        """What is wrong with this record's images, or with its placeholders for them; "" if nothing."""
        value = record.get(self.column)
        if kind.images == "image":
            if value is None:
                return (f"`{self.column}` is missing; every record needs one, as TRL makes it the record's only "
                        "image: give it, or put the images in an `images` list, empty for a record without one")
            found = [value]
        elif isinstance(value, list) or value is None:
            found = value or []  # none: the record trains as text, as TRL's collators take it
        else:
            return (f"`{self.column}` is {'text' if isinstance(value, str) else _a(value)}, not a list; write it "
                    f"as a list of image files, e.g. [\"images/0001.png\"]")
        for number, image in enumerate(found, start=1):
            problem = self._image_problem(image)
            if problem:
                which = f"`{self.column}`" + (f" image {number}" if kind.images == "images" else "")
                return f"{which} ({_shown(image)}) {problem}"
        return _placeholder_problem(record, columns, kind, len(found), self.column)

    def _image_problem(self, image) -> str:
        if isinstance(image, dict) and ("bytes" in image or "path" in image):  # datasets' Image, as stored
            if image.get("bytes"):
                return image_problem(image["bytes"]) if self.folder is not None else ""
            image = image.get("path")
        if not isinstance(image, str) or not image.strip():
            return f"is {_a(image)}, not the path of an image file; give the file's path"
        if URL.match(image):
            return ("is a URL or inline data, not a file: the run reads images from files and never downloads one; "
                    "save the image as a file and give its path")
        path = self.folder / Path(image).expanduser() if self.folder is not None else Path(image).expanduser()
        if str(path) not in self.seen:
            looked = f" (looked for {_shown(path)})" if str(path) != image else ""
            start = " (a relative one starts from the data file's folder)" if self.folder is not None else ""
            self.seen[str(path)] = (f"is not found{looked}; fix the path{start} or add the file"
                                    if not path.is_file() else image_problem(path) if self.folder is not None else "")
        return self.seen[str(path)]


def image_problem(source: Path | bytes) -> str:
    """What stops an image file (or its bytes) from training as meant; "" if nothing: Pillow opens
    and verifies it, then reads its size, frames and mode."""
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    shrink = (f"more than Pillow's limit of {(limit or 0) / 1e6:.1f} megapixels (PIL.Image.MAX_IMAGE_PIXELS, its "
              "guard against decompression bombs); shrink it, e.g. with Pillow: image.thumbnail((2048, 2048)), and "
              "save it (the model's processor makes every image far smaller anyway)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
                image.verify()  # the whole file; it cannot be read after this
            with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
                mode, (width, height), frames = image.mode, image.size, getattr(image, "n_frames", 1)
                animated = frames > 1 and image.format != "MPO"  # a camera's MPO: a photo and its previews
                jpeg = image.format in ("JPEG", "MPO")
    except Image.DecompressionBombError:
        return f"is over twice as large as Pillow opens: {shrink}"
    except (OSError, SyntaxError, ValueError, EOFError) as error:
        return f"is not an image Pillow can read ({_shown(str(error))}); give a PNG or JPEG file"
    if limit and width * height > limit:
        return f"is {width:,} x {height:,} pixels ({width * height / 1e6:.1f} megapixels), {shrink}"
    if animated:
        return (f"is animated ({frames} frames): only its first frame would be used; give a still image, e.g. its "
                "first frame saved as PNG")
    if mode not in STILL_MODES:
        deep = " after scaling its values to 0-255 (.convert clips higher ones)" if mode[0] in "IF" else ""
        return (f"is a {MODE_NAMES.get(mode, mode)} image (mode {mode}), which the model's processor does not read "
                f"as 8-bit colours; convert it to RGB{deep}, e.g. with Pillow: "
                "Image.open(path).convert(\"RGB\").save(\"new.png\")")
    return _cut_short(source) if jpeg else ""


def _cut_short(source: Path | bytes) -> str:
    """A JPEG decoded, to find one whose file ends before its picture does: verify() reads none of a
    JPEG's image data, and Pillow raises on such a file only when the collator decodes it, in the
    middle of training. Decoded at an eighth of its size (draft: the decoder's own scaling, about
    5 ms for a 1-megapixel photo here), which still reads every byte."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
            image.draft("RGB", (64, 64))
            image.load()
    except (OSError, SyntaxError, ValueError, EOFError) as error:
        return (f"is a JPEG that is cut short or damaged ({_shown(str(error))}): it would stop the run when "
                "its batch comes; copy the file again, or save it anew")
    return ""


def _placeholder_problem(record: dict, columns: dict[str, str], kind: DatasetKind, count: int, images: str) -> str:
    """Whether the record's image placeholders match its `count` images, as TRL's
    prepare_multimodal_messages counts them: the {"type": "image"} parts of its messages (`messages`,
    else `prompt`, which get the images; an answer gets none), plus one per image before the first
    user message whose content is text. Text (standard) data holds the model's own image token
    instead, which only its processor knows: not checked."""
    by_name = {name: column for column, name in columns.items()}
    target = next((name for name in ("messages", "prompt") if name in by_name), None)
    if target is None:
        return ""  # no column gets the images: data_check.fit_problems refuses such data
    for name, column in by_name.items():
        messages = record.get(column)
        if kind.formats.get(name) != "conversational" or not isinstance(messages, list):
            continue
        placed = sum(1 for m in messages if m.get("role") != "tool" and isinstance(m.get("content"), list)
                     for part in m["content"] if isinstance(part, dict) and part.get("type") == "image")
        added = count if any(m.get("role") == "user" and isinstance(m.get("content"), str) for m in messages) else 0
        if name == target and placed + added != count:
            counted = (f", counting the {added} TRL puts before the first user message whose content is text"
                       if added else "")
            return (f"`{column}` has {_count(placed + added, 'image placeholder')} ({{\"type\": \"image\"}} "
                    f"parts{counted}) but `{images}` has {_count(count, 'image')}; TRL fills the placeholders with "
                    "the images in order: give one placeholder per image")
        if name != target and placed:
            return (f"`{column}` has {_count(placed, 'image placeholder')}; TRL gives the images to `{by_name[target]}`"
                    " only: move the placeholders there")
    return ""


def _count(number: int, thing: str) -> str:
    return f"{number} {thing}{'' if number == 1 else 's'}"


def _a(value) -> str:
    """A value's kind, in words (for a value that is not what it should be)."""
    return {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object",
            type(None): "missing", str: "empty"}.get(type(value), type(value).__name__)


def _shown(value) -> str:
    """A value (an image's path) as a message shows it: at most SHOWN characters; bytes as such."""
    if isinstance(value, dict):
        value = value.get("path") or "image bytes"
    text = str(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN // 2]}...{text[-SHOWN // 2 + 3:]}"


def _order_cases(record: dict, columns: dict[str, str]) -> dict[str, str]:
    """The kinds of turns out of order (ORDER_CASES) in the conversations TRL builds from this
    record (the prompt, then each answer), each with where: {} if none or not conversational."""
    column = {name: c for c, name in columns.items() if isinstance(record.get(c), list)}
    answers = [name for name in ("completion", "chosen", "rejected") if name in column]
    if "prompt" in column:
        chats = [(f"`{column['prompt']}` then `{column[a]}`", record[column["prompt"]] + record[column[a]])
                 for a in answers] or [(f"`{column['prompt']}`", record[column["prompt"]])]
    else:
        chats = [(f"`{column[name]}`", record[column[name]]) for name in ("messages", *answers) if name in column]
    found = {}
    for label, messages in chats:
        roles = [m["role"] for m in messages]
        first = 1 if roles[:1] == ["system"] else 0
        if roles[first:first + 1] == ["assistant"]:
            found.setdefault("assistant first", f"{label}: message {first + 1}")
        for i in range(first + 1, len(roles)):
            if roles[i] == roles[i - 1] and roles[i] in ("user", "assistant"):
                found.setdefault(f"{roles[i]} twice", f"{label}: messages {i} and {i + 1}")
    return found


def _order_text(what: str, case: str, count: int, places: list[str], detail: str, read: int) -> str:
    have, fix = ORDER_CASES[case]
    if count == 1:
        have = have.replace("start ", "starts ").replace("have ", "has ")
    where = ", ".join(places) + (", ..." if count > len(places) else "")
    return (f"{what}: {count:,} {'record' if count == 1 else 'records'} of the first {read:,} {have} ({where}; "
            f"the first, {places[0]}, in {detail}); {fix} ({_TRAINS_ANYWAY})")


# --- the model's tokenizer ---------------------------------------------------------------------

def tokenizer_folder(model: str) -> Path | None:
    """The folder of the model's tokenizer when it is on this machine (a folder, the Hub cache,
    the built-in model once built), else None."""
    if model == BUILTIN_MODEL:
        folder = cache_dir() / "models" / TINY_MODEL_FOLDER
    elif sources._looks_local(model):
        folder = Path(model).expanduser()
    else:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "tokenizer.json") if sources.HUB_ID.match(model) else None
        folder = Path(cached).parent if isinstance(cached, str) else None
    return folder if folder is not None and (folder / "tokenizer.json").is_file() else None


def local_tokenizer(model: str):
    """The model's tokenizer when its files are on this machine (tokenizer_folder), else None. Its
    fast tokenizer (tokenizer.json) only: no conversion of a slow one, no torch, no weights.
    Cached while its files are unchanged."""
    folder = tokenizer_folder(model)
    if folder is None:
        return None
    stamp = tuple((f.name, f.stat().st_mtime_ns) for f in sorted(folder.iterdir())
                  if f.name.startswith(("tokenizer", "special_tokens", "chat_template")))
    return _load_tokenizer(str(folder), stamp)


@lru_cache(maxsize=4)
def _load_tokenizer(folder: str, stamp: tuple):
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(folder)
    except (OSError, ValueError, TypeError, KeyError):
        return None  # unreadable here: the run loads it with AutoTokenizer and says what is wrong


def _template(args: dict):
    """The chat template TRL will use: None (the tokenizer's own), a .jinja file's text
    (chat_template_path), or False when it comes from another model (not read here)."""
    path = args.get("chat_template_path")
    if not path:
        return None
    path = Path(str(path)).expanduser()
    return path.read_text(encoding="utf-8") if path.suffix in (".jinja", ".j2") and path.is_file() else False


def _conversations(named: dict) -> list[tuple[str, list, bool]]:
    """The conversations TRL renders from a record: (label, messages, as a prompt to answer)."""
    lists = {c: v for c, v in named.items() if isinstance(v, list) and c not in ("tools",)}
    answers = [c for c in ("completion", "chosen", "rejected") if c in lists]
    if "prompt" in lists:
        return [("`prompt`", lists["prompt"], True)] + [
            (f"`prompt` then `{a}`", lists["prompt"] + lists[a], False) for a in answers]
    return [(f"`{c}`", lists[c], False) for c in ("messages", *answers) if c in lists]


def _render(tokenizer, messages: list, prompt: bool, named: dict, template, args: dict) -> str:
    tools = named.get("tools")
    tools = json.loads(tools) if isinstance(tools, str) else tools  # as TRL reads a tools column
    kwargs = {**(args.get("chat_template_kwargs") or {}), **(named.get("chat_template_kwargs") or {})}
    return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                         add_generation_prompt=prompt, **kwargs)


def render_problems(first: list, tokenizer, template, args: dict, what: str) -> list[str]:
    """The first of these (where, record) whose conversations the model's chat template cannot
    render, as TRL will render them (apply_chat_template), with the template's own message."""
    for where, named in first:
        for label, messages, prompt in _conversations(named):
            try:
                _render(tokenizer, messages, prompt, named, template, args)
            except Exception as error:  # noqa: BLE001 - a template's raise_exception, or any error in its code
                return [f"{what}: {where}: the model's chat template cannot render {label} ({type(error).__name__}: "
                        f"{error}); TRL renders every record with it, so the run would stop there: change the "
                        "record, or give the model a template that takes it (chat_template_path)"]
    return []


def _counter(tokenizer, limit: int, template, args: dict):
    """count(record) -> its tokens as TRL counts them (the chat template's text), counting only
    as far as needed: each text is cut to LIMIT x FAR x 16 characters first, and a cut record's
    tokens are scaled up from its cut part's once they are past FAR x max_length."""
    def count(named: dict) -> int:
        cap = limit * FAR * 16
        while True:
            part, cut = _cut(named, cap)
            conversations = _conversations(part)
            try:
                text = max((_render(tokenizer, m, p, part, template, args) for _, m, p in conversations), key=len) \
                    if conversations else _text(part)
            except Exception:  # noqa: BLE001 - render_problems reports a template that fails
                text = _text(part)
            tokens = len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
            if not cut:
                return tokens
            if tokens > limit * FAR:
                return tokens * _characters(named) // max(1, _characters(part))
            cap *= 8

    return count


def _cut(named: dict, cap: int) -> tuple[dict, bool]:
    """The record with every text cut to `cap` characters, and whether any was."""
    cut = False

    def short(value):
        nonlocal cut
        if isinstance(value, str) and len(value) > cap:
            cut = True
            return value[:cap]
        if isinstance(value, list):
            return [{**m, "content": short(m.get("content"))} if isinstance(m, dict) else m for m in value]
        return value

    return {c: v if c in ("tools", "chat_template_kwargs") else short(v) for c, v in named.items()}, cut


def _text(named: dict) -> str:
    """A standard (text) record's text as TRL joins it: the prompt, then the longer answer."""
    answers = [v for c, v in named.items() if c in ("completion", "chosen", "rejected") and isinstance(v, str)]
    return "".join(v for c, v in named.items() if isinstance(v, str) and c not in ("completion", "chosen", "rejected")) \
        + max(answers, key=len, default="")
