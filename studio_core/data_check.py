"""What a dataset holds, as TRL reads it, and whether the chosen trainer can train on it.

TRL names a dataset's *type* by its columns (language modeling, prompt-only, preference, ...),
first match wins (a stray `prompt` next to `messages` makes SFT read prompt-completion pairs),
and its *format* by its values: strings ("standard") or lists of {role, content} messages
("conversational"). `data_files.read_rows` reads a file's first records, `detect` names their type and
format as TRL does, and `fit_problems` says what to change for a trainer, in the studio's terms:
`studio.column_map` (rename) and `studio.keep_columns` (keep only these, after renaming), which
`prepare_dataset` applies in the worker as `apply_column_map` does here; `suggest_fix` gives
those keys as data, for the page to apply in one click. `scan_file` reads a whole local file
(up to SCAN_LIMIT records) for the malformed records and empty values TRL would stop at mid-run,
and the turns a chat template would drop (an unknown role, content that is not text); turns
out of order it gives as warnings.
This runs in the web app's process: stdlib and pyarrow only, never `datasets`, torch or trl.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from studio_core import trainers
from studio_core.data_files import read_rows, records

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
    return DatasetKind(kind, fmt, columns, f"{kind.replace('_', '-')} data ({detail}) in {_names(used)}",
                       used, formats)


def _value_format(value) -> str:
    if isinstance(value, str):
        return "standard"
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        return "conversational"  # TRL's is_conversational looks for "role" in the first message
    return "missing in some records" if value is None else "neither text nor {role, content} messages"


def fit_problems(kind: DatasetKind, trainer: str, extra_columns_ok: set[str] = frozenset()) -> list[str]:
    """What stops `trainer` from training on data of this kind, each with the fix."""
    try:
        accepted = trainers.get(trainer).data_types
    except KeyError as error:
        return [str(error).strip("'\"")]
    if kind.type not in accepted:
        return [_mismatch(kind, trainer)]
    problems = []
    if kind.format not in ("conversational", "standard"):
        problems.append(f"dataset: {kind.description}; TRL needs every one of {_names(kind.used)} in one "
                        "format, all plain text or all lists of {role, content} messages, in every record")
    surplus = _surplus(kind, trainer, extra_columns_ok)
    if surplus:
        keep = ", ".join(_wanted(kind))
        problems.append(f"dataset: {trainers.get(trainer).name} would not use {_names(surplus)}, since TRL reads "
                        f"this as {kind.description}; keep only {keep} with studio.keep_columns: [{keep}]")
    return problems


def _surplus(kind: DatasetKind, trainer: str, extra_columns_ok=frozenset()) -> list[str]:
    """Columns the trainer would not read (a trainer with rewards hands any other column to them)."""
    if trainers.get(trainer).rewards:
        return []
    return [c for c in kind.columns if c not in kind.used and c not in extra_columns_ok and c not in TRL_EXTRAS]


def _wanted(kind: DatasetKind) -> list[str]:
    """The columns TRL reads from data of this kind: its type's own, and TRL's extras present."""
    return [*kind.used, *(c for c in kind.columns if c in TRL_EXTRAS)]


def _mismatch(kind: DatasetKind, trainer: str) -> str:
    spec = trainers.get(trainer)
    unpaired = _unpaired_column_map(kind)
    if unpaired is not None and "preference" in spec.data_types and "unpaired_preference" not in spec.data_types:
        # a trainer of pairs given single labelled answers: no renaming of columns makes pairs
        found = (kind.description if kind.type == "unpaired_preference"
                 else f"columns {_names(kind.columns)}, which look like unpaired preference data")
        takers = trainers.taking("unpaired_preference")
        keys = [f"studio.trainer: {takers[0].key}"] + [
            f"studio.column_map: {{{', '.join(f'{a}: {b}' for a, b in unpaired.items())}}}"] * bool(unpaired)
        return (f"dataset: {spec.name} needs {spec.data_help}; this dataset has {found}: one answer per prompt, "
                f"labelled desirable or not, where {spec.name} needs pairs (a chosen and a rejected answer to the "
                f"same prompt), which no renaming of columns makes; train it with "
                f"{' or '.join(t.name for t in takers)}, which takes unpaired preference data ({', '.join(keys)}), "
                f"or give {spec.name} a dataset of pairs")
    lm = [c for c in ("messages", "text") if c in kind.columns]
    if "language_modeling" in spec.data_types and lm:
        return (f"dataset: {_names(kind.used)} beside `{lm[0]}`: TRL reads {_names(kind.used)} first and "
                f"treats this as {kind.type.replace('_', '-')} data, so `{lm[0]}` would not be trained on; "
                f"keep only {lm[0]} with studio.keep_columns: [{lm[0]}]")
    targets = [TYPE_COLUMNS[t] for t in spec.data_types] + [("text",)] * ("language_modeling" in spec.data_types)
    nearest = max(targets, key=lambda t: len(set(t) & set(kind.columns)))
    missing = [c for c in nearest if c not in kind.columns]
    mapping = suggest_column_map(list(kind.columns), trainer)
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
    return f"dataset: {spec.name} needs {spec.data_help}; this dataset has {found}: {fix}"


def _unpaired_column_map(kind: DatasetKind) -> dict[str, str] | None:
    """The renames (maybe none) that make this unpaired preference data (prompt, completion, label),
    as the trainer that takes it would find them; None if it is not such data."""
    if kind.type == "unpaired_preference":
        return {}
    for taker in trainers.taking("unpaired_preference"):
        mapping = suggest_column_map(list(kind.columns), taker.key)
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
    spec, present, mapping = trainers.TRAINERS.get(trainer), set(columns), {}
    if spec is None:
        return {}
    if "language_modeling" in spec.data_types and {"messages", "text"} & present:
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

    for role in spec.roles:
        if not pick(role.column, role.also) and role.required:
            return {}
    if spec.rewards and "completion" in present and "reference" not in present:
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
    columns = list(dict.fromkeys(key for row in rows for key in row))
    if not check_mapping(columns, column_map, keep_columns) and _fits(
            detect(apply_column_map(rows, column_map, keep_columns), text_field), trainer):
        return {}
    own = {} if check_mapping(columns, column_map, None) else dict(column_map or {})
    more = suggest_column_map([own.get(c, c) for c in columns], trainer)
    mapping = {old: more.get(new, new) for old, new in own.items()}
    mapping |= {c: new for c, new in more.items() if c not in own.values()}
    mapping = {old: new for old, new in mapping.items() if old != new}
    if check_mapping(columns, mapping, None):
        return {}
    keep = []
    for _ in range(3):  # a rename, then at most two narrowings (e.g. leave out `rejected`, then surplus)
        kind = detect(apply_column_map(rows, mapping, keep), text_field)
        if _fits(kind, trainer):
            return ({"column_map": mapping} if mapping != (column_map or {}) else {}) | (
                {"keep_columns": keep} if keep != (keep_columns or []) else {})
        keep = _columns_to_keep(kind, trainer, text_field)
        if not keep:
            return {}
    return {}


def _fits(kind: DatasetKind, trainer: str) -> bool:
    """True when the trainer reads every column of data of this kind (formats aside)."""
    return kind.type in trainers.get(trainer).data_types and not _surplus(kind, trainer)


def _columns_to_keep(kind: DatasetKind, trainer: str, text_field: str) -> list[str]:
    """The columns to keep so that TRL reads this data as a type the trainer takes; [] if none."""
    accepted_types = trainers.get(trainer).data_types
    if kind.type in accepted_types:
        return _wanted(kind)
    extras = [c for c in kind.columns if c in TRL_EXTRAS]
    lm = [c for c in ("messages", text_field) if c in kind.columns]
    if "language_modeling" in accepted_types and lm:  # e.g. a stray `prompt` beside `messages`
        return [lm[0], *extras]
    accepted = {c for t in accepted_types for c in TYPE_COLUMNS[t]}
    blocking = [c for c in kind.used if c not in accepted]  # e.g. `chosen`, `rejected` for GRPO
    return [c for c in kind.columns if c not in blocking] if blocking else []


# --- the whole file, before launch -----------------------------------------------------------

SCAN_LIMIT = 100_000  # records the pre-launch scan reads at most
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


class Scan(list):
    """scan_file's answer: the refusals, a list of messages as before (empty: the file may be
    trained on), and `warnings`: records that train, but likely not as meant, by line or row."""

    def __init__(self, problems=(), warnings=()):
        super().__init__(problems)
        self.warnings = list(warnings)


def scan_file(path: Path, column_map: dict | None = None, keep_columns: list | None = None,
              text_field: str = "text", limit: int = SCAN_LIMIT, most: int = 5) -> Scan:
    """Each record of a local file (the first `limit`) where the trainer will read it: the columns
    TRL reads from data of the type and format of the first rows (after the column map and
    keep-columns, which `check_mapping` has passed). The first `most` bad records by line (or
    row) and column, then how many more; none if none. Mid-run, `datasets` or TRL would fail on
    such a record with their own error, or train on it, or (a turn of an unknown role, content
    that is not text) the chat template would drop it. `warnings` names the first `most`
    conversations whose turns are out of order the same way."""
    path, renamed = Path(path), {new: old for old, new in (column_map or {}).items()}
    problems, warnings, bad, odd, read = [], [], 0, 0, 0
    try:
        kind = detect(apply_column_map(read_rows(path), column_map, keep_columns), text_field)
        columns = {renamed.get(c, c): c for c in kind.used}  # name in the file -> name TRL sees
        for where, record in records(path, columns=list(columns)):
            if read == limit:
                break
            read += 1
            problem = str(record) if isinstance(record, ValueError) else _record_problem(record, columns, kind)
            bad += bool(problem)
            if problem and bad <= most:
                problems.append(f"dataset: {problem}" if isinstance(record, ValueError)
                                else f"dataset: {path}: {where}: {problem}")
            warning = "" if problem else _order_warning(record, columns)
            odd += bool(warning)
            if warning and odd <= most:
                warnings.append(f"dataset: {path}: {where}: {warning}")
    except ValueError as error:  # the file cannot be read past here
        problems.append(f"dataset: {error}")
    if bad > most:
        problems.append(f"dataset: {path}: {bad - most} more bad records in the first {read:,}; "
                        "fix or remove each of them")
    if odd > most:
        warnings.append(f"dataset: {path}: {odd - most} more records with turns out of order in the first {read:,}")
    return Scan(problems, warnings)


def _record_problem(record: dict, columns: dict[str, str], kind: DatasetKind) -> str:
    calls = any(isinstance(m, dict) and m.get("tool_calls") for c in columns
                if isinstance(record.get(c), list) for m in record[c])
    for column, name in columns.items():
        value = record.get(column)
        problem = ("is missing; every record needs one" if value is None else "" if name == "label"
                   else _value_problem(value, kind.formats.get(name, "")) or _messages_problem(value, calls))
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


def _messages_problem(value, tool_calls: bool) -> str:
    """The first message (of a list `_value_problem` passed) whose turn the chat template would drop
    or empty; `tool_calls`: the record has a tool call, so `tool` messages are taken. "" if none."""
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
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            if content is None:
                return f"message {number} (`{role}`) has no `content`; give it its text"
            what = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}.get(
                type(content), type(content).__name__)
            fix = (f"write it in quotes, {json.dumps(str(content))}" if what == "a number"
                   else "write the message's text as one string")
            return (f"message {number} (`{role}`) has {what} as its `content`, not text (chat templates render it "
                    f"as empty or fail); {fix}")
    return ""


def _order_warning(record: dict, columns: dict[str, str]) -> str:
    """Turns out of order in a conversation TRL builds from this record (the prompt, then each
    answer); "" if none or if the record is not conversational."""
    column = {name: c for c, name in columns.items() if isinstance(record.get(c), list)}
    answers = [name for name in ("completion", "chosen", "rejected") if name in column]
    if "prompt" in column:
        chats = [(f"`{column['prompt']}` then `{column[a]}`", record[column["prompt"]] + record[column[a]])
                 for a in answers] or [(f"`{column['prompt']}`", record[column["prompt"]])]
    else:
        chats = [(f"`{column[name]}`", record[column[name]]) for name in ("messages", *answers) if name in column]
    for label, messages in chats:
        roles = [m["role"] for m in messages]
        first = 1 if roles[:1] == ["system"] else 0
        if roles[first:first + 1] == ["assistant"]:
            return (f"{label}: the conversation starts with an `assistant` turn (message {first + 1}), before any "
                    f"user turn; put the user's message first ({_TRAINS_ANYWAY})")
        for i in range(first + 1, len(roles)):
            if roles[i] == roles[i - 1] and roles[i] in ("user", "assistant"):
                fix = "the assistant's answer" if roles[i] == "user" else "the user's message"
                return (f"{label}: messages {i} and {i + 1} are both `{roles[i]}` turns; merge them or put {fix} "
                        f"between them ({_TRAINS_ANYWAY})")
    return ""
