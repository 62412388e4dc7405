"""What a dataset holds, as TRL reads it, and whether the chosen trainer can train on it.

TRL names a dataset's *type* by its columns (language modeling, prompt-only, preference, ...),
first match wins (a stray `prompt` next to `messages` makes SFT read prompt-completion pairs),
and its *format* by its values: strings ("standard") or lists of {role, content} messages
("conversational"). `data_files.read_rows` reads a file's first records, `detect` names their type and
format as TRL does, and `fit_problems` says what to change for a trainer, in the studio's terms:
`studio.column_map` (rename) and `studio.keep_columns` (keep only these, after renaming), which
`prepare_dataset` applies in the worker as `apply_column_map` does here; `suggest_fix` gives
those keys as data, for the page to apply in one click. `data_scan.scan_file` reads the whole file.

A dataset with an `images` column (a list of images a record) or an `image` column (one) is
*vision* data, as TRL's trainers tell (`"image" in sample or "images" in sample`): `detect` names
the column (`DatasetKind.images`, `.vision`), and `fit_problems` refuses a trainer that TRL 1.16
does not train on images of that type (IMAGE_DATA_TYPES).

This runs in the web app's process: stdlib and pyarrow only, never `datasets`, torch or trl.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from studio_core.recipe import trainers

# The columns each TRL dataset type is read from, in TRL's order of precedence.
TYPE_COLUMNS = {
    "preference": ("prompt", "chosen", "rejected"),
    "preference_implicit": ("chosen", "rejected"),
    "unpaired_preference": ("prompt", "completion", "label"),
    "prompt_completion": ("prompt", "completion"),
    "prompt_only": ("prompt",),
    "language_modeling": ("messages",),  # or the text column (SFT's dataset_text_field)
}
# Columns TRL's trainers read besides the type's own; never reported as surplus.
TRL_EXTRAS = frozenset({"images", "image", "tools", "chat_template_kwargs"})
IMAGE_COLUMNS = ("images", "image")  # TRL's: a list of images a record, or one (read first when both are there)
# The dataset types each TRL trainer class trains on with images, in TRL 1.16: SFT's
# DataCollatorForVisionLanguageModeling (messages or text, prompt and completion); DPO's
# DataCollatorForVisionPreference reads `prompt` (image data skips the prompt's extraction from
# `chosen` and `rejected`); KTO refuses paired image data ("Vision datasets must be in unpaired
# format"); GRPO and RLOO take images with their prompts, conversational only ("Multimodal training
# requires conversational prompts"). RewardTrainer reads no images.
IMAGE_DATA_TYPES = {
    "SFTTrainer": ("language_modeling", "prompt_completion"),
    "DPOTrainer": ("preference",),
    "KTOTrainer": ("unpaired_preference",),
    "GRPOTrainer": ("prompt_only", "prompt_completion"),
    "RLOOTrainer": ("prompt_only", "prompt_completion"),
}
IMAGE_CHATS_ONLY = ("GRPOTrainer", "RLOOTrainer")
_GUESSES = {  # usual names for a column, in order of preference (compared case-insensitively)
    "prompt": ("question", "instruction", "query", "input", "problem"),
    "completion": ("answer", "response", "output", "solution", "target", "reply"),
    "chosen": ("accepted", "better", "preferred", "chosen_response", "good", "winner", "positive"),
    "rejected": ("rejected_response", "worse", "dispreferred", "bad", "loser", "negative"),
    "label": ("desirable", "is_desirable", "thumbs_up", "liked"),
}


@dataclass(frozen=True)
class DatasetKind:
    type: str  # a TYPE_COLUMNS key, or "unknown"
    format: str  # "conversational", "standard", "mixed" (some of each), "invalid", or "" if unknown
    columns: tuple[str, ...]  # every column of the records, in order of first appearance
    description: str  # for people, e.g. "preference data (conversational) in `prompt`, `chosen`, `rejected`"
    used: tuple[str, ...] = ()  # the columns TRL reads this type from
    formats: dict[str, str] = field(default_factory=dict)  # format of each used column
    images: str = ""  # the column TRL reads images from (IMAGE_COLUMNS), "" for text data

    @property
    def vision(self) -> bool:
        """Vision data: TRL hands each record's images to the model's processor with its text."""
        return bool(self.images)


def detect(rows: list[dict], text_field: str = "text") -> DatasetKind:
    """The TRL type and format of these records (`text_field`: SFT's dataset_text_field)."""
    columns = tuple(dict.fromkeys(key for row in rows for key in row))
    present = set(columns)
    if {"chosen", "rejected"} <= present:
        kind = "preference" if "prompt" in present else "preference_implicit"
    elif "prompt" in present:  # TRL looks for `prompt` before `messages`
        kind = "prompt_only" if "completion" not in present else (
            "unpaired_preference" if "label" in present else "prompt_completion")
    elif "messages" in present or text_field in present:
        kind = "language_modeling"
    else:
        return DatasetKind("unknown", "", columns, "no column TRL reads (prompt, completion, chosen, "
                           f"rejected, messages, {text_field})")
    used = TYPE_COLUMNS[kind] if "messages" in present or kind != "language_modeling" else (text_field,)
    formats = {}
    for column in (c for c in used if c != "label"):
        found = {_value_format(row.get(column)) for row in rows}
        odd = sorted(found - {"conversational", "standard"})  # a missing value says more than "mixed"
        formats[column] = found.pop() if len(found) == 1 else odd[0] if odd else "mixed"
    found = set(formats.values())
    fmt = (found.pop() if found in ({"conversational"}, {"standard"})
           else "mixed" if found == {"conversational", "standard"} else "invalid")
    detail = fmt if fmt in ("conversational", "standard") else ", ".join(f"`{c}` {f}" for c, f in formats.items())
    images = next((c for c in IMAGE_COLUMNS if c in present), "")
    return DatasetKind(kind, fmt, columns, f"{kind.replace('_', '-')} data ({detail}) in {_names(used)}"
                       + (f", with images in `{images}`" if images else ""), used, formats, images)


def _value_format(value) -> str:
    if isinstance(value, str):
        return "standard"
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        return "conversational"  # TRL's is_conversational looks for "role" in the first message
    return "missing in some records" if value is None else "neither text nor {role, content} messages"


def fit_problems(kind: DatasetKind, trainer: str, extra_columns_ok: set[str] = frozenset()) -> list[str]:
    """What stops `trainer` from training on data of this kind, each with the fix."""
    try:
        entry = trainers.get(trainer)
    except KeyError as error:
        return [str(error).strip("'\"")]
    if kind.type not in entry.data_types:
        return [_mismatch(kind, entry)]
    problems = []
    if kind.format not in ("conversational", "standard"):
        problems.append(f"dataset: {kind.description}; TRL needs every one of {_names(kind.used)} in one "
                        "format, all plain text or all lists of {role, content} messages, in every record")
    surplus = _surplus(kind, entry, extra_columns_ok)
    if surplus:
        keep = ", ".join(_wanted(kind))
        problems.append(f"dataset: {entry.name} would not use {_names(surplus)}, since TRL reads "
                        f"this as {kind.description}; keep only {keep} with studio.keep_columns: [{keep}]")
    return problems + (_image_problems(kind, entry) if kind.vision else [])


def _image_problems(kind: DatasetKind, entry: trainers.Trainer) -> list[str]:
    """What stops `entry` from training on this vision data (IMAGE_DATA_TYPES), each with the fix."""
    problems = []
    if set(IMAGE_COLUMNS) <= set(kind.columns):
        keep = ", ".join(c for c in kind.columns if c != "images")
        problems.append("dataset: has both `image` and `images`; TRL makes `image` each record's only image and "
                        f"drops `images`: keep one of them, e.g. studio.keep_columns: [{keep}]")
    types = IMAGE_DATA_TYPES.get(entry.trainer_class, ())
    takers = [t.name for t in trainers.TRAINERS.values()
              if kind.type in IMAGE_DATA_TYPES.get(t.trainer_class, ()) and kind.type in t.data_types]
    others = f"; or train it with {' or '.join(takers)}" if takers else ""
    if not types:
        keep = ", ".join(c for c in kind.columns if c not in IMAGE_COLUMNS)
        use = takers or [t.name for t in trainers.TRAINERS.values() if t.trainer_class in IMAGE_DATA_TYPES]
        problems.append(f"dataset: {entry.name} does not train on images (TRL's {entry.trainer_class} reads no "
                        f"`{kind.images}` column); train on this data with {' or '.join(use)}, or leave the images "
                        f"out with studio.keep_columns: [{keep}]")
    elif kind.type not in types:
        fix = {"preference_implicit": "give each record its prompt, with the image placeholders, in a `prompt` "
                                      "column, and only the answers in `chosen` and `rejected`",
               "preference": "unpair it: one record per answer, with `prompt`, `completion`, and `label` (true for "
                             "the chosen answer, false for the rejected one)"}.get(kind.type, "")
        named = " or ".join(t.replace("_", "-") for t in types)
        problems.append(f"dataset: {entry.name} trains on images only in {named} data (TRL's {entry.trainer_class}); "
                        f"this dataset has {kind.description}"
                        f"{': ' + fix if fix else ''}{others}")
    elif entry.trainer_class in IMAGE_CHATS_ONLY and kind.format != "conversational":
        problems.append(f"dataset: {entry.name} trains on images only with conversational prompts (TRL's "
                        f"{entry.trainer_class}); this dataset has {kind.description}: write each prompt as a list "
                        'of messages, e.g. [{"role": "user", "content": [{"type": "image"}, {"type": "text", '
                        '"text": "What is in the picture?"}]}]')
    return problems


def _surplus(kind: DatasetKind, entry: trainers.Trainer, extra_columns_ok=frozenset()) -> list[str]:
    """Columns the trainer would not read (a trainer with rewards hands any other column to them)."""
    if entry.rewards:
        return []
    return [c for c in kind.columns if c not in kind.used and c not in extra_columns_ok and c not in TRL_EXTRAS]


def _wanted(kind: DatasetKind) -> list[str]:
    """The columns TRL reads from data of this kind: its type's own, and TRL's extras present."""
    return [*kind.used, *(c for c in kind.columns if c in TRL_EXTRAS)]


def _mismatch(kind: DatasetKind, entry: trainers.Trainer) -> str:
    unpaired = _unpaired_column_map(kind)
    if unpaired is not None and "preference" in entry.data_types and "unpaired_preference" not in entry.data_types:
        # a trainer of pairs given single labelled answers: no renaming of columns makes pairs
        found = (kind.description if kind.type == "unpaired_preference"
                 else f"columns {_names(kind.columns)}, which look like unpaired preference data")
        takers = trainers.taking("unpaired_preference")
        keys = [f"studio.trainer: {takers[0].key}"] + [
            f"studio.column_map: {{{', '.join(f'{a}: {b}' for a, b in unpaired.items())}}}"] * bool(unpaired)
        return (f"dataset: {entry.name} needs {entry.data_help}; this dataset has {found}: one answer per prompt, "
                f"labelled desirable or not, where {entry.name} needs pairs (a chosen and a rejected answer to the "
                f"same prompt), which no renaming of columns makes; train it with "
                f"{' or '.join(t.name for t in takers)}, which takes unpaired preference data ({', '.join(keys)}), "
                f"or give {entry.name} a dataset of pairs")
    lm = [c for c in ("messages", "text") if c in kind.columns]
    if "language_modeling" in entry.data_types and lm:
        return (f"dataset: {_names(kind.used)} beside `{lm[0]}`: TRL reads {_names(kind.used)} first and "
                f"treats this as {kind.type.replace('_', '-')} data, so `{lm[0]}` would not be trained on; "
                f"keep only {lm[0]} with studio.keep_columns: [{lm[0]}]")
    targets = [TYPE_COLUMNS[t] for t in entry.data_types] + [("text",)] * ("language_modeling" in entry.data_types)
    nearest = max(targets, key=lambda t: len(set(t) & set(kind.columns)))
    missing = [c for c in nearest if c not in kind.columns]
    mapping = _column_map(list(kind.columns), entry)
    accepted = {c for t in targets for c in t}
    blocking = [c for c in kind.used if c not in accepted and c not in mapping]
    keep = [mapping.get(c, c) for c in kind.columns if c not in blocking]
    fixes = []
    if mapping:
        fixes.append("map " + ", ".join(f"`{a}` to `{b}`" for a, b in mapping.items())
                     + f" with studio.column_map: {{{', '.join(f'{a}: {b}' for a, b in mapping.items())}}}")
    elif missing:
        fixes.append(f"map columns to {_names(missing)} with studio.column_map")
    if blocking and keep and (mapping or not missing):
        fixes.append(f"leave out {_names(blocking)} with studio.keep_columns: [{', '.join(keep)}]")
    fix = ", and ".join(fixes)
    others = [t.name for t in trainers.taking(kind.type)]
    if others:  # the data may be right and the trainer wrong: unpaired preference data is KTO's
        fix += (f"{'; or ' if fix else ''}train it with {' or '.join(others)}, which "
                f"{'take' if len(others) > 1 else 'takes'} {kind.type.replace('_', ' ')} data")
    found = kind.description if kind.type != "unknown" else f"columns {_names(kind.columns) or 'none'}"
    return f"dataset: {entry.name} needs {entry.data_help}; this dataset has {found}: {fix}"


def _unpaired_column_map(kind: DatasetKind) -> dict[str, str] | None:
    """The renames (maybe none) that make this unpaired preference data (prompt, completion, label),
    as the trainer that takes it would find them; None if it is not such data."""
    if kind.type == "unpaired_preference":
        return {}
    for taker in trainers.taking("unpaired_preference"):
        mapping = _column_map(list(kind.columns), taker)
        renamed = {mapping.get(c, c) for c in kind.columns}
        if {"prompt", "completion", "label"} <= renamed and not {"chosen", "rejected"} & renamed:
            return mapping
    return None


def _names(columns) -> str:
    return ", ".join(f"`{c}`" for c in columns)


def check_mapping(columns: list[str] | None, column_map: dict | None, keep_columns: list | None) -> list[str]:
    """Problems with studio.column_map ({old: new}, applied first) and studio.keep_columns (new names).

    With `columns` None (a Hub dataset, not read before launch) only their form is checked."""
    column_map, problems = column_map or {}, []
    if not (isinstance(column_map, dict) and all(isinstance(x, str) for x in [*column_map, *column_map.values()])):
        return ["studio.column_map: must map old to new column names, e.g. {question: prompt}"]
    if not (keep_columns is None or isinstance(keep_columns, list) and all(isinstance(c, str) for c in keep_columns)):
        return ["studio.keep_columns: must be a list of column names, e.g. [prompt, completion]"]
    if columns is None:
        return []
    have = ", ".join(columns) or "none"
    for old, new in column_map.items():
        if old not in columns:
            problems.append(f"studio.column_map: no column `{old}` to rename; the dataset has {have}")
        if not new:
            problems.append(f"studio.column_map: the new name for `{old}` is empty")
        elif list(column_map.values()).count(new) > 1:
            problems.append(f"studio.column_map: `{new}` is the new name of more than one column")
        elif new in columns and new not in column_map:
            problems.append(f"studio.column_map: `{old}` becomes `{new}`, but the dataset already has "
                            f"`{new}`; rename or drop that one too")
    renamed = [column_map.get(c, c) for c in columns]
    for column in dict.fromkeys(keep_columns or []):
        if keep_columns.count(column) > 1:
            problems.append(f"studio.keep_columns: `{column}` is listed twice")
        if column not in renamed:
            problems.append(f"studio.keep_columns: no column `{column}` after renaming; there are "
                            f"{', '.join(renamed) or 'none'}")
    return list(dict.fromkeys(problems))


def apply_column_map(rows: list[dict], column_map: dict[str, str] | None,
                     keep_columns: list[str] | None) -> list[dict]:
    """Rename, then keep only `keep_columns` (all when None or empty), as `prepare_dataset` does."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    problems = check_mapping(columns, column_map, keep_columns)
    if problems:
        raise ValueError("; ".join(problems))
    rows = [{(column_map or {}).get(k, k): v for k, v in row.items()} for row in rows]
    return [{c: row.get(c) for c in keep_columns} for row in rows] if keep_columns else rows


def prepare_dataset(dataset, column_map: dict[str, str] | None, keep_columns: list[str] | None):
    """The same renaming and selection on a `datasets.Dataset`, in the worker."""
    problems = check_mapping(list(dataset.column_names), column_map, keep_columns)
    if problems:
        raise ValueError("; ".join(problems))
    if column_map:
        dataset = dataset.rename_columns(dict(column_map))
    if keep_columns:
        dataset = dataset.select_columns(list(keep_columns))
    return dataset


def suggest_column_map(columns: list[str], trainer: str) -> dict[str, str]:
    """A best-guess studio.column_map that makes these columns fit `trainer` (the columns its
    registry entry names, found by their usual names); {} if none is sensible."""
    entry = trainers.TRAINERS.get(trainer)
    return _column_map(columns, entry) if entry is not None else {}


def _column_map(columns: list[str], entry: trainers.Trainer) -> dict[str, str]:
    """suggest_column_map for this registry entry."""
    present, mapping = set(columns), {}
    if "language_modeling" in entry.data_types and {"messages", "text"} & present:
        return {}  # it trains on those as they are

    def pick(target: str, also: tuple[str, ...]) -> bool:
        if target in present:
            return True
        for guess in _GUESSES.get(target, ()) + also:
            for column in columns:
                if column.lower() == guess and column not in mapping:
                    mapping[column] = target
                    return True
        return False

    for role in entry.roles:
        if not pick(role.column, role.also) and role.required:
            return {}
    if entry.rewards and "completion" in present and "reference" not in present:
        mapping["completion"] = "reference"  # the reward functions read it; exact_match's usual column
    return mapping


def suggest_fix(rows: list[dict], trainer: str, column_map: dict | None = None,
                keep_columns: list | None = None, text_field: str = "text") -> dict:
    """The studio keys to change so that these records' columns fit `trainer`, as data a UI
    applies as is: {"column_map": {old: new}} and/or {"keep_columns": [...]} (an empty one: clear
    it). {} when the columns fit already or no fix is sure; values in the wrong format are not
    fixed by keys. A valid `column_map` of the user's is built on, not thrown away."""
    if trainer not in trainers.TRAINERS or not rows:
        return {}
    entry = trainers.TRAINERS[trainer]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    if not check_mapping(columns, column_map, keep_columns) and _fits(
            detect(apply_column_map(rows, column_map, keep_columns), text_field), entry):
        return {}
    own = {} if check_mapping(columns, column_map, None) else dict(column_map or {})
    more = _column_map([own.get(c, c) for c in columns], entry)
    mapping = {old: more.get(new, new) for old, new in own.items()}
    mapping |= {c: new for c, new in more.items() if c not in own.values()}
    mapping = {old: new for old, new in mapping.items() if old != new}
    if check_mapping(columns, mapping, None):
        return {}
    keep = []
    for _ in range(3):  # a rename, then at most two narrowings (e.g. leave out `rejected`, then surplus)
        kind = detect(apply_column_map(rows, mapping, keep), text_field)
        if _fits(kind, entry):
            return ({"column_map": mapping} if mapping != (column_map or {}) else {}) | (
                {"keep_columns": keep} if keep != (keep_columns or []) else {})
        keep = _columns_to_keep(kind, entry, text_field)
        if not keep:
            return {}
    return {}


def _fits(kind: DatasetKind, entry: trainers.Trainer) -> bool:
    """True when the trainer reads every column of data of this kind (formats aside)."""
    return kind.type in entry.data_types and not _surplus(kind, entry)


def _columns_to_keep(kind: DatasetKind, entry: trainers.Trainer, text_field: str) -> list[str]:
    """The columns to keep so that TRL reads this data as a type the trainer takes; [] if none."""
    accepted_types = entry.data_types
    if kind.type in accepted_types:
        return _wanted(kind)
    extras = [c for c in kind.columns if c in TRL_EXTRAS]
    lm = [c for c in ("messages", text_field) if c in kind.columns]
    if "language_modeling" in accepted_types and lm:  # e.g. a stray `prompt` beside `messages`
        return [lm[0], *extras]
    accepted = {c for t in accepted_types for c in TYPE_COLUMNS[t]}
    blocking = [c for c in kind.used if c not in accepted]  # e.g. `chosen`, `rejected` for GRPO
    return [c for c in kind.columns if c not in blocking] if blocking else []
