"""Reward functions for GRPO runs, described as plain data in a recipe's studio block.

    studio:
      trainer: grpo
      rewards:                                        # summed by TRL, each times its weight
        - {name: length, target: 200, weight: 1.0}    # closeness to 200 characters
        - {name: regex, pattern: "^The ", weight: 0.5}  # 1.0 when re.search finds the pattern
        - {name: exact_match, column: reference}      # 1.0 when the text equals the row's `reference`
        - {file: my_rewards.py, function: my_reward, weight: 2.0}  # your own function

`weight` is optional (default 1.0). A `file` path is absolute or relative to the current
directory; its function is called as TRL 1.16's GRPOTrainer calls every reward function:

    my_reward(prompts=[...], completions=[...], completion_ids=[[int, ...], ...],
              <every other dataset column>=[...], trainer_state=TrainerState,
              log_extra=fn(column, values), log_metric=fn(name, value)) -> list[float | None]

so end its signature with `**kwargs`. Completions are strings for a standard dataset and
[{"role": "assistant", "content": ...}] for a conversational one; the built-ins read the last
assistant message. (TRL's own trl.rewards want math answers or <think> tags: none fits these.)

`reward_functions` gives GRPOTrainer(reward_funcs=...) and GRPOConfig(reward_weights=...);
`check_rewards` validates the list and calls every function once on sample rows (or, for a
dataset not read before launch, only imports them: the worker then calls them on its first rows);
`check_rewards_in_subprocess` does that in a child process, so that a user file that hangs or
crashes cannot take the web app with it, and without the Hub token in its environment.
A reward file is code that runs with the user's rights: it is imported and called only on an
explicit action (Start, "Check reward functions"); a plan or a preview only reads it
(`check_rewards(..., user_code=False)`: it parses and defines the function). The child is this module:

    echo '{"rewards": [...], "sample_rows": [...]}' | python -m studio_core.recipe.rewards  # JSON list of problems
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import importlib.util
import inspect
import itertools
import json
import math
import numbers
import os
import re
import signal
import subprocess
import sys
import traceback
from pathlib import Path

from studio_core.machine import children

# Where huggingface_hub finds a token in the environment: never handed to a user's reward code.
HUB_TOKENS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_TOKEN")


def completion_text(completion) -> str:
    """The text of one completion: the string itself, or the last assistant message's content."""
    if isinstance(completion, str):
        return completion
    for message in reversed(completion):
        if message.get("role") == "assistant":
            content = message.get("content") or ""
            if isinstance(content, list):  # multimodal parts: [{"type": "text", "text": ...}, ...]
                return "".join(part.get("text", "") for part in content if part.get("type") == "text")
            return content
    return ""


# Callable classes rather than closures: TRL may pickle reward functions for its async rollout worker.
class LengthReward:
    """-abs(target - len(text)) / 100: 0.0 at `target` characters, -1.0 per 100 characters away.

    This is `reward_len` from TRL's Trainium guide, with the target made a setting."""

    def __init__(self, target: int):
        self.__name__, self.target = "length", target

    def __call__(self, completions, **kwargs) -> list[float]:
        return [-abs(self.target - len(completion_text(c))) / 100 for c in completions]


class RegexReward:
    """1.0 when `re.search(pattern, text)` finds a match, else 0.0."""

    def __init__(self, pattern: str):
        self.__name__, self.pattern = "regex", re.compile(pattern)

    def __call__(self, completions, **kwargs) -> list[float]:
        return [1.0 if self.pattern.search(completion_text(c)) else 0.0 for c in completions]


class ExactMatchReward:
    """1.0 when the text, stripped, equals the row's `column` value, stripped, else 0.0."""

    def __init__(self, column: str):
        self.__name__, self.column = "exact_match", column

    def __call__(self, completions, **kwargs) -> list[float]:
        references = kwargs[self.column]
        return [1.0 if ref is not None and completion_text(c).strip() == str(ref).strip() else 0.0
                for c, ref in zip(completions, references, strict=True)]


# name -> (class, {setting: (type, what it is)})
BUILTINS = {
    "length": (LengthReward, {"target": (int, "a whole number of characters, e.g. target: 200")}),
    "regex": (RegexReward, {"pattern": (str, 'a regular expression, e.g. pattern: "^The "')}),
    "exact_match": (ExactMatchReward, {"column": (str, "a dataset column, e.g. column: reference")}),
}
CALL_SIGNATURE = ("f(prompts=, completions=, completion_ids=, <dataset columns>=, trainer_state=, "
                  "log_extra=, log_metric=); end its signature with **kwargs")
_module_ids = itertools.count()


class RewardError(ValueError):
    """A reward entry that cannot be built; the message says which one and what to change."""


