"""The fields of TRL's config classes, read from TRL itself, without importing it here.

Importing TRL costs ~5 s and ~300 MB, too much for the web app's process, which only
needs the names, types, defaults and help texts to validate a spec and label widgets.
So a child process introspects the dataclasses once per installed TRL version and the
result is cached as JSON; every later call is a file read.

`config_problems` asks TRL, Transformers and PEFT themselves whether a run's config builds, in
another child, kept up for a while so that asking again costs milliseconds. While it is up, it
answers the process's model checks too (model_check.check_here): it has Transformers imported.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from functools import lru_cache
from importlib.metadata import version
from pathlib import Path

from studio_core.data import model_check
from studio_core.recipe import trainers
from studio_core.machine.cache import cache_dir, one_maker
from studio_core.machine.children import REPO_ROOT

# Dataclasses whose fields a recipe may also hold: the model and dataset choice, as
# TRL's own CLI reads them (`trl sft --config recipe.yaml`).
EXTRA_CLASSES = ("ModelConfig", "ScriptArguments")

# First in each child below: its exit skips the last garbage collection (children.skip_final_collection
# says why; written out here, as these run with `python -c`, the repository maybe not on their path).
_QUICK_EXIT = "import atexit, gc\natexit.register(lambda: (gc.disable(), gc.freeze()))\n"

_INTROSPECT = _QUICK_EXIT + r"""
import dataclasses, enum, json, sys, types, typing
import trl

def kinds(tp):
    out, choices = set(), []
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    for arg in args:
        origin = typing.get_origin(arg) or arg
        if arg is type(None):
            out.add("null")
        elif origin is typing.Literal:
            for value in typing.get_args(arg):
                out.add({bool: "bool", type(None): "null"}.get(type(value), "str"))
        elif isinstance(origin, type) and issubclass(origin, enum.Enum):
            choices += [m.value for m in origin]
        elif origin in (bool, int, float, str, dict, list):
            out.add(origin.__name__)
        else:
            out.add("object")
    return sorted(out), choices

def default(f):
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return None
    value = value.value if isinstance(value, enum.Enum) else value
    try:
        json.dumps(value)
    except TypeError:
        return repr(value)
    return value

schema = {}
for name in sys.argv[1:]:
    cls = getattr(trl, name)
    hints = typing.get_type_hints(cls)
    fields = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        types_, choices = kinds(hints[f.name])
        fields[f.name] = {"types": types_, "choices": choices, "default": default(f),
                          "help": f.metadata.get("help", "")}
    schema[name] = fields
print(json.dumps(schema))
"""


@lru_cache(maxsize=1)
def trl_schema() -> dict[str, dict[str, dict]]:
    """{class name: {field: {types, choices, default, help}}} for the trainer configs and extras."""
    path = cache_dir() / f"trl-schema-{version('trl')}.json"
    names = [*trainers.config_classes().values(), *EXTRA_CLASSES]
    cached = _cached_schema(path, names)
    if cached is not None:
        return cached
    with one_maker(path.name):  # processes asking together read TRL once
        cached = _cached_schema(path, names)
        if cached is not None:
            return cached
        done = subprocess.run(
            [sys.executable, "-c", _INTROSPECT, *names], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"could not read TRL's config fields:\n{done.stderr[-2000:]}")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{id(done)}.tmp")
        tmp.write_text(done.stdout)
        tmp.replace(path)
    return json.loads(done.stdout)


def _cached_schema(path: Path, names: list[str]) -> dict | None:
    """The schema kept on disk when it has every class asked (else a trainer was added since)."""
    if not path.exists():
        return None
    cached = json.loads(path.read_text())
    return cached if set(names) <= set(cached) else None


def trainer_fields(trainer: str) -> dict[str, dict]:
    """The fields a recipe may set for this trainer: its TRL config plus model/dataset args."""
    schema = trl_schema()
    fields: dict[str, dict] = {}
    for name in (*EXTRA_CLASSES, trainers.get(trainer).config_class):
        fields.update(schema[name])
    return fields


def check_value(field: str, value, spec: dict) -> str | None:
    """None when `value` fits the field's declared types, else a message saying what fits."""
    types, choices = spec["types"], spec["choices"]
    kind = {bool: "bool", int: "int", float: "float", str: "str", dict: "dict", list: "list",
            type(None): "null"}.get(type(value), "object")
    if "object" in types:
        return None
    if kind == "int" and "float" in types and "int" not in types:
        return None  # 3 is a fine learning rate or epoch count
    if choices and kind == "str":  # an enum field: TRL accepts its values as strings
        return None if value in choices else f"{field}: {value!r} is not one of {', '.join(map(str, choices))}"
    if kind in types:
        return None
    wanted = " or ".join(types + (["one of " + ", ".join(map(str, choices))] if choices else []))
    return f"{field}: expected {wanted}, got {type(value).__name__} {value!r}"


