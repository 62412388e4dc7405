"""The fields of TRL's config classes, read from TRL itself, without importing it here.

Importing TRL costs ~5 s and ~300 MB, too much for the web app's process, which only
needs the names, types, defaults and help texts to validate a spec and label widgets.
So a child process introspects the dataclasses once per installed TRL version and the
result is cached as JSON; every later call is a file read.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import lru_cache
from importlib.metadata import version

from studio_core import trainers
from studio_core.builtin import cache_dir

# Dataclasses whose fields a recipe may also hold: the model and dataset choice, as
# TRL's own CLI reads them (`trl sft --config recipe.yaml`).
EXTRA_CLASSES = ("ModelConfig", "ScriptArguments")

_INTROSPECT = r"""
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
    if path.exists():
        cached = json.loads(path.read_text())
        if set(names) <= set(cached):  # else a trainer was added since: read TRL again
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