def _label(index: int, entry) -> str:
    """studio.rewards[2] (my_rewards.py:my_reward), or studio.rewards[0] (length)."""
    if not isinstance(entry, dict) or ("file" not in entry and "name" not in entry):
        return f"studio.rewards[{index}]"
    return f"studio.rewards[{index}] ({entry['file']}:{entry.get('function')})" if "file" in entry \
        else f"studio.rewards[{index}] ({entry['name']})"


def _kind(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def _describe(exc: BaseException, path: Path | None) -> str:
    """'Type: message at FILE line N: `code`', the line being the deepest one in the user's file."""
    if isinstance(exc, SyntaxError) and exc.lineno:
        return f"SyntaxError: {exc.msg} at {path.name} line {exc.lineno}: `{(exc.text or '').strip()}`"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if path and Path(f.filename) == path]
    where = f" at {path.name} line {frames[-1].lineno}: `{frames[-1].line}`" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _problems(entry) -> list[str]:
    """What is wrong with one entry's keys and values, without importing or calling anything."""
    if not isinstance(entry, dict) or ("name" in entry) == ("file" in entry):
        return ["must be a mapping with either name: (one of " + ", ".join(BUILTINS)
                + ") or file: and function: (your own reward), e.g. {name: length, target: 200}"]
    problems = []
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
        problems.append(f"weight must be a number, e.g. weight: 0.5; got {_kind(weight)}")
    if "file" in entry:
        settings = {"file": (str, "a path to a .py file"), "function": (str, "a function name in that file")}
    elif entry["name"] not in BUILTINS:
        return problems + [f"{entry['name']!r} is not a built-in reward; choose one of "
                           f"{', '.join(BUILTINS)}, or give file: and function: for your own"]
    else:
        settings = BUILTINS[entry["name"]][1]
    for key in set(entry) - set(settings) - {"name", "weight"}:
        problems.append(f"unknown key {key!r}; this reward takes {', '.join(settings)} and weight")
    for key, (kind, what) in settings.items():
        if key not in entry:
            problems.append(f"missing {key}: {what}")
        elif isinstance(entry[key], bool) or not isinstance(entry[key], kind):
            problems.append(f"{key} must be {what}; got {_kind(entry[key])}")
    if entry.get("name") == "regex" and isinstance(entry.get("pattern"), str):
        try:
            re.compile(entry["pattern"])
        except re.error as exc:
            problems.append(f"pattern {entry['pattern']!r} is not a valid regular expression ({exc}); "
                            "fix it (in YAML, a backslash inside double quotes must be doubled)")
    return problems


def _user_file(file: str) -> Path:
    """The reward file's path, if it is a Python file that exists (RewardError saying what to change)."""
    path = Path(file).resolve()
    if not path.is_file():
        raise RewardError(f"file {file!r} does not exist (looked for {path}); give the path of a Python "
                          "file, absolute or relative to the directory the studio runs in")
    if path.suffix != ".py":
        raise RewardError(f"file {file!r} is not a Python file (it must end in .py): give the .py file that "
                          "defines your reward function")
    return path


def _defines(file: str, function: str) -> None:
    """Without running it: the file parses, and defines `function` at its top level."""
    path = _user_file(file)
    try:
        tree = ast.parse(path.read_bytes(), filename=path.name)
    except (SyntaxError, ValueError) as exc:
        line = f" line {exc.lineno}" if getattr(exc, "lineno", None) else ""
        raise RewardError(f"{path.name}{line} is not valid Python ({exc.msg if isinstance(exc, SyntaxError) else exc}); "
                          "fix the file") from exc
    names = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                  ast.ClassDef))}
    names |= {target.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
              for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
              if isinstance(target, ast.Name)}
    imports = [alias for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names]
    names |= {(alias.asname or alias.name).split(".")[0] for alias in imports}
    if function not in names and not any(alias.name == "*" for alias in imports):  # a * import may bring it
        defined = sorted(n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        raise RewardError(f"{path.name} has no {function!r}; it defines: {', '.join(defined) or 'no functions'}; "
                          "set function: to one of them")


def _load_user_function(file: str, function: str):
    """Import `file` by path under a fresh module name and return its `function`."""
    path = _user_file(file)
    name = f"studio_user_rewards_{next(_module_ids)}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        del sys.modules[name]
        raise RewardError(f"importing {path.name} raised {_describe(exc, path)}; "
                          f"fix the file so that `python {file}` runs") from exc
    if not hasattr(module, function):
        defined = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == name)
        raise RewardError(f"{path.name} has no {function!r}; it defines: {', '.join(defined) or 'no functions'}; "
                          "set function: to one of them")
    func = getattr(module, function)
    if not callable(func):
        raise RewardError(f"{function!r} in {path.name} is {_kind(func)}, not a function; "
                          f"point function: at a def called as {CALL_SIGNATURE}")
    return func