# --- TRL's and Transformers' own checks of a run's config ------------------------------------
# Building the trainer's config class runs TrainingArguments.__post_init__ (logging, eval and
# save steps, strategies, precisions, warmup...) and the TRL config's own (GRPO's batch sizes);
# the Trainer then builds a callback per report_to name (an unknown or uninstalled one fails
# there) and TRL builds PEFT's LoraConfig. All of it fails a run only after the model loaded,
# so a child process does the same before launch. The child stays up for a while (TRL costs
# seconds to import): the form's Preview and Start, and a plan after a plan, ask it again at
# once. It leaves when its stdin closes (this process ended) or after CHECK_IDLE_S unasked.
CHECK_IDLE_S = 120
CHECK_START_S = 300  # its first answer imports torch, transformers and TRL: seconds, more on a busy machine

_CONFIG_CHECK = _QUICK_EXIT + r"""
import dataclasses, json, os, select, sys, tempfile, warnings

answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # what the libraries print goes to stderr; stdout carries only the answers
warnings.simplefilter("ignore")
gc.disable()  # no collection while it imports (studio_core.machine.children.collection_off says why)
import torch, transformers, trl
from transformers.integrations import get_reporting_integration_callbacks
gc.freeze()  # then what is alive is frozen and collection is on again, for the checks (children.set_up)
gc.enable()

IDLE_S = float(sys.argv[1])
WORLD = [1]
# What depends on the run's processes, not on its values: the devices and process group torchrun
# gives each rank (this process has none), and their number, which GRPO's and RLOO's batch checks count.
transformers.TrainingArguments._setup_devices = property(lambda self: torch.device("cpu"))
transformers.TrainingArguments.world_size = property(lambda self: WORLD[0])
MODEL = {f.name for f in dataclasses.fields(trl.ModelConfig)}
SCRIPT = {f.name for f in dataclasses.fields(trl.ScriptArguments)}
# named, never made: building a config writes nothing (a folder made here was left behind by every child)
OUTPUT = os.path.join(tempfile.gettempdir(), "studio-config-check")


def build(config, run_name, args):
    # as studio_core.training.trainer_setup.build_trainer builds them, without the model
    model_args = trl.ModelConfig(**{k: v for k, v in args.items() if k in MODEL})
    config_args = {k: v for k, v in args.items() if k not in MODEL | SCRIPT}
    config_args["model_init_kwargs"] = {"revision": model_args.model_revision, "dtype": model_args.dtype,
                                        "attn_implementation": model_args.attn_implementation,
                                        **(config_args.get("model_init_kwargs") or {})}
    # use_cpu: this machine may not be the run's; what the device allows is the planner's part
    made = getattr(trl, config)(output_dir=OUTPUT, run_name=run_name, **{**config_args, "use_cpu": True})
    stage = "report_to"
    try:
        for callback in get_reporting_integration_callbacks(made.report_to):
            callback()
        stage = "peft"
        trl.get_peft_config(model_args)
    except Exception as error:
        error.stage = stage
        raise


def refusal(config, run_name, args):
    try:
        build(config, run_name, args)
    except Exception as error:  # whatever the libraries raise here, the run would raise after loading
        return getattr(error, "stage", "config"), f"{type(error).__name__}: {error}"
    return None


def check_model(request):
    # the model check's Transformers side (studio_core/data/model_child.py), run here rather than in
    # a child of its own: its output and exit code, as that child's would be
    import contextlib, io, traceback
    if request["path"] not in sys.path:
        sys.path.insert(0, request["path"])
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            from studio_core.data import model_child
            model_child.main(request["model_check"])
        except BaseException:  # as the child would end on it: its traceback, exit code 1
            traceback.print_exc()
            code = 1
    return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def answer(request):
    WORLD[0] = request["world_size"]
    config, run_name, args = request["config"], request["run_name"], request["args"]
    found = refusal(config, run_name, args)
    if found is None:
        return None
    # which of the user's own settings, left out, lets it build: the value to change
    culprits = [key for key in request["given"] if key in args
                and refusal(config, run_name, {k: v for k, v in args.items() if k != key}) is None]
    return {"stage": found[0], "error": found[1], "culprits": culprits}


while select.select([sys.stdin], [], [], IDLE_S)[0]:
    line = sys.stdin.readline()
    if not line:
        break
    asked = json.loads(line)
    answers.write(json.dumps(check_model(asked) if isinstance(asked, dict) else [answer(r) for r in asked]) + "\n")
    answers.flush()
"""

