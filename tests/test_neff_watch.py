"""Neuron's compile cache answers and eager-mode compiles, checked on what they are made of.

There is no Trainium here: the NEFF cache is a real folder in tmp with files where TorchNeuron
puts them (<dir>/ab/cd/<key>.neff from its persistent cache, <dir>/<hash>/<hash>.neff from its
kernel path), TorchNeuron's per-graph records are the plain records `torch.neuron.get_dynamo_metrics()`
returns (as dicts, and as objects with its fields), and its PersistentHits counter is a number
read through a function, as torch_neuronx.metrics.get_counter_value gives it. The watcher, the
labeller and the precompile step's cache answer are the studio's real code; the events they
write are folded by the real RunView, whose ETA must leave the compile steps out.

A record of 0 ms is TorchNeuron's answer both for a NEFF found in the persistent cache and for an
entry it could not find (evicted): it is a hit only with evidence, else "unknown" (issue 45, item 5).
"""

import json
import sys
import time
from types import ModuleType, SimpleNamespace

import pytest

from studio_core.machine import leases
from studio_core.training import precompile
from studio_core.machine.compile_cache import neff_cache_folder, neff_keys, summary
from studio_core.training.compile_watch import CompileWatch, NeffCompileTimes, PersistentHits, StepCache
from studio_core.training.neff_watch import NeffStepWatch, cache_label, cache_labels, should_scan, step_cache_label
from studio_core.rundir import events
from studio_core.rundir.events import fold
from studio_core.runs.view import RunView, compile_totals_text

pytestmark = pytest.mark.fast  # starts no run, torchrun, browser or app

RUN_ID = "20261201-000000-neff-1a2b3c"


def add_neffs(folder, *keys: str) -> None:
    """What TorchNeuron's persistent cache writes after a compile: <folder>/ab/cd/<key>.neff."""
    for key in keys:
        (folder / key[:2] / key[2:4]).mkdir(parents=True, exist_ok=True)
        (folder / key[:2] / key[2:4] / f"{key}.neff").write_bytes(b"NEFF")


def add_kernel_neffs(folder, *hashes: str) -> None:
    """What TorchNeuron's Python kernel path writes: <folder>/<hash>/<hash>.neff, one folder down."""
    for name in hashes:
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / f"{name}.neff").write_bytes(b"NEFF")


def record(name: str, compile_us: int | None) -> dict:
    """A get_dynamo_metrics() record; None: one without torch_neuronx_compile_us."""
    found = {"graph_id": f"key-{name}", "graph_name": name, "model_name": "m", "graph_node_count": 12}
    return found if compile_us is None else {**found, "torch_neuronx_compile_us": compile_us}


class Step:
    """A training step as the worker's EventCallback ends it: began `seconds` ago (a step of that
    length, passed as a time, not slept), then CompileWatch.step_ended and the progress event."""

    def __init__(self, watch: CompileWatch, log, max_steps: int):
        self.watch, self.log, self.max_steps, self.number = watch, log, max_steps, 0

    def __call__(self, seconds: float, new_shape: bool = False, before_end=None) -> dict:
        self.number += 1
        mark = (time.time() - seconds, self.watch.compile_seconds())
        if before_end is not None:
            before_end()  # what the step did to the NEFF cache and TorchNeuron's records
        self.watch.step_ended(mark, new_shape=new_shape)
        compiled = self.watch.compile_seconds()
        step_s = max(0.0, time.time() - mark[0] - (compiled - mark[1]))
        progress = events.progress(self.number, self.max_steps, None, round(step_s, 4), round(compiled, 3), 64,
                                   compiled=compiled > mark[1])
        events.append(self.log, progress)
        return progress


def run_page(tmp_path, written: list[dict]) -> RunView:
    """A run folder holding `written` as its events, as the run page and the CLI see it."""
    run = tmp_path / "runs" / RUN_ID
    run.mkdir(parents=True)
    (run / "launch.json").write_text(json.dumps({"backend": "local", "cores": [0], "hardware": {"backend": "cpu"}}))
    events.append_all(run / "events.jsonl", written)
    return RunView(dir=run).refresh()


def neuron_watch(tmp_path, records: list) -> CompileWatch:
    """A CompileWatch as install() sets it up on Neuron, its records and NEFF cache in tmp_path."""
    watch = CompileWatch(tmp_path / "events.jsonl", step=lambda: 0)
    watch.neff = NeffCompileTimes(lambda: list(records), recorded=lambda: len(records))
    watch.eager = NeffStepWatch(tmp_path / "neff")
    watch.eager.start()
    return watch


