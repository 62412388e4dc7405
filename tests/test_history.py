"""Run history on real runs: disk space, filters and sorting, metric curves and the settings
diff, clone (the run's settings back into the Train form and out again), delete (refused
while the run goes, allowed after it stopped, leases left alone), experiment tracking.

The runs are the tiny model on the CPU through the run manager, as in test_runs.py: the
session's history_runs (conftest), read here through a copy of this file's own.
"""

import importlib.util
import json
from pathlib import Path

import pytest

from studio_core.runs import history
from studio_core.recipe import trainers
from studio_core.machine.hardware import cpu_hardware
from studio_core.runs.view import RunView
from studio_core.machine.sizes import format_size
from studio_core.recipe.spec import RunSpec
from studio_core.recipe.trl_schema import trainer_fields
from conftest import history_specs, run_folders

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def tiny(recipe: str, *overrides: str) -> RunSpec:
    return RunSpec.load(RECIPES / recipe).with_overrides(["max_steps=20", "logging_steps=5", *overrides])


@pytest.fixture(scope="module")
def runs(history_runs, tmp_path_factory):
    """Three finished runs, made in this order: two SFT runs that differ in learning rate, run name,
    max_grad_norm and report_to, and a DPO run: (manager, {name: spec}, {name: view})."""
    manager = history_runs.copy_to(tmp_path_factory.mktemp("history") / "runs")
    return manager, history_specs(), {name: manager.view(run_id) for name, run_id in history_runs.ids.items()}


def test_run_size_counts_every_file(runs):
    _, _, views = runs
    run_dir = views["sft-a"].dir
    size = views["sft-a"].size()
    assert size == sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file())
    assert size > (run_dir / "output" / "model.safetensors").stat().st_size > 0
    extra = run_dir / "notes.txt"
    extra.write_bytes(b"x" * 1234)  # a new entry in the folder: the kept size is walked again
    try:
        assert views["sft-a"].size() == size + 1234
    finally:
        extra.unlink()
    assert views["sft-a"].size() == size
    assert format_size(1234) == "1.2 KB" and format_size(999) == "999 B" and format_size(2_300_000) == "2.3 MB"


def test_filters_and_sorts(runs):
    manager, _, views = runs
    every = manager.list()
    ids = {name: view.id for name, view in views.items()}
    assert [v.id for v in history.filter_runs(every, trainer="dpo")] == [ids["dpo"]]
    assert {v.id for v in history.filter_runs(every, trainer="sft")} == {ids["sft-a"], ids["sft-b"]}
    assert len(history.filter_runs(every, state="finished", model="builtin:tiny-qwen3")) == 3
    assert history.filter_runs(every, state="running") == []
    assert history.filter_runs(every, model="Qwen/Qwen3-0.6B") == []
    assert len(history.filter_runs(every, "all", "all", "all")) == 3

    newest = history.sort_runs(every, "newest first")
    assert [v.id for v in newest] == [ids["dpo"], ids["sft-b"], ids["sft-a"]]
    assert [v.id for v in history.sort_runs(every, "oldest first")] == [ids["sft-a"], ids["sft-b"], ids["dpo"]]
    by_loss = history.sort_runs(every, "final loss")
    losses = [v.last_loss() for v in by_loss]
    assert losses == sorted(losses) and None not in losses
    assert views["dpo"].last_loss() == [m["loss"] for m in views["dpo"].metrics if "loss" in m][-1]
    with pytest.raises(ValueError, match="choose one of"):
        history.sort_runs(every, "size")


def test_metric_curves_overlay_the_metrics_the_runs_share(runs):
    _, _, views = runs
    pair = [views["sft-a"], views["sft-b"]]
    names = history.metric_names(pair)
    assert names[:2] == ["loss", "learning_rate"] and "grad_norm" in names
    assert "step" not in names and "epoch" not in names
    rows = history.metric_curves(pair, "loss")
    for view in pair:
        assert [r["step"] for r in rows if r["run"] == view.id] == [1, 5, 10, 15, 20]
        assert [r["value"] for r in rows if r["run"] == view.id] == [m["loss"] for m in view.metrics if "loss" in m]
    # DPO logs its own metrics (rewards/...); only what all three share is offered
    shared = history.metric_names(list(views.values()))
    assert "loss" in shared and not any(name.startswith("rewards/") for name in shared)
    assert any(name.startswith("rewards/") for name in history.metric_names([views["dpo"]]))


