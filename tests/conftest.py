"""Shared test setup: offline, one studio cache for the whole session, runs trained once per
session, the `fast` subset kept fast, and the slow files scheduled first.

The cache holds the built-in tiny model and TRL's field schema, both made on first use;
sharing it keeps each test from rebuilding them, while keeping the user's own cache
(~/.cache/trn-studio) out of the tests.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from studio_core.machine.children import skip_final_collection
from studio_core.machine.hardware import CPU_CORES_ENV
from studio_core.recipe import trl_schema
from studio_core.runs.manager import RunManager

# Python's default, whatever this machine's environment says (PYTHONDONTWRITEBYTECODE=1 here): the
# suite's ~1,500 processes (commands, supervisors, workers, children) each load the repository's
# modules from bytecode compiled once, not from source again, and pytest keeps its rewritten test
# modules between the two workers and between runs.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# Each pytest process ends without the last garbage collection over the heap torch, Transformers and
# Gradio built in it: about 1 to 2.5 s a worker, at the end of every run (children.py says why it is safe).
skip_final_collection()
# A test process starts runs one after another, as the app does: from its second on, each one-process
# CPU run is forked from a zygote that imported torch and TRL once (RunManager.fork_runs_from_a_zygote).
# pytest's PYTEST_CURRENT_TEST, which it changes for each test and no library reads, may differ.
RunManager.fork_runs_from_a_zygote(ignored=("PYTEST_CURRENT_TEST",))
# It also checks specs one after another for the whole session: it keeps the TRL config check's child
# (each start imports TRL, about 5 CPU-s; 43 starts in one whole run) rather than letting it go after the
# app's two idle minutes. It still ends with this process (its stdin closes); test_hardening_spec
# checks the idle ending itself.
trl_schema.CHECK_IDLE_S = 3 * 60 * 60
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
_MADE_HERE: list[str] = []  # the session's folders this process made: removed when the session ends


def _session_folder(variable: str, prefix: str) -> None:
    """A temp folder for the whole session in `variable`, made once: by pytest's first process,
    whose environment the xdist workers inherit (each session left about 10-40 MB in /tmp before)."""
    if variable not in os.environ:
        os.environ[variable] = tempfile.mkdtemp(prefix=prefix)
        _MADE_HERE.append(os.environ[variable])


def pytest_unconfigure(config):
    """In the process that made them, after every worker has ended: the session's folders go."""
    for folder in _MADE_HERE:
        shutil.rmtree(folder, ignore_errors=True)


_session_folder("STUDIO_CACHE_DIR", "studio-test-cache-")
# datasets' own cache of the JSONL files the tests load, away from the user's
_session_folder("HF_DATASETS_CACHE", "studio-test-datasets-")
# Core leases are machine-wide for users (machine/leases.py). Here each runs folder keeps its own
# (a relative STUDIO_LEASES_DIR is taken inside the runs folder), as if each test had a machine of
# its own: the two xdist workers' runs, a module's server and a test's own run never wait on each
# other's cores, nor on a user's studio. A test of the machine-wide folder sets its own.
os.environ["STUDIO_LEASES_DIR"] = ".leases"
# Every test has a runs folder of its own, so "next free" starts each run on core 0: with two
# pytest-xdist workers, the second one's cores start on another CPU (STUDIO_CPU_CORES), so
# their runs do not share one CPU while the other idles.
_CPUS, _WORKER = sorted(os.sched_getaffinity(0)), os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and len(_CPUS) > 1 and CPU_CORES_ENV not in os.environ:
    _FIRST = int(_WORKER[2:]) % len(_CPUS)
    os.environ[CPU_CORES_ENV] = ",".join(map(str, _CPUS[_FIRST:] + _CPUS[:_FIRST]))

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
LAUNCH_TIMEOUT_S = 180  # a hang guard for a CLI command: a 20-step run takes ~10 s on 2 cores


def run_folders(runs_dir):
    """The run folders in a runs folder, without the studio's own state (.leases/)."""
    return [p for p in runs_dir.iterdir() if not p.name.startswith(".")]


def make_unloadable(weights: Path) -> None:
    """Make a safetensors file unloadable while the studio's checks still pass it: its first tensor
    gets a type safetensors does not know (the same length, so its header and size hold). A file
    cut short is refused before launch, chat, eval or serve; this one fails only in the loader."""
    data = weights.read_bytes()
    assert b'"dtype":"F32"' in data[:4096], weights
    weights.write_bytes(data.replace(b'"dtype":"F32"', b'"dtype":"Q32"', 1))