def test_the_neff_cache_is_read_where_torch_neuronx_writes_it(tmp_path):
    folder = tmp_path / "neff"
    add_neffs(folder, "ab12ff", "ab12ee", "cd56aa")
    (folder / "ab" / "12" / "tmpXYZ.tmp").write_bytes(b"half")  # a NEFF being written (temp file, then rename)
    (folder / "ab" / "12" / "ab12ff.lock").write_text("")
    assert neff_keys(folder) == {"ab12ff", "ab12ee", "cd56aa"}
    assert neff_keys(tmp_path / "none") == set()
    assert neff_keys(folder / "ab" / "12" / "ab12ff.neff") == set()  # a file, not a folder


def test_the_kernel_paths_neffs_one_folder_down_are_found_too(tmp_path):
    """TorchNeuron's kernel path writes <dir>/<hash>/<hash>.neff: found beside the persistent
    cache's two-level ones, in the cache folder and in the compile cache's summary alike."""
    folder = tmp_path / "neuron" / "neff"
    add_neffs(folder, "ab12ff")
    add_kernel_neffs(folder, "9f8e7d6c5b4a", "0123abcd")
    (folder / "9f8e7d6c5b4a" / "kernel.json").write_text("{}")  # beside it: not a NEFF
    (folder / "loop").symlink_to(folder, target_is_directory=True)  # a symlinked folder is not followed
    assert neff_keys(folder) == {"ab12ff", "9f8e7d6c5b4a", "0123abcd"}
    assert summary(tmp_path / "neuron").entries["NEFFs"] == 3


def test_thousands_of_neffs_list_by_name_alone(tmp_path):
    """A large cache of both layouts: every NEFF listed, none opened (each file is unreadable)."""
    folder = tmp_path / "neff"
    keys = [f"{i:04x}{i * 7919 % 65536:04x}cafe" for i in range(2500)]
    add_neffs(folder, *keys[:2000])
    add_kernel_neffs(folder, *keys[2000:])
    for neff in folder.rglob("*.neff"):
        neff.chmod(0)  # names are all the listing may read
    assert neff_keys(folder) == set(keys)
    assert neff_cache_folder({"TORCH_NEURONX_NEFF_CACHE_DIR": str(folder)}) == folder
    assert str(neff_cache_folder({})) == "/tmp/neff_cache"  # torch-neuronx's own default
    assert neff_cache_folder({"TORCH_NEURONX_NEFF_CACHE_DIR": str(folder),
                              "TORCH_NEURONX_NEFF_DISABLE_CACHE": "1"}) is None


def test_a_compile_time_is_a_miss_and_0_ms_is_a_hit_only_with_evidence():
    assert cache_label(95.0, 0) == "miss"  # compiled here, whatever the shared folder shows
    assert cache_label(95.0, None, persistent_hits=4) == "miss"
    # 0 ms: a persistent-cache hit, or an entry TorchNeuron could not find; the folder must back it
    assert cache_label(0.0, 0, held=5) == "hit"  # not compiled into the folder, which had NEFFs to find
    assert cache_label(0.0, 0, held=0) == "unknown"  # an empty folder had nothing to find
    assert cache_label(0.0, 3, held=5) == "unknown"  # the folder grew: its own compile, evicted, or another rank's
    assert cache_label(0.0, None) == "unknown"  # the folder was not looked at (or is off)
    # the PersistentHits counter, when TorchNeuron counts it, decides instead of the folder
    assert cache_label(0.0, 3, held=5, persistent_hits=1) == "hit"
    assert cache_label(0.0, 0, held=5, persistent_hits=0) == "unknown"
    assert cache_labels([0.0, 0.0, 80.0], None, persistent_hits=2) == ["hit", "hit", "miss"]
    assert cache_labels([0.0, 0.0], None, persistent_hits=1) == ["unknown", "unknown"]  # which one hit?
    # a record without the field: the folder decides, as before
    assert cache_label(None, 1) == "miss" and cache_label(None, 0, held=2) == "hit"
    assert cache_label(None, None) == "unknown" and cache_label(None, 1, persistent_hits=0) == "miss"
    # a precompile job's step: a miss if one graph missed, a hit if all hit, else unknown
    assert step_cache_label([0.0, 0.0], 0, held=2) == "hit"
    assert step_cache_label([0.0, 0.0], 2, held=2) == "unknown"
    assert step_cache_label([0.0, 120.0], 0, held=2) == "miss"
    assert step_cache_label([], 4) == "miss" and step_cache_label([], 0, held=4) == "hit"
    assert step_cache_label([], None) == "unknown" and step_cache_label([None, 0.0], None) == "unknown"


