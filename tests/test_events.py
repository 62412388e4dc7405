"""The run's event stream (studio_core.rundir.events): the constructors, the file a UI tails, and
the one fold every reader uses."""

import inspect
import json
import multiprocessing
import re
from pathlib import Path

import pytest

from studio_core.rundir import events
from studio_core.rundir.events import EventReader, append, fold, read

pytestmark = pytest.mark.fast  # starts no run, torchrun, browser or app: in `pytest -m fast`

README = Path(__file__).resolve().parent.parent / "README.md"


def test_append_writes_one_json_line_with_type_and_time(tmp_path):
    path = tmp_path / "events.jsonl"
    event = append(path, events.metrics(3, 0.5, {"loss": 1.5}))
    lines = path.read_text().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0]) == event
    assert event["type"] == "metrics" and event["step"] == 3 and event["loss"] == 1.5
    assert isinstance(event["time"], float)


def test_constructors_leave_out_fields_not_given():
    assert set(events.status("starting")) == {"type", "time", "state"}
    assert events.status("failed", exit_code=1)["exit_code"] == 1
    assert "reason" not in events.compile_start("0/0", "forward", 1)


def test_every_type_has_one_constructor_and_is_in_readme():
    built = {name for name, function in inspect.getmembers(events, inspect.isfunction)
             if function.__module__ == events.__name__ and name in events.TYPES}
    assert built == set(events.TYPES)
    text = README.read_text()
    section = text[text.index("`events.jsonl` has one JSON object per line"):]
    missing = [kind for kind in events.TYPES if not re.search(rf"`{kind}`", section)]
    assert missing == [], f"README's run-folder section does not describe {missing}"


def test_reader_returns_only_new_events(tmp_path):
    path = tmp_path / "events.jsonl"
    reader = EventReader(path)
    assert reader.read_new() == []  # no file yet
    append(path, events.status("starting"))
    append(path, events.log("one"))
    assert [e["type"] for e in reader.read_new()] == ["status", "log"]
    assert reader.read_new() == []
    append(path, events.progress(1, 10, 0.1, 0.01, 0.0, 12))
    new = reader.read_new()
    assert [(e["type"], e["step"]) for e in new] == [("progress", 1)]
    assert reader.offset == path.stat().st_size
    assert len(read(path)) == 3  # a fresh reader starts at the beginning


def test_partial_trailing_line_is_left_for_the_next_read(tmp_path):
    path = tmp_path / "events.jsonl"
    append(path, events.log("whole"))
    line = json.dumps({"type": "progress", "time": 1.0, "step": 7}) + "\n"
    with path.open("a") as handle:
        handle.write(line[:10])  # a writer is half-way through its line
    reader = EventReader(path)
    assert [e["type"] for e in reader.read_new()] == ["log"]
    with path.open("a") as handle:
        handle.write(line[10:])
    assert reader.read_new() == [{"type": "progress", "time": 1.0, "step": 7}]
    assert reader.read_new() == []


def test_torn_garbage_and_timeless_lines_are_skipped(tmp_path):
    path = tmp_path / "events.jsonl"
    append(path, events.log("before"))
    with path.open("a") as handle:
        handle.write('{"type": "metrics", "lo\n')  # torn by a crash mid-write
        handle.write("not json at all\n")
        handle.write("\n")
        handle.write("[1, 2, 3]\n")  # JSON, but not an event
        handle.write('{"no_type": true}\n')
        handle.write('{"type": "progress", "step": 4}\n')  # no time: nothing to place it by
        handle.write('{"type": "progress", "time": "noon", "step": 4}\n')
    append(path, events.log("after"))
    assert [e["message"] for e in EventReader(path).read_new()] == ["before", "after"]


def test_the_last_state_read_from_the_end_is_the_folds(tmp_path):
    path = tmp_path / "events.jsonl"
    assert events.last_state(path) is None  # no file yet
    append(path, events.log("no status yet"))
    assert events.last_state(path) is None
    written = []
    for lines in (["running"], ["stopped", "queued"], ["stopped"]):
        for state in lines:
            append(path, events.status(state))
        with path.open("a") as handle:  # what a reader skips, as the fold's reader does
            handle.write('{"type": "status", "state": "failed"}\n')  # no time
            handle.write('{"type": "status", "time": 1.0, "exit_code": 1}\n')  # no state: the last one stands
            handle.write('{"type": "status", "sta\n')  # torn by a crash mid-write
        written += lines
        assert events.last_state(path) == fold(read(path)).state == written[-1]
    with path.open("a") as handle:
        handle.write('{"type": "status", "time": 2.0, "state": "running"}')  # being written: not an event yet
    assert events.last_state(path) == fold(read(path)).state == "stopped"


