"""What a new user met on the Train tab (issue 47), through the tab's own handlers: the Train tab
built in a Blocks of its own, its event functions called with the widgets' values as Gradio hands
them over (a text box's `preprocess`). A number that is no number said as typed; max_steps below
0 refused by the form and the recipe alike; Export's Slurm script on the form's Nodes; a Ray run
without an address named by the form's field, and its core map saying Ray picks the nodes; the
plan shown dropped once the form changes. tests/test_browser_train.py drives the same in Chromium
(the boxes keeping what was typed, the forecast marked stale, Start disabled while it checks)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from studio_core.machine.hardware import cpu_hardware
from studio_core.recipe.spec import RunSpec, SpecError
from studio_core.recipe.validate import validate
from studio_core.runs.manager import RunManager

TINY = Path(__file__).resolve().parent.parent / "recipes" / "tiny-sft.yaml"


@pytest.fixture
def tab(tmp_path):
    """The Train tab over a runs folder of its own: (its Blocks, its form, the manager)."""
    import gradio as gr
    from app import train_tab

    manager = RunManager(tmp_path / "runs")
    with gr.Blocks() as demo:
        form, _ = train_tab.build(manager, cpu_hardware(), gr.State(None))
    return demo, form, manager


def handler(demo, name: str, output=None):
    """The tab's event function of this name (and, where two share the name, with this output); one
    function wired to several events (each widget's change) is the same function each time."""
    import gradio as gr

    found = [f for f in demo.fns.values() if f.name == name and (output is None or output in f.outputs)]
    assert len({f.fn for f in found}) == 1, found
    return found[0]


def call(fn, form, typed: dict, **given):
    """`fn` on the page's starting values, with `typed` into the form's widgets (as each widget hands
    its text over) and `given` values of its other inputs (by component)."""
    values = {component: component.value for component in fn.inputs}
    values |= {form.widgets[name]: form.widgets[name].preprocess(text) for name, text in typed.items()}
    return fn.fn(values | given.get("others", {}))


def runs_made(manager: RunManager) -> list:
    return [p for p in manager.runs_dir.iterdir() if p.is_dir() and p.name != "exports"] \
        if manager.runs_dir.exists() else []


@pytest.mark.fast
@pytest.mark.parametrize(("typed", "why"), [("abc", "is not a number"), ("1e999", "reads as infinity"),
                                            ("2,5e-3", "is not a number")])
def test_a_learning_rate_that_is_no_number_is_refused_as_typed(tab, typed, why):
    """The box was Gradio's Number: the browser handed over nothing for these, the box blanked and
    Start said 'must be above 0, got 0.0'."""
    demo, form, manager = tab
    message = next(call(handler(demo, "on_start"), form, {"learning_rate": typed}))[0]
    assert "Nothing was launched" in message
    assert f"learning_rate: '{typed}' {why}" in message and "got 0.0" not in message
    assert "write a number, e.g." in message  # and what to write instead
    assert runs_made(manager) == []


@pytest.mark.fast
def test_every_number_box_is_said_at_once_under_its_label_and_a_blank_one_keeps_its_meaning():
    from app.train_form import form_values, spec_from_form

    from app.train_form import read_number

    values = form_values(RunSpec.load(TINY), trackers=["none"]) | {"target": "this machine", "lnc": 2}
    with pytest.raises(SpecError) as caught:
        spec_from_form(values | {"max_steps": "ten", "nproc": "2.5", "learning_rate": ""})
    assert caught.value.problems == [
        "max_steps: 'ten' is not a number; write a whole number, e.g. 4",
        "learning_rate: empty; write a number, e.g. 0.5 or 2e-5",
        "Processes (torchrun nproc): '2.5' is not a whole number; write a whole number, e.g. 4"]
    # "Other TRL settings" is applied last: a learning rate given there leaves the box's text unread
    assert spec_from_form(values | {"learning_rate": "abc", "extra": "learning_rate: 0.01"}).args[
        "learning_rate"] == 0.01
    spec = spec_from_form(values | {"max_steps": "", "warmup_steps": " 0.1 ", "logging_steps": "5", "nproc": ""})
    assert spec.args["max_steps"] == -1 and spec.layout.nproc == 1  # empty: train by epochs, one process
    assert spec.args["warmup_steps"] == 0.1 and spec.args["logging_steps"] == 5  # TRL's fraction kept, 5 whole
    with pytest.raises(SpecError, match=r"seed: '-1e999' reads as minus infinity"):
        read_number("-1e999", "seed", whole=True)


@pytest.mark.fast
def test_max_steps_below_zero_is_refused_the_same_from_the_form_and_the_recipe():
    """TRL trains by num_train_epochs for any max_steps below 0: -5 trained 3 epochs, unsaid."""
    from app.train_form import form_values, spec_from_form

    recipe = RunSpec.load(TINY)
    values = form_values(recipe, trackers=["none"]) | {"target": "this machine", "lnc": 2}
    from_form = validate(spec_from_form(values | {"max_steps": "-5"}))
    from_recipe = validate(recipe.with_overrides(["max_steps=-5"]))  # launch.py train --set max_steps=-5
    assert from_form == from_recipe == [
        "max_steps: -5 is not a number of steps: write one above 0, or -1 to train for num_train_epochs instead "
        "(in the form: 0)"]
    assert validate(recipe.with_overrides(["max_steps=0"]))[0].startswith("max_steps: 0 is not a number of steps")
    for fine in ("-1", "0", "7"):  # the form's 0 is TRL's -1
        assert validate(spec_from_form(values | {"max_steps": fine})) == []
    assert validate(recipe.with_overrides(["max_steps=-1"])) == []


def test_export_writes_the_slurm_script_on_the_forms_nodes_whatever_run_on_says(tab):
    """Run on: this machine and Nodes at 1 wrote `#SBATCH --nodes=2` and said "2 node(s)"."""
    demo, form, manager = tab
    export = handler(demo, "on_export")
    for nodes in (1, 3):
        message, files = call(export, form, {"run_on": "local", "nodes": nodes, "time": "30"})
        assert f"(Slurm, {nodes} node(s)" in message, message
        script = Path(next(p for p in files["value"] if p.endswith("-slurm.sh"))).read_text()
        assert re.findall(r"^#SBATCH --nodes=(\d+)$", script, re.M) == [str(nodes)]
        assert "#SBATCH --time=30" in script  # the Slurm box's settings too
        assert "Run on Slurm shows its Nodes and settings" in message


@pytest.mark.fast
def test_a_ray_run_without_an_address_is_refused_under_the_forms_field(tab):
    demo, form, manager = tab
    message = next(call(handler(demo, "on_start"), form, {"run_on": "ray", "nodes": 2, "address": ""}))[0]
    assert "Ray address: empty, and a run on Ray needs it: write the head's dashboard address" in message
    assert "studio.ray.address" not in message and "--ray" not in message  # the recipe's key, the flag
    assert runs_made(manager) == []


@pytest.mark.fast
def test_the_core_map_says_which_cluster_picks_the_nodes(tab):
    demo, form, _ = tab
    on_layout = handler(demo, "on_layout")
    typed = {"nodes": 2, "address": "http://10.0.0.5:8265"}
    ray_map, _ = call(on_layout, form, typed | {"run_on": "ray"})
    assert "x 2 nodes (Ray picks them)" in ray_map and "Slurm" not in ray_map
    slurm_map, _ = call(on_layout, form, typed | {"run_on": "slurm"})
    assert "x 2 nodes (Slurm picks them)" in slurm_map


def test_the_plan_shown_goes_once_the_form_no_longer_holds_what_it_was_made_of(tab):
    import gradio as gr

    demo, form, _ = tab
    message, plan, made_of = call(handler(demo, "on_preview"), form, {})
    assert plan["visible"] and "torch.distributed.run" in plan["value"]
    plan_box = handler(demo, "on_preview").outputs[1]
    changed = handler(demo, "on_form_change", output=plan_box)
    state = next(c for c in changed.inputs if isinstance(c, gr.State))
    assert call(changed, form, {}, others={state: made_of}) == (gr.update(), gr.update())  # the same form: kept
    for typed in ({"trainer": "dpo"}, {"run_on": "ray"}, {"learning_rate": "1e-3"}):
        hidden, kept = call(changed, form, typed, others={state: made_of})
        assert hidden == gr.update(visible=False) and kept is None, typed
