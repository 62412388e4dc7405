"""The whole local dataset file, before launch: each record where the trainer will read it.

`scan_file` reads up to SCAN_LIMIT records for the malformed records and empty values TRL
would stop at mid-run, and the turns a chat template would drop (an unknown role, content
that is not text); turns out of order it gives as warnings. The type and format come from
the first rows (studio_core.data_check). This runs in the web app's process: stdlib and
pyarrow only, never `datasets`, torch or trl.
"""

from __future__ import annotations

import json
from pathlib import Path

from studio_core.data_check import DatasetKind, apply_column_map, detect
from studio_core.data_files import read_rows, records

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
    trained on), `warnings`: records that train, but likely not as meant, by line or row, and
    `rows`: the records read (all of them, up to the scan's limit)."""

    def __init__(self, problems=(), warnings=(), rows: int = 0):
        super().__init__(problems)
        self.warnings, self.rows = list(warnings), rows


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
    return Scan(problems, warnings, read)


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