_checker: subprocess.Popen | None = None
_checker_log = None
_checker_lock = threading.Lock()
_passed: set[str] = set()  # the requests that built: the same request builds again


def _passed_file(key: str) -> Path:
    """Where a request that built is remembered, for the next process (`launch.py plan` after a plan):
    named by its _verdict_key, the libraries' versions and this check's own code."""
    versions = [version(name) for name in ("trl", "transformers", "peft")]
    digest = hashlib.sha256(json.dumps([key, versions, _CONFIG_CHECK]).encode()).hexdigest()
    return cache_dir() / "config-checks" / digest


def _verdict_key(request: dict) -> str:
    """What a pass depends on: the trainer, its arguments and the process count. The run's name
    (only stored by the config) and the keys the user set (they only name a refusal's culprits) are
    left out, so that a run under another name with the same settings asks no child (TRL's import)."""
    return json.dumps({k: request[k] for k in ("trainer", "args", "world_size")}, sort_keys=True, default=repr)


def _kept(key: str) -> bool:
    return key in _passed or _passed_file(key).exists()


def prepare_config_check(requests: list[dict]) -> None:
    """Start the check child now when a request's verdict is not kept, so that it imports TRL while
    the caller checks other things (config_problems then asks it); nothing when all are kept."""
    if not all(_kept(_verdict_key(r)) for r in requests):
        start_config_check()


def start_config_check() -> None:
    """Start the check child now if none is up, asking it nothing yet."""
    with _checker_lock:
        if _checker is None or _checker.poll() is not None:
            _start_checker()


def config_problems(requests: list[dict]) -> list[list[str]]:
    """For each request (trainer, args: the TRL arguments as the planner hands them to the
    worker, given: the keys the user set, run_name, world_size), the problems TRL, Transformers
    or PEFT would raise when the run builds its config, each naming the setting to change."""
    keys = [_verdict_key(r) for r in requests]
    asked = [i for i, key in enumerate(keys) if not _kept(key)]
    answers = _ask([{**requests[i], "config": trainers.get(requests[i]["trainer"]).config_class}
                    for i in asked]) if asked else []
    found: list[list[str]] = [[] for _ in requests]
    for i, answer in zip(asked, answers):
        if answer is None:  # a refusal is asked again: its fix may be an install
            _passed.add(keys[i])
            _passed_file(keys[i]).parent.mkdir(parents=True, exist_ok=True)
            _passed_file(keys[i]).touch()
        else:
            found[i] = _messages(requests[i], answer)
    return found


