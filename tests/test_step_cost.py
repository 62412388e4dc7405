"""What the studio runs per training step costs the step: no device value read (the shape hook
reads tensor metadata only, the tokens are TRL's own host count), the per-step events written a
few at a time, and the studio's own time measured in the process (`studio_cost`); beside it, at the
end of training, the memory the process used at its peak (`peak_memory`) against the plan's estimate."""

import itertools

import pytest

from studio_core.training.compile_watch import EventBuffer, ShapeWatch, StepCost
from studio_core.rundir import events
from studio_core.rundir.events import fold, read
from studio_core.runs.manager import RunManager
from studio_core.runs.view import memory_text, studio_cost_text


@pytest.mark.fast
def test_the_shape_hook_records_shapes_without_reading_a_value(tmp_path):
    import torch  # here, not at the top: collecting the tests imports no torch

    class TakesIds(torch.nn.Module):
        """A module called as the trainer calls a causal LM: input_ids and attention_mask as keywords."""

        def forward(self, input_ids=None, attention_mask=None):
            return input_ids

    log = tmp_path / "events.jsonl"
    cost = StepCost()
    watch = ShapeWatch(log, lambda: 7, cost)
    model = TakesIds()
    watch.install(model)
    # meta tensors have a shape but no values: reading one (.sum(), int(), .item()) raises
    ids = torch.empty(4, 37, dtype=torch.long, device="meta")
    mask = torch.empty(4, 37, dtype=torch.long, device="meta")
    with torch.enable_grad():  # as in a training forward
        model(input_ids=ids, attention_mask=mask)
        model(input_ids=ids, attention_mask=mask)  # a shape already seen: no new event
        model(input_ids=torch.empty(4, 33, dtype=torch.long, device="meta"),
              attention_mask=torch.empty(4, 33, dtype=torch.long, device="meta"))
        watch._hook(model, (torch.empty(2, 5, dtype=torch.long, device="meta"),), {})  # ids given positionally
    assert [(e["shape"], e["step"]) for e in read(log)] == [([4, 37], 7), ([4, 33], 7), ([2, 5], 7)]
    assert cost.calls["shape_hook"] == 4


@pytest.mark.fast
def test_buffered_events_come_first_at_once_then_in_order_when_flushed(tmp_path):
    log = tmp_path / "events.jsonl"
    out = EventBuffer(log)
    out.add(events.log("first"))  # nothing written yet: goes at once
    assert [e["message"] for e in read(log)] == ["first"]
    out.FLUSH_S = float("inf")  # hold everything until flushed
    out.add(events.log("second"))
    out.add(events.log("third"))
    assert [e["message"] for e in read(log)] == ["first"]
    out.flush()
    assert [e["message"] for e in read(log)] == ["first", "second", "third"]


@pytest.mark.fast
def test_studio_cost_event_folds_into_the_state_and_the_summary_line():
    cost = StepCost()
    for part in StepCost.PARTS:
        cost.add(part, 0.0, 0.0)  # perf_counter() and thread_time() since 0: some positive time
    event = events.studio_cost(300, cost.parts())
    assert set(event["parts"]) == {"step_end", "log", "shape_hook", "stop_check"}
    assert event["per_step_ms"] == pytest.approx(event["seconds"] / 300 * 1000, rel=1e-3)
    state = fold([events.status("running"), event])
    assert state.studio_cost == event
    assert studio_cost_text(state.studio_cost).startswith(f"the studio's own cost: {event['per_step_ms']:.3f} ms "
                                                          "per step")
    state.apply(events.resume(100, "checkpoint-100"))  # a new attempt reports its own cost
    assert state.studio_cost is None and studio_cost_text(state.studio_cost) is None


def test_progress_tokens_are_trls_count_over_all_ranks_and_the_cost_is_reported(two_process_runs):
    """Two data-parallel processes: rank 0's progress tokens add up to TRL's own num_tokens, which
    TRL gathers over both ranks (rank 0's own tokens would be about half)."""
    view = RunManager(two_process_runs.runs_dir).view(two_process_runs.ids["run"])
    assert view.state == "finished" and view.world_size == 2, view.error_text
    log = read(view.dir / "events.jsonl")
    progress = [e for e in log if e["type"] == "progress"]
    so_far = dict(zip((e["step"] for e in progress), itertools.accumulate(e["tokens"] for e in progress)))
    logged = [(m["step"], m["num_tokens"]) for m in log if m["type"] == "metrics" and "num_tokens" in m]
    assert len(logged) == 40  # logging_steps=1
    assert [(step, so_far[step]) for step, _ in logged] == [(step, int(n)) for step, n in logged]
    assert view.tokens == int(logged[-1][1])

    (cost,) = [e for e in log if e["type"] == "studio_cost"]
    assert view.studio_cost == cost and cost["steps"] == 40
    calls = {name: part["calls"] for name, part in cost["parts"].items()}
    assert calls["step_end"] == calls["stop_check"] == 40 and calls["shape_hook"] >= 40
    assert calls["log"] >= 40  # a loss every step, and the totals at the end
    assert 0 < cost["cpu_seconds"] and 0 < cost["seconds"]
    assert cost["step_cpu_ms"] > 0  # the training thread's CPU per step, which the studio's is a share of


def test_the_run_measures_its_peak_memory_beside_the_plans_estimate(two_process_runs):
    view = RunManager(two_process_runs.runs_dir).view(two_process_runs.ids["run"])
    (peak,) = [e for e in read(view.dir / "events.jsonl") if e["type"] == "peak_memory"]  # rank 0's alone
    assert peak["device"] == "cpu" and peak["measured"].startswith("the model's tensors plus")
    estimate = view.launch()["memory"]
    assert estimate["bytes"] == sum(estimate["parts"].values()) and estimate["available"] > estimate["bytes"]
    # the tiny model's weights, gradients and AdamW's two states alone are 4 x its float32 size
    assert peak["bytes"] > estimate["parts"]["weights"] * 4 and view.peak_memory == peak
    text = memory_text(view)
    assert text.startswith("memory per core: estimated ") and "measured" in text
    assert f"the estimate is {estimate['bytes'] / peak['bytes']:.2f} x the measurement" in text