def test_settings_diff_shows_only_the_differences(runs):
    _, _, views = runs
    a, b, dpo = views["sft-a"], views["sft-b"], views["dpo"]
    rows = history.settings_diff({a.id: a.spec, b.id: b.spec})
    assert rows == [["run_name", "tiny-sft", "tiny-sft-b"], ["learning_rate", str(a.spec["learning_rate"]), "0.0001"],
                    ["max_grad_norm", history.NOT_SET, "0.5"],
                    ["report_to", history.NOT_SET, '["tensorboard", "trackio"]'],
                    ["project", history.NOT_SET, b.id],  # planned for Trackio: the run's id, and no Space
                    ["trackio_static_space_id", history.NOT_SET, "false"]]

    rows = {row[0]: row[1:] for row in history.settings_diff({a.id: a.spec, dpo.id: dpo.spec})}
    assert rows["studio.trainer"] == ["sft", "dpo"]
    assert rows["dataset_name"] == ["builtin:qa", "builtin:preference"]
    assert rows["max_steps"] == ["20", "4"]
    assert "model_name_or_path" not in rows and "studio.nproc" not in rows
    only_dpo = [key for key in history.flatten(dpo.spec) if key not in history.flatten(a.spec)]
    assert only_dpo and all(rows[key][0] == history.NOT_SET for key in only_dpo)

    # the layout's keys are compared too
    diff = history.settings_diff({"x": {"studio": {"nproc": 1, "cores": "0"}}, "y": {"studio": {"nproc": 2}}})
    assert diff == [["studio.nproc", "1", "2"], ["studio.cores", "0", history.NOT_SET]]


def assert_same_run(original: RunSpec, made: RunSpec) -> None:
    """`made` is `original` as the Train form writes it: every setting of the original with its
    value, and, for the settings the original leaves out, TRL's defaults (the form writes
    out what its widgets hold)."""
    defaults = trainer_fields(original.trainer)
    added = {k: v for k, v in made.args.items() if k not in original.args}
    assert all(v == defaults[k]["default"] for k, v in added.items()), added
    assert made.to_dict() == original.to_dict() | added


def test_clone_is_the_recipe_without_what_the_planner_added(runs):
    from app.train_form import form_values, spec_from_form

    manager, specs, views = runs
    for name in ("sft-b", "dpo"):
        assert "use_cpu" in views[name].spec and "disable_tqdm" in views[name].spec  # added for this machine
        assert views[name].spec["studio"]["cores"] == "0"
        clone = history.clone_spec(manager, views[name].id)
        assert clone.to_dict() == specs[name].to_dict()
        assert_same_run(clone, spec_from_form(form_values(clone)))  # through the Train form and back


@pytest.mark.fast
@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_every_recipe_goes_through_the_train_form_unchanged(recipe):
    from app.train_form import form_values, spec_from_form

    spec = RunSpec.load(RECIPES / recipe)
    values = form_values(spec)
    assert_same_run(spec, spec_from_form(values))
    if recipe.startswith("tiny-") and not spec.trainer_entry.generates:  # cache_implementation: extra
        # the widgets hold every setting of the tiny recipes; the VLM's loss on its answers alone: extra
        assert values["extra"] == ("assistant_only_loss: true\n" if recipe == "tiny-vlm-sft.yaml" else "")


@pytest.mark.fast
def test_what_the_train_form_cannot_hold():
    # reward functions only exist for GRPO: another trainer's are dropped (validation refuses them anyway)
    from app.train_form import form_values, spec_from_form

    sft = RunSpec.load(RECIPES / "tiny-sft.yaml").with_overrides(["rewards=[{name: length, target: 5}]"])
    assert spec_from_form(form_values(sft)).rewards == []
    # keep_columns is a comma-separated box: a column name with a comma becomes two names
    odd = RunSpec.load(RECIPES / "tiny-sft.yaml").with_overrides(["keep_columns=['a,b']"])
    assert spec_from_form(form_values(odd)).keep_columns == ["a", "b"]
    # an empty split becomes the form's default
    empty = RunSpec.load(RECIPES / "tiny-sft.yaml").with_overrides(["dataset_train_split=''"])
    assert spec_from_form(form_values(empty)).dataset_train_split == "train"


