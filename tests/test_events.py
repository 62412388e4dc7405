"""Tests for the run's event stream (studio_core.events): the file a UI tails."""

import json
import multiprocessing

from studio_core.events import EventReader, append_event, read_events


def test_append_writes_one_json_line_with_type_and_time(tmp_path):
    path = tmp_path / "events.jsonl"
    event = append_event(path, "metrics", step=3, loss=1.5)
    lines = path.read_text().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0]) == event
    assert event["type"] == "metrics" and event["step"] == 3 and event["loss"] == 1.5
    assert isinstance(event["time"], float)


def test_reader_returns_only_new_events(tmp_path):
    path = tmp_path / "events.jsonl"
    reader = EventReader(path)
    assert reader.read_new() == []  # no file yet
    append_event(path, "status", state="starting")
    append_event(path, "log", message="one")
    assert [e["type"] for e in reader.read_new()] == ["status", "log"]
    assert reader.read_new() == []
    append_event(path, "progress", step=1)
    new = reader.read_new()
    assert [(e["type"], e["step"]) for e in new] == [("progress", 1)]
    assert reader.offset == path.stat().st_size
    assert len(read_events(path)) == 3  # a fresh reader starts at the beginning


def test_partial_trailing_line_is_left_for_the_next_read(tmp_path):
    path = tmp_path / "events.jsonl"
    append_event(path, "log", message="whole")
    line = json.dumps({"type": "progress", "time": 1.0, "step": 7}) + "\n"
    with path.open("a") as handle:
        handle.write(line[:10])  # a writer is half-way through its line
    reader = EventReader(path)
    assert [e["type"] for e in reader.read_new()] == ["log"]
    with path.open("a") as handle:
        handle.write(line[10:])
    assert reader.read_new() == [{"type": "progress", "time": 1.0, "step": 7}]
    assert reader.read_new() == []


def test_torn_and_garbage_lines_are_skipped(tmp_path):
    path = tmp_path / "events.jsonl"
    append_event(path, "log", message="before")
    with path.open("a") as handle:
        handle.write('{"type": "metrics", "lo\n')  # torn by a crash mid-write
        handle.write("not json at all\n")
        handle.write("\n")
        handle.write("[1, 2, 3]\n")  # JSON, but not an event
        handle.write('{"no_type": true}\n')
    append_event(path, "log", message="after")
    assert [e["message"] for e in EventReader(path).read_new()] == ["before", "after"]


def test_unknown_types_are_passed_through(tmp_path):
    path = tmp_path / "events.jsonl"
    append_event(path, "compile_start", graph="forward", shape=[4, 128])
    (event,) = EventReader(path).read_new()
    assert event["type"] == "compile_start"
    assert event["graph"] == "forward" and event["shape"] == [4, 128]


def test_values_json_cannot_hold_are_written_as_text(tmp_path):
    path = tmp_path / "events.jsonl"
    append_event(path, "log", message="saved", folder=tmp_path)
    (event,) = read_events(path)
    assert event["folder"] == str(tmp_path)


EVENTS_PER_WRITER = 300
WRITERS = 4


def _write_many(path: str, writer: int) -> None:
    padding = "x" * (200 + 50 * writer)  # lines of different lengths
    for n in range(EVENTS_PER_WRITER):
        append_event(path, "progress", writer=writer, n=n, padding=padding)


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
    assert all(json.loads(line)["type"] == "progress" for line in lines)  # no line is torn
    assert len(seen) == WRITERS * EVENTS_PER_WRITER
    for writer in range(WRITERS):
        mine = [e["n"] for e in seen if e["writer"] == writer]
        assert mine == list(range(EVENTS_PER_WRITER))  # each writer's events, in its order
        assert all(len(e["padding"]) == 200 + 50 * writer for e in seen if e["writer"] == writer)