def test_compile_end_on_neuron_says_hit_or_miss_from_the_neff_cache(tmp_path):
    records = []
    watch = neuron_watch(tmp_path, records)
    step = Step(watch, tmp_path / "events.jsonl", max_steps=10)

    def compiled_forward():  # a cold cache: neuronx-cc ran for 95 s and stored its NEFF
        records.append(record("m_0_fwd_0", 95_000_000))
        add_neffs(tmp_path / "neff", "aa00forward")

    def cached_forward():  # a new shape whose graph the cache had: 0 ms, nothing written
        records.append(record("m_1_fwd_0", 0))

    def unrecorded(new: bool):  # a torch-neuronx whose records lack the compile time
        def step_body():
            records.append(record(f"m_{len(records)}_fwd_0", None))
            if new:
                add_neffs(tmp_path / "neff", f"bb{len(records):02d}unrecorded")
        return step_body

    step(96.0, before_end=compiled_forward)
    step(1.0, new_shape=True, before_end=cached_forward)
    step(30.0, new_shape=True, before_end=unrecorded(True))
    step(1.0, new_shape=True, before_end=unrecorded(False))
    ended = [e for e in events.read(tmp_path / "events.jsonl") if e["type"] == "compile_end"]
    assert [(e["graph"], e["phase"], e.get("cache")) for e in ended] == [
        ("m_0_fwd_0", "neff", "miss"), ("m_1_fwd_0", "neff", "hit"), ("m_2_fwd_0", "neff", "miss"),
        ("m_3_fwd_0", "neff", "hit")]
    assert not any(e["phase"] == "eager" for e in ended)  # each new NEFF is a graph's own


@pytest.mark.parametrize("counted, answer", [(None, "unknown"), (1, "hit")],
                         ids=["no counter: unknown", "PersistentHits grew: hit"])
def test_new_neffs_beside_a_0_ms_graph_go_to_an_eager_compile(tmp_path, counted, answer):
    """The graph's record says 0 ms; the step added two NEFFs: the optimizer's eager ops, compiled
    in the step's remaining time, or the graph's own (compiled, then evicted). Only TorchNeuron's
    PersistentHits counter can say the graph was found: without it the graph is unknown."""
    records, hits = [], [0]
    watch = neuron_watch(tmp_path, records)
    if counted is not None:
        watch.hits = PersistentHits(lambda: hits[0])
    step = Step(watch, tmp_path / "events.jsonl", max_steps=10)

    def body():
        records.append(record("m_0_fwd_0", 0))
        add_neffs(tmp_path / "neff", "cc01adam", "cc02adam")
        hits[0] += counted or 0

    progress = step(40.0, before_end=body)
    ended = [e for e in events.read(tmp_path / "events.jsonl") if e["type"] == "compile_end"]
    assert [(e["graph"], e["phase"], e.get("cache"), e.get("graphs")) for e in ended] == [
        ("m_0_fwd_0", "neff", answer, None), ("eager/0", "eager", "miss", 2)]
    assert ended[1]["seconds"] == pytest.approx(40.0, abs=1.0) and progress["compiled"]


def test_a_0_ms_record_with_nothing_to_find_is_unknown_not_a_hit(tmp_path):
    """An empty NEFF cache folder, nothing written: the graph was not found there. TorchNeuron
    reports 0 ms for an in-process entry it could not find (evicted) too: unknown, on the run
    page as well, while a graph compiled in the same run stays a miss."""
    records = []
    watch = neuron_watch(tmp_path, records)
    step = Step(watch, tmp_path / "events.jsonl", max_steps=10)
    step(1.0, new_shape=True, before_end=lambda: records.append(record("m_0_fwd_0", 0)))
    step(90.0, new_shape=True, before_end=lambda: (records.append(record("m_1_fwd_0", 88_000_000)),
                                                   add_neffs(tmp_path / "neff", "dd01fwd")))
    ended = [e for e in events.read(tmp_path / "events.jsonl") if e["type"] == "compile_end"]
    assert [(e["graph"], e["cache"]) for e in ended] == [("m_0_fwd_0", "unknown"), ("m_1_fwd_0", "miss")]
    totals = compile_totals_text(run_page(tmp_path, events.read(tmp_path / "events.jsonl")))
    assert totals.endswith("; 1 compiled, 1 unknown (nothing proves a cache hit or a compile)")


