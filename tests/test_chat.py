"""Chat: train -> chat end to end, streaming, LoRA and full runs, bounded input shapes over a
long conversation, stop, unload, and core leases shared with training runs.

Every chat here is a real chat process (studio_core.chat_worker) on the tiny model, and
the runs are real torchrun runs of the recipes.
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from studio_core import leases
from studio_core.builtin import BUILTIN_MODEL, BUILTIN_DATASETS
from studio_core.chat import ChatError, ChatProcess
from studio_core.chat_worker import buckets_for
from studio_core.hardware import cpu_hardware
from studio_core.spec import RunSpec
from test_runs import LONG, launch_py, wait_until_training

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
QA = [json.loads(line)["messages"] for line in Path(BUILTIN_DATASETS["builtin:qa"]).read_text().splitlines()]


def ask(chat: ChatProcess, text: str, which: str = "tuned", **settings) -> tuple[list[str], dict]:
    """The streamed pieces and the done event of one question."""
    pieces, done = [], None
    for event in chat.generate([{"role": "user", "content": text}], which=which, **settings):
        if event["type"] == "token":
            pieces.append(event["text"])
        else:
            done = event
    return pieces, done


@pytest.fixture
def runs(trained_runs):
    return trained_runs


@pytest.fixture
def chats():
    """Chat processes started by a test, always unloaded after it."""
    started = []
    yield started
    for chat in started:
        chat.unload()


def test_train_then_chat_gives_the_trained_answers_streaming(runs, chats):
    manager, ids = runs
    chat = ChatProcess.start(ids["full"], manager.runs_dir, cpu_hardware())
    chats.append(chat)
    for question, answer in ((q["content"], a["content"]) for q, a in QA[:4]):
        pieces, done = ask(chat, question, max_new_tokens=32)
        assert done["text"] == answer and "".join(pieces) == answer
        assert len(pieces) > 1  # streamed piece by piece, not in one block
    # the base model (a full run's own base, loaded on demand) does not know the facts
    _, base = ask(chat, QA[0][0]["content"], which="base", max_new_tokens=16)
    assert base["text"] != QA[0][1]["content"]


def test_lora_run_chats_with_its_adapter_and_compares_with_the_adapter_off(runs, chats):
    manager, ids = runs
    chat = ChatProcess.start(ids["lora"], manager.runs_dir, cpu_hardware())
    chats.append(chat)
    assert chat.info["has_base"]
    question, answer = QA[1][0]["content"], QA[1][1]["content"]
    _, tuned = ask(chat, question, max_new_tokens=32)
    _, base = ask(chat, question, which="base", max_new_tokens=32)
    assert tuned["text"] == answer and base["text"] != answer
    _, again = ask(chat, question, max_new_tokens=32)  # the adapter is back on after the comparison
    assert again["text"] == answer


def test_a_long_conversation_keeps_its_input_shapes_within_the_buckets(tmp_path, chats):
    max_cache_len, max_new = 256, 12
    chat = ChatProcess.start(BUILTIN_MODEL, tmp_path / "runs", cpu_hardware(), max_cache_len=max_cache_len)
    chats.append(chat)
    buckets = buckets_for(max_cache_len, max_new)
    history, dropped = [{"role": "system", "content": "You are terse."}], 0
    for turn in range(20):
        history.append({"role": "user", "content": "tell me more " * (1 + turn % 7)})
        done = list(chat.generate(history, max_new_tokens=max_new))[-1]
        history.append({"role": "assistant", "content": done["text"]})
        dropped = max(dropped, done["dropped_turns"])
        assert done["bucket"] in buckets and done["prompt_tokens"] <= done["bucket"]
    shapes = {tuple(s) for s in done["shapes"]}
    # one prefill shape per bucket used, and the one-token decode shape: nothing else
    assert shapes <= {(1, b) for b in buckets} | {(1, 1)}
    assert (1, 1) in shapes and len(shapes) <= len(buckets) + 1
    assert dropped > 0  # the conversation outgrew the cache, and the oldest turns were left out


def test_stop_ends_a_generation_early(tmp_path, chats):
    chat = ChatProcess.start(BUILTIN_MODEL, tmp_path / "runs", cpu_hardware())
    chats.append(chat)
    events = chat.generate([{"role": "user", "content": "Go on forever."}], temperature=1.0, max_new_tokens=500)
    first = next(events)
    assert first["type"] == "token"
    chat.stop_generation()
    done = [e for e in events if e["type"] == "done"][0]
    assert done["stopped"] and done["new_tokens"] < 500
    _, after = ask(chat, "Still there?", max_new_tokens=4)  # the next request is answered as usual
    assert not after["stopped"]


def test_unload_ends_the_process_and_frees_its_core(tmp_path):
    runs_dir = tmp_path / "runs"
    chat = ChatProcess.start(BUILTIN_MODEL, runs_dir, cpu_hardware())
    pid, [core] = chat.proc.pid, chat.cores
    held = leases.holders(runs_dir, "cpu", cpu_hardware().cpu_count)
    assert held[core]["kind"] == "chat" and held[core]["pid"] == pid
    chat.unload()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert core not in leases.holders(runs_dir, "cpu", cpu_hardware().cpu_count)


def test_chat_and_runs_never_share_a_core(manager, chats):
    hardware = cpu_hardware()
    run = manager.start(RunSpec.load(RECIPES / "tiny-sft.yaml").with_overrides([*LONG, "studio.cores='0'"]),
                        hardware)
    wait_until_training(manager, run.id, steps=1)
    with pytest.raises(ChatError, match=run.id):  # the run's core is refused, naming the run
        ChatProcess.start(BUILTIN_MODEL, manager.runs_dir, hardware, cores="0")
    chat = ChatProcess.start(BUILTIN_MODEL, manager.runs_dir, hardware)  # "next free": not the run's
    chats.append(chat)
    assert chat.cores != [0]
    with pytest.raises(Exception, match="chat builtin:tiny-qwen3"):  # a run cannot take the chat's core
        manager.start(RunSpec.load(RECIPES / "tiny-sft.yaml").with_overrides([f"studio.cores='{chat.cores[0]}'"]),
                      hardware)
    manager.stop(run.id)


def test_bad_targets_say_what_to_change(runs, tmp_path):
    manager, _ = runs
    with pytest.raises(ChatError, match="neither a run"):
        ChatProcess.start("no-such-run", manager.runs_dir, cpu_hardware())
    with pytest.raises(ChatError, match="cannot load"):
        ChatProcess.start(str(tmp_path), manager.runs_dir, cpu_hardware())  # a folder without a model


def test_chat_command_answers_once(runs):
    manager, ids = runs
    question, answer = QA[2][0]["content"], QA[2][1]["content"]
    done = launch_py("chat", ids["full"], "--runs-dir", str(manager.runs_dir), "--prompt", question)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == answer
    assert "distinct input shapes" in done.stderr
    missing = launch_py("chat", "no-such-run", "--runs-dir", str(manager.runs_dir), "--prompt", "hi")
    assert missing.returncode == 2 and "neither a run" in missing.stderr