def test_unknown_types_are_passed_through_and_folded_past(tmp_path):
    path = tmp_path / "events.jsonl"
    with path.open("a") as handle:
        handle.write(json.dumps({"type": "from_the_future", "time": 1.0, "x": [4, 128]}) + "\n")
    (event,) = EventReader(path).read_new()
    assert event["type"] == "from_the_future" and event["x"] == [4, 128]
    assert fold([event]).state == "starting"


def test_values_json_cannot_hold_are_written_as_text(tmp_path):
    path = tmp_path / "events.jsonl"
    append(path, events.checkpoint(2, tmp_path, 10))
    (event,) = read(path)
    assert event["folder"] == str(tmp_path)


def test_the_fold_of_a_resumed_run_keeps_only_the_path_to_its_model():
    timeline = [events.status("starting"), events.status("running", world_size=1, max_steps=6)]
    for step in range(1, 5):  # the first attempt logs steps 1-4, saved a checkpoint at 2, then died
        timeline += [events.progress(step, 6, None, 0.1, 0.0, 10), events.metrics(step, None, {"loss": 10.0 - step})]
    timeline += [events.compile_start("0/0", "forward", 3), events.status("failed", exit_code=1),
                 events.resume(2, "/run/output/checkpoint-2"), events.status("starting"),
                 events.status("running", world_size=1, max_steps=6)]
    for step in range(3, 7):
        timeline += [events.progress(step, 6, None, 0.1, 0.0, 10), events.metrics(step, None, {"loss": 1.0 / step})]
    timeline.append(events.status("finished", exit_code=0))
    state = fold(timeline)
    assert state.losses() == [(1, 9.0), (2, 8.0), (3, 1 / 3), (4, 0.25), (5, 0.2), (6, 1 / 6)]
    assert (state.state, state.exit_code, state.step, state.attempts) == ("finished", 0, 6, 2)
    assert state.compiling == {}  # the dead attempt's compilation is not "compiling now"


EVENTS_PER_WRITER = 300
WRITERS = 4


def _write_many(path: str, writer: int) -> None:
    padding = "x" * (200 + 50 * writer)  # lines of different lengths
    for n in range(EVENTS_PER_WRITER):
        append(path, events.metrics(n, None, {"writer": writer, "padding": padding}))


def test_concurrent_appends_from_several_processes_all_arrive_whole(tmp_path):
    path = tmp_path / "events.jsonl"
    reader = EventReader(path)
    seen = []
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_write_many, args=(str(path), w)) for w in range(WRITERS)]
    for process in writers:
        process.start()
    while any(p.is_alive() for p in writers):
        seen += reader.read_new()  # read while they write: partial lines must wait
    for process in writers:
        process.join()
        assert process.exitcode == 0
    seen += reader.read_new()

    lines = path.read_text().splitlines()
    assert len(lines) == WRITERS * EVENTS_PER_WRITER
    assert all(json.loads(line)["type"] == "metrics" for line in lines)  # no line is torn
    assert len(seen) == WRITERS * EVENTS_PER_WRITER
    for writer in range(WRITERS):
        mine = [e["step"] for e in seen if e["writer"] == writer]
        assert mine == list(range(EVENTS_PER_WRITER))  # each writer's events, in its order
        assert all(len(e["padding"]) == 200 + 50 * writer for e in seen if e["writer"] == writer)


@pytest.mark.fast
def test_a_reader_whose_file_is_deleted_waits_and_reads_the_new_one_from_its_start(tmp_path):
    path = tmp_path / "events.jsonl"
    events.append(path, events.status("running"))
    events.append(path, events.progress(1, 10, 0.1, 0.5, 0.0, 7))
    reader = events.EventReader(path)
    assert [e["type"] for e in reader.read_new()] == ["status", "progress"]
    path.unlink()
    assert reader.read_new() == [] and not reader.replaced  # gone: no ending invented
    for step in range(2, 12):  # a new file, longer than what was read of the old one
        events.append(path, events.progress(step, 10, 0.1, 0.5, 0.0, 7))
    assert [e["step"] for e in reader.read_new()] == list(range(2, 12)) and reader.replaced
    with open(path, "a") as handle:
        handle.write('{"type": "progress", "step": 99}\nnot json\n')
    assert reader.read_new() == [] and reader.skipped == 2