def test_persistent_hits_are_read_from_torch_neuronx_metrics_only_when_counted(monkeypatch):
    """torch_neuronx.metrics (a stand-in module here: there is no torch-neuronx) counts only with
    its metrics on; get_counter_value gives None for a counter not created yet."""
    metrics = ModuleType("torch_neuronx.metrics")
    counted = {"on": False, "value": None}
    metrics.is_enabled = lambda: counted["on"]
    metrics.get_counter_value = lambda name: counted["value"] if name == "CompilationCache.PersistentHits" else 7
    package = ModuleType("torch_neuronx")
    package.metrics = metrics
    monkeypatch.setitem(sys.modules, "torch_neuronx", package)
    monkeypatch.setitem(sys.modules, "torch_neuronx.metrics", metrics)
    assert PersistentHits.here() is None  # metrics off (TorchNeuron's default): no evidence from it
    counted["on"] = True
    hits = PersistentHits.here()
    assert hits.grown() == 0  # not created yet: none so far
    counted["value"] = 3
    assert hits.grown() == 3 and hits.grown() == 0
    counted["value"] = 1  # cleared with the persistent cache and counted again: says nothing
    assert hits.grown() is None and hits.grown() == 0


def test_an_eager_step_that_adds_neffs_is_a_compile_and_the_eta_leaves_it_out(tmp_path):
    """DPO on Neuron without torch.compile: no Dynamo graph, no record; step 1 and step 4 (a new
    batch shape) compile their ops for minutes. Their time becomes compile time, and the run's
    ETA is the steady steps' time per step, not skewed by them."""
    runs = tmp_path / "runs"
    run = runs / RUN_ID
    run.mkdir(parents=True)
    (run / "launch.json").write_text(json.dumps({"backend": "local", "cores": [0], "hardware": {"backend": "cpu"}}))
    log = run / "events.jsonl"
    events.append(log, events.status("starting"))
    events.append(log, events.status("running", world_size=1, max_steps=20))
    watch = neuron_watch(tmp_path, records=[])
    watch.events = log
    step = Step(watch, log, max_steps=20)
    watch.step = lambda: step.number
    neff = tmp_path / "neff"
    step(300.0, before_end=lambda: add_neffs(neff, *(f"d{i:03d}first" for i in range(40))))
    step(1.0)
    step(1.2)
    step(600.0, new_shape=True, before_end=lambda: add_neffs(neff, *(f"e{i:03d}shape" for i in range(12))))
    step(0.8)
    step(1.0)

    with leases.acquire(runs, "cpu", [0], holder=RUN_ID, kind="run"):  # as the run's supervisor holds it
        view = RunView(dir=run).refresh()
        assert view.live_state == "running"
        eager = [c for c in view.compiles if c["phase"] == "eager"]
        assert [(c["step"], c["graphs"], c["cache"]) for c in eager] == [(1, 40, "miss"), (4, 12, "miss")]
        assert [round(c["seconds"]) for c in eager] == [300, 600]
        assert eager[1]["started"] == pytest.approx(eager[1]["time"] - 600, abs=1.0)  # began with its step
        assert view.compile_seconds() == pytest.approx(900, abs=2)
        assert view.steady_step_seconds == pytest.approx([1.0, 1.2, 0.8, 1.0], abs=0.1)
        assert view.eta_seconds() == pytest.approx(1.0 * (20 - 6), abs=1.5)
        assert compile_totals_text(view).startswith("2 compilation(s) (2 eager) in 15:00")
    assert [(late["step"], late["graphs"]) for late in view.late_compiles()] == [(4, 12)]


def test_the_eta_waits_for_a_steady_step_when_every_step_since_the_first_compiled(tmp_path):
    """Step 1 warms up and step 2 compiled for ten minutes: the wall time between them is no rate."""
    runs = tmp_path / "runs"
    run = runs / RUN_ID
    run.mkdir(parents=True)
    (run / "launch.json").write_text(json.dumps({"backend": "local", "cores": [0], "hardware": {"backend": "cpu"}}))
    t0 = time.time() - 1000
    written = [events.status("starting"), events.status("running", world_size=1, max_steps=100),
               events.progress(1, 100, None, 5.0, 0.0, 64),
               events.compile_start("eager/2", "eager", 2), events.compile_end("eager/2", "eager", 2, 600.0),
               events.progress(2, 100, None, 0.01, 600.0, 64, compiled=True)]
    for event, at in zip(written, (t0, t0, t0 + 5, t0 + 5, t0 + 605, t0 + 605)):
        event["time"] = at
    events.append_all(run / "events.jsonl", written)
    with leases.acquire(runs, "cpu", [0], holder=RUN_ID, kind="run"):
        view = RunView(dir=run).refresh()
        assert view.live_state == "running" and view.step == 2
        assert view.eta_seconds() is None  # not 600 s per step for 98 steps


