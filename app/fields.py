"""Form widgets made from an options dataclass: each field's metadata (studio_core.backends.base.option)
gives the widget's label, line of help, placeholder and kind, the same metadata the command line makes
its flags from (cli/fields.py), so an option is written once. A widget's elem_id and its value's name
are the field's name (the browser tests find widgets by it)."""

from __future__ import annotations

import shlex
from dataclasses import Field, fields

import gradio as gr

from studio_core.recipe.spec import Layout, SpecError

ROW = 3  # widgets side by side


def widget(f: Field) -> gr.Component:
    """The widget of one field, in the current Blocks context."""
    meta = f.metadata
    common = {"label": meta["label"], "elem_id": f.name}
    if meta["kind"] == "bool":
        offered = meta.get("offered")
        return gr.Checkbox(bool(f.default), info=meta["help"], interactive=offered() if offered else True, **common)
    if meta.get("choices"):  # a dropdown of what the place offers (a cluster's partitions), other values too
        names, line = meta["choices"]()
        return gr.Dropdown(names, value=None, allow_custom_value=True, info=line, **common)
    return gr.Textbox(placeholder=meta.get("placeholder"), info=meta["help"], **common)


def widgets(options_type) -> dict[str, gr.Component]:
    """The widgets of every field, in rows of ROW: {name: widget}."""
    made, pending = {}, list(fields(options_type))
    while pending:
        with gr.Row():
            for f in pending[:ROW]:
                made[f.name] = widget(f)
            pending = pending[ROW:]
    return made


def read(values: dict, backend, complete: bool = True):
    """The options of `backend` (a run backend: its options_type) the widgets hold (by field name),
    checked by the options' own rule and, with `complete`, a box left empty by the backend's need of
    it (a Ray run needs its address), each problem under its widget's label (SpecError)."""
    options_type, given = backend.options_type, {}
    for f in fields(options_type):
        value, meta = values.get(f.name), f.metadata
        if meta["kind"] == "bool":
            given[f.name] = bool(value)
        elif meta["kind"] == "list":
            try:
                given[f.name] = shlex.split(value or "")  # one line, split as a shell would
            except ValueError as error:
                raise SpecError([f"{meta['label']}: {error} (check the quotes)"]) from error
        else:
            given[f.name] = (value or "").strip() or None
    options = options_type(**given)
    problems = options.check(labels={f.name: f.metadata["label"] for f in fields(options_type)})
    problems += needed(options, backend) if complete else []
    if problems:
        raise SpecError(problems)
    return options.settled()


def needed(options, backend) -> list[str]:
    """The boxes left empty that a run on `backend` cannot do without, said under their labels:
    the backend's own layout rule (which says them under the recipe's key, studio.ray.address,
    and the command line's flag) asked about these options."""
    said = backend.layout_problems(Layout(run_on=backend.name, options=options))
    return [f"{f.metadata['label']}: empty, and a run on {backend.label} needs it: write {f.metadata['recipe']}"
            for f in fields(options) if getattr(options, f.name) is None
            and any(p.startswith(f"studio.{backend.name}.{f.name}:") for p in said)]


def shown(options, options_type) -> dict:
    """The widgets' values (by field name) that hold these options (None: the defaults): the inverse of `read`."""
    options = options if options is not None else options_type()
    values = {}
    for f in fields(options_type):
        value, kind = getattr(options, f.name), f.metadata["kind"]
        if kind == "bool":
            values[f.name] = bool(value)
        elif kind == "list":
            values[f.name] = shlex.join(value or [])
        else:
            values[f.name] = value if f.metadata.get("choices") else (value or "")
    return values


def labels(kind) -> dict[str, str]:
    """The form labels a dataclass's fields name in their metadata, by field name (recipe.spec.Layout's)."""
    return {f.name: f.metadata["label"] for f in fields(kind) if "label" in f.metadata}