def _build(index: int, entry):
    problems = _problems(entry)
    if problems:
        raise RewardError("\n".join(f"{_label(index, entry)}: {p}" for p in problems))
    try:
        if "file" in entry:
            func = _load_user_function(entry["file"], entry["function"])
        else:
            cls, settings = BUILTINS[entry["name"]]
            func = cls(**{key: entry[key] for key in settings})
    except RewardError as exc:
        raise RewardError(f"{_label(index, entry)}: {exc}") from exc
    return func, float(entry.get("weight", 1.0))


def _log_names(funcs) -> None:
    """TRL logs rewards/<__name__>/mean: a later built-in of a kind is named by its index, e.g. regex_4."""
    seen = set()
    for index, func in enumerate(funcs):
        if isinstance(func, (LengthReward, RegexReward, ExactMatchReward)) and func.__name__ in seen:
            func.__name__ = f"{func.__name__}_{index}"
        seen.add(getattr(func, "__name__", type(func).__name__))


def reward_functions(rewards: list[dict]) -> tuple[list, list[float]]:
    """The callables for GRPOTrainer(reward_funcs=...) and weights for GRPOConfig(reward_weights=...).

    Raises RewardError listing every entry that cannot be built; run check_rewards first."""
    if not isinstance(rewards, list) or not rewards:
        raise RewardError("studio.rewards: must be a non-empty list, e.g. [{name: length, target: 200}]")
    built, problems = [], []
    for index, entry in enumerate(rewards):
        try:
            built.append(_build(index, entry))
        except RewardError as exc:
            problems.append(str(exc))
    if problems:
        raise RewardError("\n".join(problems))
    funcs, weights = [list(t) for t in zip(*built)]
    _log_names(funcs)
    return funcs, weights


def _sample_batch(sample_rows: list[dict]) -> dict:
    """The keyword arguments TRL would pass for these rows, with a dummy completion for each."""
    from transformers import TrainerState  # imports torch: only here, not when the module loads

    text = "The answer is 42."
    completions = [[{"role": "assistant", "content": text}] if isinstance(row["prompt"], list) else text
                   for row in sample_rows]
    columns = {key: [row.get(key) for row in sample_rows] for key in sample_rows[0] if key != "prompt"}
    return dict(prompts=[row["prompt"] for row in sample_rows], completions=completions,
                completion_ids=[[ord(ch) for ch in text] for _ in sample_rows], **columns,
                trainer_state=TrainerState(), log_extra=lambda column, values: None,
                log_metric=lambda name, value: None)


def _call_problem(func, batch: dict, file: str | None) -> str | None:
    """Call a reward function once on the batch; what is wrong with how it ran, or None."""
    try:
        result = func(**batch)
        if inspect.iscoroutine(result):  # TRL also accepts async reward functions
            result = asyncio.run(result)
    except (Exception, SystemExit) as exc:
        path = Path(file).resolve() if file else None
        if isinstance(exc, TypeError) and not any(Path(f.filename) == path for f in traceback.extract_tb(
                exc.__traceback__)):  # failed at the call itself: the signature does not fit
            hint = f"TRL calls it as {CALL_SIGNATURE}"
        else:
            shape = "lists of {role, content} messages" if isinstance(batch["prompts"][0], list) else "strings"
            hint = f"fix the function (completions are {shape} for this dataset)"
        return f"calling it on {len(batch['prompts'])} sample rows raised {_describe(exc, path)}; {hint}"
    expected = len(batch["prompts"])
    if not isinstance(result, (list, tuple)):
        return f"returned {_kind(result)}; return a list with one float (or None) per completion"
    if len(result) != expected:
        return f"returned {len(result)} rewards for {expected} completions; return one per completion"
    for position, value in enumerate(result):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            return (f"returned {_kind(value)} at position {position}; each reward must be a float, "
                    "or None where this reward does not apply")
        if value is not None and math.isinf(value):  # one is enough: the group's advantages become NaN
            return (f"returned {value} at position {position}; each reward must be a finite float, "
                    "or None where this reward does not apply")
    if all(value is None or math.isnan(value) for value in result):
        # TRL sums a NaN (None) reward away: the run would go on, learning nothing from this function
        return (f"returned no usable reward for any of the {expected} sample completions (all None or NaN); "
                "return a finite float for each completion (None or NaN only where this reward does not apply)")
    return None