@pytest.mark.fast
def test_values_a_widget_cannot_hold_go_to_the_extra_box():
    from app.train_form import form_values, spec_from_form

    spec = RunSpec.load(RECIPES / "tiny-dpo.yaml").with_overrides(
        ["save_strategy=epoch", "loss_type=[sigmoid, hinge]", "warmup_steps=0.1", "report_to=tensorboard"])
    values = form_values(spec, trackers=["none"])
    for key in ("save_strategy: epoch", "- hinge", "report_to: tensorboard"):
        assert key in values["extra"]
    assert values["warmup_steps"] == 0.1 and "warmup_steps" not in values["extra"]  # its box takes TRL's fractions
    assert values["report_to"] == "none"
    assert_same_run(spec, spec_from_form(values))
    # with TensorBoard offered, report_to has its own widget
    values = form_values(spec, trackers=["none", "tensorboard"])
    assert values["report_to"] == "tensorboard" and "report_to" not in values["extra"]
    assert spec_from_form(values).args["report_to"] == "tensorboard"


@pytest.mark.fast
def test_report_to_offers_what_is_installed_and_says_where_to_open_it(tmp_path):
    from app.train_form import report_choices

    installed = [name for name in ("tensorboard", "trackio") if importlib.util.find_spec(name)]
    assert report_choices() == ["none", *installed] == ["none", "tensorboard", "trackio"]  # requirements.txt
    run = tmp_path / "run folder"  # a space, quoted in the commands
    view = RunView(dir=run)
    view.spec = {"report_to": ["tensorboard", "trackio"], "project": "studio"}
    # a run the studio planned: the trackers' folders are in the run folder (test_tracking reads them)
    run.mkdir()
    (run / "launch.json").write_text(json.dumps({"env": {"TENSORBOARD_LOGGING_DIR": "elsewhere/tensorboard",
                                                         "TRACKIO_DIR": "elsewhere/trackio"}}))
    hint = history.tracking_hint(view)
    assert f"`tensorboard --logdir '{run / 'tensorboard'}' --port 6006`" in hint  # where the folder is now
    assert "[http://localhost:6006](http://localhost:6006)" in hint
    assert f"`TRACKIO_DIR='{run / 'trackio'}' trackio show --project studio`" in hint
    view.spec = {"report_to": "all"}  # every tracker installed; TRL's default project
    assert "tensorboard --logdir" in history.tracking_hint(view)
    assert "trackio show --project huggingface`" in history.tracking_hint(view)
    # a run made before the trackers went into the run folder: where transformers and Trackio wrote
    (run / "launch.json").write_text(json.dumps({"env": {}}))
    view = RunView(dir=run)
    view.spec = {"report_to": ["tensorboard", "trackio"]}
    hint = history.tracking_hint(view)
    assert f"--logdir '{run / 'output' / 'runs'}'" in hint and "`trackio show --project huggingface`" in hint
    view.spec = {"report_to": "none"}
    assert history.tracking_hint(view) is None


def test_delete_is_refused_while_the_run_goes_and_frees_its_space_after(manager):
    run = manager.start(tiny("tiny-sft.yaml", "max_steps=3000", "logging_steps=50"), cpu_hardware())
    with pytest.raises(history.RunActiveError, match=r"is (starting|running): stop it first"):
        history.delete_run(manager, run.id)
    manager.wait(run.id, lambda v: v.step >= 2 or not v.active)
    with pytest.raises(history.RunActiveError, match="is running: stop it first"):
        history.delete_run(manager, run.id)
    assert run.dir.is_dir()

    assert manager.stop(run.id).live_state == "stopped"
    size = run.size()
    leases = sorted(p.name for p in (manager.runs_dir / ".leases").iterdir())
    assert history.delete_run(manager, run.id) == size > 0
    assert not run.dir.exists() and run_folders(manager.runs_dir) == []
    assert [v.id for v in manager.list()] == []
    assert sorted(p.name for p in (manager.runs_dir / ".leases").iterdir()) == leases  # not the run's files
    with pytest.raises(KeyError, match="no run"):
        history.delete_run(manager, run.id)
