"""The shape of the code: dependencies point one way, no import cycles, entry points are not
imported as libraries, the app reaches the engine through its front doors, the repository
stands alone, a trainer is named only in the registry (and its own recipe, sample, tests), and a
backend's engine (slurm, ray) only in studio_core/backends.

Read from the source with `ast`, so these checks need no import of the modules themselves.
"""

import ast
import gc
import os
import re
from functools import lru_cache
from pathlib import Path

import pytest

from studio_core import backends
from studio_core.recipe import trainers
from studio_core.data.builtin import BUILTIN_DATASETS

pytestmark = pytest.mark.fast  # starts no run, torchrun, browser or app: in `pytest -m fast`

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("studio_core", "app", "cli")
ENTRY_POINTS = {"studio_core.training.worker", "studio_core.training.supervisor", "studio_core.serve.chat_worker", "studio_core.evaluate.eval_worker",
                "studio_core.doctor.doctor_child", "studio_core.training.precompile_worker",
                "studio_core.data.model_child", "studio_core.training.zygote"}
# The engine's modules the app and the command line may import: its front doors. Run folders'
# files, leases, processes and a backend's own modules are the run manager's and the backends'.
FRONT_DOORS = {f"studio_core.{name}" for name in (
    "runs.manager", "runs.view", "runs.history", "runs.queue", "runs.sweep",  # runs: start, follow, stop, list, compare, queue, sweep
    "recipe.spec", "recipe.validate", "recipe.trainers", "recipe.trl_schema",  # what a run is, and its checks
    "recipe.data_check", "recipe.data_scan", "recipe.dataset_check",  # a dataset against the trainer
    "recipe.data_preview",  # a vision dataset's first images, for the Train tab
    "data.sources", "data.builtin", "data.files",  # datasets and models
    "machine.hardware", "machine.cores", "machine.layout", "machine.sizes", "machine.monitor",  # this machine
    "machine.compile_cache", "backends",  # the compile cache; where runs can go (the registry, options)
    "machine.children",  # how a studio process imports its libraries (the app: Gradio with the collector off)
    "training.scripts", "training.forecast", "training.precompile", "training.memory",  # a launch, before it runs
    "serve.chat", "serve.images", "serve.openai_api", "serve.vllm_server", "serve.vllm_env", "evaluate.evaluation", "export.export", "export.hub",
    "doctor.doctor", "doctor.smoke")}

def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def parse(source: str) -> ast.Module:
    """ast.parse with the garbage collector paused. Here (Python 3.11.7) a fast-subset run once failed
    in ast.parse with "SystemError: AST constructor recursion depth mismatch" as a collection ran a
    finalizer that raised (a tqdm object Gradio had patched); cpython gh-106905 is that error's bug."""
    gc.disable()
    try:
        return ast.parse(source)
    finally:
        gc.enable()


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules a file imports, at any depth of the file (lazy imports count too)."""
    found = set()
    for node in ast.walk(parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from package import module` depends on that module; `from module import name`, on the module
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                     for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


@lru_cache(maxsize=1)
def graph() -> dict[str, set[str]]:
    """Each module's project imports (made when a test first asks: not while the suite is collected)."""
    known = modules()
    return {name: imports(path, set(known)) - {name} for name, path in known.items()}


def test_there_are_no_import_cycles():
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dependency in sorted(graph()[name]):
            if state.get(dependency) == 1:
                cycle = path[path.index(dependency):] + [dependency]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dependency not in state:
                visit(dependency, path + [dependency])
        state[name] = 2

    for name in sorted(graph()):
        if name not in state:
            visit(name, [name])


def test_dependencies_point_one_way():
    for name, path in modules().items():
        text = path.read_text()
        if name.startswith("studio_core"):
            assert not any(m.startswith(("app", "cli")) for m in graph()[name]), name
            assert not re.search(r"^\s*(import|from) gradio", text, re.M), f"{name} imports gradio"
        if name.startswith("app"):
            assert not any(m.startswith("cli") for m in graph()[name]), name


# studio_core's folders, bottom to top: a module imports only from its own folder or from one
# below it (docs/architecture.md says what each holds).
FOLDERS = ("machine", "rundir", "backends", "data", "recipe", "training", "runs", "serve", "evaluate", "export",
           "doctor")


def folder_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "studio_core" and len(parts) > 2 else None


def test_studio_core_is_in_folders_and_none_imports_from_a_folder_above_its_own():
    loose = [name for name in modules() if name.startswith("studio_core.") and folder_of(name) is None
             and name.count(".") == 1 and name.split(".")[1] not in FOLDERS]
    assert loose == [], f"modules at studio_core's top level: put each in its folder {FOLDERS}"
    assert {folder_of(name) for name in modules() if folder_of(name)} == set(FOLDERS)
    upward = [f"{name} -> {use}" for name, uses in graph().items() if folder_of(name)
              for use in uses if folder_of(use) and FOLDERS.index(folder_of(use)) > FOLDERS.index(folder_of(name))]
    assert upward == []


def test_the_folder_order_check_sees_an_upward_import():
    """The check above reads what it should: rundir/ below recipe/ is kept, so the run folder names the spec's file
    without reading a spec (recipe.spec.load_spec reads it)."""
    assert "studio_core.rundir.folder" in graph()["studio_core.recipe.spec"]
    assert FOLDERS.index(folder_of("studio_core.recipe.spec")) > FOLDERS.index(folder_of("studio_core.rundir.folder"))