def test_steady_steps_leave_the_neff_cache_unlisted():
    assert should_scan(1, 300.0, False, []) and should_scan(2, 1.0, False, [])  # the warm-up steps
    steady = [1.0, 1.1, 0.9]
    assert not should_scan(7, 1.2, False, steady)  # a steady step pays nothing
    assert should_scan(7, 1.2, True, steady)  # a new batch shape
    assert should_scan(7, 40.0, False, steady)  # much slower than the steady ones
    assert not should_scan(7, 0.02, False, [0.01]) and should_scan(7, 1.5, False, [0.01])


def test_a_neff_added_in_an_unlisted_step_is_counted_at_the_next_listing(tmp_path):
    watch = NeffStepWatch(tmp_path / "neff")
    watch.start()
    assert watch.step_ended(5.0, False) == 0 and watch.step_ended(1.0, False) == 0  # warm-up: listed
    for wall in (1.0, 1.0, 1.0):
        watch.steady_step(wall)
    add_neffs(tmp_path / "neff", "ff00late")
    assert watch.step_ended(1.0, False) is None  # steady: not listed
    watch.steady_step(1.0)
    assert watch.step_ended(30.0, False) == 1  # slow: listed, the NEFF found


def test_a_precompile_step_on_neuron_says_whether_the_neff_cache_had_its_shape(tmp_path):
    records = []
    cache = StepCache(NeffCompileTimes(lambda: list(records), recorded=lambda: len(records)), tmp_path / "neff")
    cache.begin()
    records += [record("m_0_fwd_0", 70_000_000), record("m_0_bwd_0", 110_000_000)]
    add_neffs(tmp_path / "neff", "aa11fwd", "aa22bwd")
    compiled = cache.end()
    cache.begin()
    records += [record("m_1_fwd_0", 0), record("m_1_bwd_0", 0)]  # both found in the cache
    found = cache.end()
    assert (compiled, found) == ("miss", "hit")
    for neff in (tmp_path / "neff").rglob("*.neff"):
        neff.unlink()  # the cache cleared meanwhile: a 0 ms record now has nothing it could have been found in
    cache.begin()
    records += [record("m_2_fwd_0", 0)]
    unproven = cache.end()
    assert unproven == "unknown"
    done = [events.precompiled([4, 128], 0, 190.0, cache=compiled), events.precompiled([4, 256], 0, 3.0, cache=found),
            events.precompiled([4, 384], 0, 2.0, cache=unproven)]
    state = fold([events.precompile_start([[4, 128], [4, 256], [4, 384]], 1), *done])
    said = precompile.describe(state.precompile)
    assert "1 already in the cache" in said and "1 not known to have been in the cache or compiled" in said


def test_on_cpu_the_precompile_step_keeps_inductors_counters():
    from torch._dynamo.utils import counters

    cache = StepCache.here()
    assert cache.neff is None  # no torch-neuronx here
    cache.begin()
    counters["inductor"]["fxgraph_cache_hit"] += 2  # what Inductor adds when its FX graph cache answers
    assert cache.end() == "hit"
    cache.begin()
    assert cache.end() is None  # nothing asked the cache


def test_records_read_back_as_objects_label_the_same(tmp_path):
    """torch-neuronx returns dataclass objects; the studio reads their fields the same way."""
    add_neffs(tmp_path / "neff", "ee01earlier")  # what an earlier run compiled
    records = [SimpleNamespace(graph_id="k", graph_name="m_0_fwd_0", torch_neuronx_compile_us=0)]
    watch = neuron_watch(tmp_path, records)
    watch.step_ended()
    ended = [e for e in events.read(tmp_path / "events.jsonl") if e["type"] == "compile_end"]
    assert [(e["graph"], e["cache"]) for e in ended] == [("m_0_fwd_0", "hit")]


def test_an_old_runs_cache_answers_read_as_before(tmp_path):
    """Events written before "unknown" existed: "hit", "miss", or no answer at all."""
    old = [events.compile_end("0/0", "forward", 1, 2.0, cache="hit"), events.compile_end("0/0", "neff", 1, 0.0,
                                                                                          cache="hit"),
           events.compile_end("1/0", "neff", 3, 40.0, cache="miss"), events.compile_end("2/0", "backward", 3, 1.0)]
    view = run_page(tmp_path, [events.status("running", world_size=1, max_steps=5), *old])
    assert [c.get("cache") for c in view.compiles] == ["hit", "hit", "miss", None]
    assert compile_totals_text(view).endswith("; 2 found in the compile cache, 1 compiled")
    assert "unknown" not in compile_totals_text(view)