def _messages(request: dict, answer: dict) -> list[str]:
    args, culprits = request["args"], answer["culprits"]
    who = {"config": f"TRL's {trainers.get(request['trainer']).config_class}",
           "report_to": "Transformers (its report_to trackers)", "peft": "PEFT's LoraConfig"}[answer["stage"]]
    said = f"{who} refuses it ({answer['error']})"
    if len(culprits) == 1:
        key = culprits[0]
        default = trainer_fields(request["trainer"]).get(key, {}).get("default")
        fix = f"change it, or leave it out for TRL's default ({default!r})"
        if answer["stage"] == "report_to":  # a name Transformers does not know, or a tracker not installed
            fix = ("use the names it supports, or leave report_to out" if answer["error"].startswith("ValueError")
                   else "install it in the studio's environment, or leave it out of report_to")
        return [f"{key}: {args[key]!r}: {said}: {fix}"]
    if culprits:
        return [f"{', '.join(culprits)}: {said}: change one of them"]
    return [f"the settings together: {said}: change the values it names (with the studio's defaults for this "
            "machine, `launch.py plan` lists them)"]


def _model_check_here(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess | None:
    """The model check's child (studio_core/data/model_child.py ARGV) answered by this process's
    config check child, which has Transformers and torch imported already: its output and exit
    code, as that child's; None when no check child is up (starting one would import TRL too, more
    than the model check's own child imports) or it ended without answering (then the model check's
    own child runs, and says what went wrong its own way). subprocess.TimeoutExpired after
    `timeout_s` without an answer, as the child's run would raise it (the check child is ended)."""
    with _checker_lock:
        if _checker is None or _checker.poll() is not None:
            return None
        line = json.dumps({"model_check": argv, "path": str(REPO_ROOT)}) + "\n"
        asked = time.monotonic()
        reply = _send(line, timeout_s)
        if not reply:  # it ended, or was about to (idle), or is silent: the next check starts a new one
            if time.monotonic() - asked >= timeout_s:
                raise subprocess.TimeoutExpired(line, timeout_s)
            return None
        done = json.loads(reply)
        return subprocess.CompletedProcess(["studio_core.data.model_child", *argv], **done)


model_check.check_here = _model_check_here


def _ask(requests: list[dict]) -> list:
    """The check child's answers, one per request; the child started when none is up."""
    line = json.dumps(requests, default=str) + "\n"  # a YAML date, say: sent as its text
    with _checker_lock:
        for _ in range(2):  # the child may be leaving, idle, as it is asked: then a new one, once
            if _checker is None or _checker.poll() is not None:
                _start_checker()
            reply = _send(line, CHECK_START_S)
            if reply:
                return json.loads(reply)
        _checker_log.seek(0)
        raise RuntimeError(f"could not ask TRL to check the config:\n{_checker_log.read().decode()[-2000:]}")


def _send(line: str, timeout_s: float) -> bytes:
    """The check child's answer to `line` (the caller holds _checker_lock); b"" when it gives none
    within `timeout_s`, and then it is ended for sure: a leaving child can still take the line into
    its pipe and end without reading it (poll() said it was up), so the next ask starts a new one."""
    try:
        _checker.stdin.write(line.encode())
        _checker.stdin.flush()
        reply = _read_line(_checker, timeout_s)
    except BrokenPipeError:
        reply = b""
    if not reply:
        _checker.kill()
        _checker.wait()
    return reply


def _start_checker() -> None:
    """A new check child (the caller holds _checker_lock), reaped when it ends (idle, or killed
    with the terminal's Ctrl-C): never left defunct; ended when this process exits, so that a plan
    refused before it asked leaves no child importing TRL behind it."""
    global _checker, _checker_log
    _checker_log = tempfile.TemporaryFile()
    # offline: a config never needs the Hub, and the model checks it answers read local folders only
    _checker = subprocess.Popen([sys.executable, "-c", _CONFIG_CHECK, str(CHECK_IDLE_S)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=_checker_log,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    threading.Thread(target=_checker.wait, name="reap-config-check", daemon=True).start()
    atexit.register(_end_checker, _checker)


def _end_checker(child: subprocess.Popen) -> None:
    if child.poll() is None:
        child.kill()


def _read_line(child: subprocess.Popen, timeout_s: float) -> bytes:
    """A line of the child's stdout, b"" when it ends or is silent for `timeout_s` (killed then)."""
    out, deadline = b"", time.monotonic() + timeout_s
    fd = child.stdout.fileno()
    while not out.endswith(b"\n"):
        if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            child.kill()
            return b""
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b""
        out += chunk
    return out