def test_entry_points_are_not_imported_as_libraries():
    for name, uses in graph().items():
        assert not uses & ENTRY_POINTS, f"{name} imports {uses & ENTRY_POINTS}"


def test_the_app_and_the_command_line_reach_the_engine_through_its_front_doors():
    assert FRONT_DOORS <= set(graph()), sorted(FRONT_DOORS - set(graph()))  # each door is a module
    through_the_side = {name: sorted(use for use in uses if use.startswith("studio_core") and use not in FRONT_DOORS)
                        for name, uses in graph().items() if name.startswith(("app", "cli"))}
    assert {name: uses for name, uses in through_the_side.items() if uses} == {}


def test_the_repository_stands_alone():
    tracked = []
    for folder, subfolders, files in os.walk(ROOT):  # not into hidden folders (.git, the venvs) or caches
        subfolders[:] = [name for name in subfolders if not name.startswith(".") and name != "__pycache__"]
        tracked += [Path(folder, name) for name in files
                    if not name.startswith(".") and Path(name).suffix in (".py", ".md", ".yaml", ".txt", ".sh", "")]
    outside = ("../" + "shared", "shared" + "/notes")  # the team's notes beside the repository
    pointing = [str(p.relative_to(ROOT)) for p in tracked
                if any(place in p.read_text(errors="replace") for place in outside)]
    assert pointing == []


def test_a_trainer_is_named_only_by_its_registry_entry_recipes_sample_and_tests():
    """The files a new trainer touches: KTO, RLOO and reward modeling came through the registry
    alone. Their keys appear as a whole string nowhere else in the code."""
    added = {"kto", "rloo", "reward"}
    touched = {}
    for name, path in modules().items():
        strings = {node.value for node in ast.walk(parse(path.read_text()))
                   if isinstance(node, ast.Constant) and isinstance(node.value, str)}
        if strings & added:
            touched[name] = sorted(strings & added)
    assert touched == {"studio_core.recipe.trainers": sorted(added)}
    recipes = sorted(p.name for p in (ROOT / "recipes").glob("*.yaml")
                     if any(f"tiny-{key}" in p.name for key in added))
    assert recipes == sorted(f"tiny-{key}{lora}.yaml" for key in added for lora in ("", "-lora"))
    assert {t.sample for t in trainers.TRAINERS.values()} <= set(BUILTIN_DATASETS)


# The backends named by what they are (the default, "local", is also a plain word: not checked).
ENGINES = {name for name in backends.BACKENDS if name != backends.DEFAULT}


def engines_named(source: str) -> list[str]:
    """Where code names a backend's engine: an import of its package, a name (on_slurm, ray_client)
    or a string that is code, not words for people ("slurm", "slurm_job", ".slurm.sh", "--ray")."""
    found = []
    for node in ast.walk(parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [m for m in modules if any(m.startswith(f"studio_core.backends.{e}") for e in ENGINES)]
        words = [node.value] if isinstance(node, ast.Constant) and isinstance(node.value, str) and not re.search(
            r"\s", node.value) else [getattr(node, attribute, None) for attribute in ("id", "attr", "arg", "asname")]
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            words.append(node.name)
        found += [word for word in words if isinstance(word, str) and set(re.split(r"[^a-z0-9]+", word.lower())) &
                  ENGINES]
    return found


def test_the_engine_check_sees_an_engine_named_in_code():
    assert sorted(engines_named('from studio_core.backends.slurm import array as slurm_array\n'
                                'on_slurm = places == {"slurm"}\nrecord["slurm_job"] = 1\n'
                                'print("on Slurm: as the cluster allows", array)')) == [
        "on_slurm", "slurm", "slurm_array", "slurm_job", "studio_core.backends.slurm"]


def test_a_backend_is_named_only_in_its_own_folder():
    """What a place can do (a sweep's runs submitted as one group: Slurm's job array) is asked of
    the registry's backends (`backend.group`), so nothing outside studio_core/backends names an
    engine in code; words for people may ("on Slurm")."""
    named = {name: engines_named(path.read_text()) for name, path in modules().items()
             if not name.startswith("studio_core.backends")}
    assert {name: found for name, found in named.items() if found} == {}


# Libraries that cost a second or more of CPU to import: a test module imports them inside the tests
# that use them, so that collecting the tests (every worker collects every file) stays about a second.
HEAVY = ("torch", "transformers", "trl", "peft", "datasets", "gradio", "safetensors.torch", "pyarrow", "accelerate",
         "ray", "vllm")


def test_test_modules_import_no_heavy_library_when_collected():
    """Top-level imports only (a function's own imports run when a test does); conftest and the
    helpers the test files import at their top count too."""
    found = {}
    for path in sorted((ROOT / "tests").glob("*.py")):
        if path.name == "fake_device.py":  # the fake device is torch itself: imported inside its tests only
            continue
        for node in parse(path.read_text()).body:
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            heavy = [name for name in names if any(name == lib or name.startswith(f"{lib}.") for lib in HEAVY)]
            if heavy:
                found.setdefault(path.name, []).extend(heavy)
    assert found == {}