def check_rewards(rewards: list[dict], sample_rows: list[dict] | None, on_entry=None,
                  user_code: bool = True) -> list[str]:
    """Every problem with `rewards`, as messages naming the entry; [] when all are fine.

    Each entry is validated, built (user files imported) and called once on `sample_rows` (dataset
    rows with a `prompt`). With `sample_rows` None (a dataset not read before launch: made-up rows
    would refuse functions that read a real column) nothing is called; the worker calls them on the
    real first rows. `on_entry(label)` is called before each entry, to tell which one hangs.
    Without `user_code`, a user's file is only read (it parses and defines the function), never
    imported or called: what a plan or a preview checks."""
    if not isinstance(rewards, list) or not rewards:
        return ["studio.rewards: must be a non-empty list, e.g. [{name: length, target: 200}]"]
    if sample_rows is not None and (
            not sample_rows or not all(isinstance(row, dict) and "prompt" in row for row in sample_rows)):
        return ["studio.rewards: the dataset has no rows with a 'prompt' column to try the rewards on; "
                "GRPO needs a prompt-only dataset with a 'prompt' column"]
    with hub_token_hidden():  # in the worker too, which checks them on the first rows it loaded
        return _check(rewards, sample_rows, on_entry, user_code)


@contextlib.contextmanager
def hub_token_hidden():
    """The Hub token out of os.environ while a user's reward code runs in this process (imported or
    called), put back after: the worker still needs it for its own downloads."""
    saved = {name: os.environ.pop(name) for name in HUB_TOKENS if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _check(rewards: list[dict], sample_rows: list[dict] | None, on_entry, user_code: bool) -> list[str]:
    batch, problems, funcs = None, [], []
    for index, entry in enumerate(rewards):
        label = _label(index, entry)
        if on_entry:
            on_entry(label)
        if not user_code and isinstance(entry, dict) and "file" in entry:  # read, not run
            found = _problems(entry)
            if not found:
                try:
                    _defines(entry["file"], entry["function"])
                except RewardError as exc:
                    found = [str(exc)]
            problems += [f"{label}: {p}" for p in found]
            continue
        try:
            func, _ = _build(index, entry)
        except RewardError as exc:
            problems.append(str(exc))
            continue
        funcs.append((label, func))
        if sample_rows is None:
            continue
        if entry.get("name") == "exact_match" and entry["column"] not in sample_rows[0]:
            problems.append(f"{label}: column {entry['column']!r} is not in the dataset (columns: "
                            f"{', '.join(sample_rows[0])}); set column: to one of them")
            continue
        batch = batch or _sample_batch(sample_rows)
        problem = _call_problem(func, batch, entry.get("file"))
        if problem:
            problems.append(f"{label}: {problem}")
    _log_names([func for _, func in funcs])  # what is still shared after that comes from user functions
    names: dict[str, str] = {}
    for label, func in funcs:
        name = getattr(func, "__name__", type(func).__name__)
        if name in names:
            problems.append(f"{label}: TRL logs it as rewards/{name}, like {names[name]}, and would mix "
                            "their metrics; rename your function")
        names.setdefault(name, label)
    return problems


def check_rewards_in_subprocess(rewards: list[dict], sample_rows: list[dict] | None,
                                timeout: float = 60) -> list[str]:
    """check_rewards in a child Python process, stopped after `timeout` seconds.

    Sample values JSON cannot carry (images, dates) reach the child as their str()."""
    request = json.dumps({"rewards": rewards, "sample_rows": sample_rows}, default=str)
    child = children.start("studio_core.recipe.rewards", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True, without=HUB_TOKENS)
    try:
        out, err = child.communicate(request, timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # the whole group: a user file may start processes
            os.killpg(child.pid, signal.SIGKILL)
        out, err = child.communicate()
        started = re.findall(r"^checking (.+)$", err, re.M)
        return [f"{started[-1] if started else 'studio.rewards'}: did not finish within {timeout:g} s "
                "(an endless loop, or waiting on the network or a lock?); the check was stopped. "
                "Make importing the file and calling the function fast"]
    try:
        return json.loads(out)
    except json.JSONDecodeError:
        started = re.findall(r"^checking (.+)$", err, re.M)
        tail = "\n".join(line for line in err.splitlines() if not line.startswith("checking "))[-2000:]
        return [f"{started[-1] if started else 'studio.rewards'}: the check process exited with code "
                f"{child.returncode} before reporting (a crash in a reward file?); its output:\n{tail}"]


def _main() -> None:
    request = json.load(sys.stdin)
    result_out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):  # a print() in a user file must not corrupt the JSON
        problems = check_rewards(request["rewards"], request["sample_rows"],
                                 on_entry=lambda label: print(f"checking {label}", file=sys.stderr, flush=True))
    json.dump(problems, result_out)


if __name__ == "__main__":
    from studio_core.machine.children import skip_final_collection

    skip_final_collection()
    _main()