def launch_py(*args: str, env: dict | None = None, timeout: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    """`launch.py ARGS` as a user runs it, from the repository root, in this environment plus `env`."""
    return subprocess.run([sys.executable, str(REPO / "launch.py"), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, check=False, env={**os.environ, **(env or {})})


def nothing_left(run_id: str, timeout: float = 20) -> None:
    """Wait until no process of the run is left (a cluster run's nodes end theirs after its end)."""
    import time

    from studio_core.machine.procs import run_processes

    deadline = time.monotonic() + timeout
    while run_processes(run_id):
        assert time.monotonic() < deadline, [p.cmdline() for p in run_processes(run_id)]
        time.sleep(0.5)


@pytest.fixture
def manager(tmp_path):
    """A run manager over a fresh runs folder; no trainer outlives the test."""
    from studio_core.machine.procs import kill_run_processes
    from studio_core.runs.manager import RunManager

    runs = RunManager(tmp_path / "runs")
    yield runs
    for path in run_folders(runs.runs_dir):
        kill_run_processes(path.name)


# --- the fast subset: `python -m pytest -q -m fast` ------------------------------------------
# What a fast test must not start, as it appears on a child's command line: a run (its
# supervisor, torchrun, a rank), the browser, or `launch.py` training or serving the app.
NOT_IN_A_FAST_TEST = ("studio_core.training.supervisor", "torch.distributed.run", "studio_core.training.worker", "chromium",
                      "playwright")
SHARED_RUN_FIXTURES = {"trained_runs", "sft_runs", "history_runs", "two_process_runs", "grpo_runs", "vlm_runs"}


def _heavy_start(args) -> str | None:
    argv = [str(a) for a in (args if isinstance(args, (list, tuple)) else [args])]
    line = " ".join(argv)
    for word in NOT_IN_A_FAST_TEST:
        if word in line:
            return word
    launch = next((i for i, a in enumerate(argv) if a.endswith("launch.py")), None)
    if launch is not None:
        rest = argv[launch + 1:]
        if rest[:1] == ["train"] or "--port" in rest:
            return f"launch.py {' '.join(rest[:2])}"
    return None


@pytest.fixture(autouse=True)
def _fast_tests_start_nothing_heavy(request, monkeypatch):
    """A test marked fast fails the moment it starts a run, torchrun, the browser or the app."""
    if request.node.get_closest_marker("fast") is None:
        return
    real_init = subprocess.Popen.__init__

    def checked_init(self, args, *more, **kwargs):
        heavy = _heavy_start(args)
        if heavy:
            pytest.fail(f"a test marked fast started {heavy!r}: unmark it, or make it start nothing", pytrace=False)
        real_init(self, args, *more, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", checked_init)


# The files that take longest (trained runs, the browser), longest first: pytest-xdist's
# --dist loadfile hands out whole files in collection order (pytest.ini turns off its reorder
# by test count), so the long ones start at once on both workers and the many quick files fill
# the gaps at the end, instead of one long file starting last and running alone. (test_browser_runs
# comes before test_history: it trains the history runs, one core at a time, while the other
# worker is busy with a long file, and test_history later finds them made.)
SLOW_FILES_FIRST = [
    "test_smoke.py", "test_slurm.py", "test_slurm_array.py", "test_ray.py", "test_runs.py", "test_hardening_worker.py",
    "test_forecast.py", "test_readme.py", "test_vllm.py",
    "test_browser_runs.py", "test_hardening_eval.py", "test_hardening_serve.py", "test_device_placement.py", "test_hardening_runs.py",
    "test_queue.py",
    "test_browser_train.py", "test_trainers.py", "test_browser_trainers.py", "test_resume.py", "test_precompile.py", "test_export.py",
    "test_vlm_export.py", "test_vlm_train.py", "test_vlm_chat.py", "test_vlm_model.py", "test_browser_vlm.py",
    "test_chat.py", "test_openai_api.py", "test_eval.py", "test_harness.py", "test_browser_chat_export.py",
    "test_history.py", "test_browser_data.py", "test_doctor.py", "test_compile_cache.py", "test_spec.py",
    "test_hub_dataset.py", "test_neuron_paths.py",
    "test_rewards.py", "test_hub_download.py", "test_scripts.py",
]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("fast") and SHARED_RUN_FIXTURES & set(getattr(item, "fixturenames", ())):
            raise pytest.UsageError(f"{item.nodeid} is marked fast but uses trained runs")
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file keeps its order


# --- finished runs trained once per test session ---------------------------------------------
class SharedRuns:
    """Finished runs trained once per test session, however many pytest-xdist workers run it:
    the first worker to ask starts them, every other asker waits for the same runs. They are
    only read through copies (`copy_to`), so a test may hold cores in its runs folder (a chat,
    an export), write into a run or delete it without touching anyone else's."""

    def __init__(self, runs_dir: Path, ids: dict[str, str]):
        self.runs_dir, self.ids = runs_dir, ids

    def copy_to(self, runs_dir: Path, *keys: str):
        """These runs (all by default) copied into `runs_dir`; a run manager over it."""
        from studio_core.runs.manager import RunManager

        runs_dir.mkdir(parents=True, exist_ok=True)
        for key in keys or self.ids:
            shutil.copytree(self.runs_dir / self.ids[key], runs_dir / self.ids[key])
        return RunManager(runs_dir)


def shared_runs(tmp_path_factory, name: str, specs: dict, side_by_side: int = 2) -> SharedRuns:
    """The runs of `specs` ({key: RunSpec}), started once per session in this order, at most
    `side_by_side` at a time (one core each), and finished.

    Under pytest-xdist every worker's temporary folder sits in one folder of the session
    (getbasetemp().parent), where a file lock lets one worker start the runs and the others
    find their ids; the runs train in their own processes, so every worker just waits for them."""
    from filelock import FileLock

    from studio_core.machine.hardware import cpu_hardware
    from studio_core.runs.manager import RunManager

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / f"shared-{name}"
    with FileLock(f"{root}.lock"):
        index = root / "ids.json"
        manager = RunManager(root / "runs")
        if index.exists():
            ids = json.loads(index.read_text())
        else:
            ids = {}
            for key, spec in specs.items():
                going = [run_id for run_id in ids.values() if manager.view(run_id).active]
                if len(going) >= side_by_side:
                    manager.wait(going[0])
                ids[key] = manager.start(spec, cpu_hardware()).id
            index.write_text(json.dumps(ids))
    for run_id in ids.values():
        view = manager.wait(run_id)
        assert view.live_state == "finished", f"shared run {run_id}: {view.live_state}: {view.error_text}"
    return SharedRuns(manager.runs_dir, ids)


@pytest.fixture(scope="session")
def sft_runs(tmp_path_factory):
    """A full SFT run and a LoRA SFT run of the tiny model on the built-in question and answer
    set (recipes/tiny-sft.yaml, recipes/tiny-sft-lora.yaml, 300 steps), finished: {"full", "lora"}."""
    from studio_core.recipe.spec import RunSpec

    return shared_runs(tmp_path_factory, "sft", {"full": RunSpec.load(RECIPES / "tiny-sft.yaml"),
                                                 "lora": RunSpec.load(RECIPES / "tiny-sft-lora.yaml")})


@pytest.fixture(scope="session")
def vlm_runs(tmp_path_factory):
    """Runs of the tiny vision-language model on builtin:shapes (recipes/tiny-vlm-sft.yaml),
    finished: {"full": 120 steps, a loss every 10, long enough to name colours and shapes;
    "lora": 10 steps of LoRA}."""
    from studio_core.recipe.spec import RunSpec

    recipe = RunSpec.load(RECIPES / "tiny-vlm-sft.yaml")
    return shared_runs(tmp_path_factory, "vlm", {
        "full": recipe.with_overrides(["max_steps=120", "logging_steps=10"]),
        "lora": recipe.with_overrides(["max_steps=10", "use_peft=true", "learning_rate=5e-3"])})


@pytest.fixture(scope="session")
def grpo_runs(tmp_path_factory):
    """A LoRA GRPO run of the tiny model with the recipe's two reward functions, 2 steps, a metrics
    event every 2, finished: {"lora"}. test_trainers checks it trained; test_eval scores its
    answers under its rewards."""
    from studio_core.recipe.spec import RunSpec

    spec = RunSpec.load(RECIPES / "tiny-grpo-lora.yaml").with_overrides(["max_steps=2", "logging_steps=2"])
    return shared_runs(tmp_path_factory, "grpo", {"lora": spec}, side_by_side=1)


@pytest.fixture(scope="session")
def two_process_runs(tmp_path_factory):
    """A local data-parallel run, finished: tiny SFT on 2 processes, 40 steps, a loss every
    step: {"run"}. Read it through RunManager(runs_dir); test_slurm compares a 2-node run with it."""
    from studio_core.recipe.spec import RunSpec

    spec = RunSpec.load(RECIPES / "tiny-sft.yaml").with_overrides(["studio.nproc=2", "max_steps=40",
                                                                   "logging_steps=1"])
    return shared_runs(tmp_path_factory, "two-process", {"run": spec}, side_by_side=1)


def history_specs() -> dict:
    """The specs of history_runs: two SFT runs of 20 steps that differ in learning rate, run name,
    max_grad_norm and report_to (sft-b logs to TensorBoard and Trackio too, for test_tracking), and
    a DPO run of 4 steps: {"sft-a", "sft-b", "dpo"}."""
    from studio_core.recipe.spec import RunSpec

    def tiny(recipe: str, *overrides: str) -> RunSpec:
        return RunSpec.load(RECIPES / recipe).with_overrides(["max_steps=20", "logging_steps=5", *overrides])

    return {"sft-a": tiny("tiny-sft.yaml"),
            "sft-b": tiny("tiny-sft.yaml", "learning_rate=1.0e-4", "run_name=tiny-sft-b", "max_grad_norm=0.5",
                          "report_to=[tensorboard, trackio]"),
            "dpo": tiny("tiny-dpo.yaml", "max_steps=4", "logging_steps=2")}


@pytest.fixture(scope="session")
def history_runs(tmp_path_factory):
    """The history_specs runs, finished, for the run history's tests (test_history) and the Runs
    tab's (test_browser_runs). Started one after another, so each took core 0 and they were made
    in this order."""
    return shared_runs(tmp_path_factory, "history", history_specs(), side_by_side=1)


@pytest.fixture(scope="session")
def trained_runs(sft_runs, tmp_path_factory):
    """sft_runs copied into a runs folder of this worker's: (manager, {"full", "lora"})."""
    return sft_runs.copy_to(tmp_path_factory.mktemp("trained") / "runs"), sft_runs.ids
