"""Chat: train -> chat end to end, streaming, LoRA and full runs, bounded input shapes over a
long conversation, stop, unload, and core leases shared with training runs; prompts rendered
as SFT training rendered them, reasoning shown apart, empty answers said so.

Every chat here is a real chat process (studio_core.serve.chat_worker) on the tiny model, and
the runs are real torchrun runs of the recipes. The tests marked fast render templates with
the tiny model's real tokenizer, or show texts, and start nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from studio_core.machine import leases
from studio_core.data.builtin import BUILTIN_MODEL, BUILTIN_DATASETS, ensure_tiny_model
from studio_core.serve.chat import (EMPTY_ANSWER, ChatError, ChatProcess, opens_thinking, shown, split_reasoning,
                              template_kwargs)
from studio_core.serve.generation import buckets_for
from studio_core.machine.hardware import cpu_hardware
from studio_core.recipe.spec import RunSpec
from test_runs import LONG, wait_until_training

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
    # prompts end as SFT's training sequences did before the answer, and no answer starts in a <think> block
    assert chat.info["template_kwargs"] == {"enable_thinking": False} and not chat.thinking
    # the base model (a full run's own base, loaded on demand) does not know the facts: it is the random one
    assert chat.target.untrained == ("base",)
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
    # greedy, the tiny model writes all 500 tokens: sampled, it may end the answer itself
    events = chat.generate([{"role": "user", "content": "Go on forever."}], temperature=0, max_new_tokens=500)
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
    with pytest.raises(ChatError, match="has no config.json, so it is not a saved Transformers model"):
        ChatProcess.start(str(tmp_path), manager.runs_dir, cpu_hardware())  # a folder without a model


@pytest.mark.fast
def test_the_prompt_ends_where_sft_training_put_the_answer():
    import trl
    from transformers import AutoTokenizer
    from trl.data_utils import _tokenize  # what SFTTrainer tokenizes a "messages" row with

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    kwargs = template_kwargs(tokenizer)
    assert kwargs == {"enable_thinking": False} and not opens_thinking(tokenizer, kwargs)
    for conversation in QA:
        trained = _tokenize(tokenizer, conversation)["input_ids"]
        prompt = tokenizer.apply_chat_template(conversation[:-1], add_generation_prompt=True, tokenize=True,
                                               return_dict=True, **kwargs)["input_ids"]
        answer = tokenizer(conversation[-1]["content"], add_special_tokens=False)["input_ids"]
        assert trained[:len(prompt) + len(answer)] == prompt + answer
    # a template whose prompt opens the reasoning (DeepSeek-R1's): answers start inside a <think> block
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates/deepseek_r1_distill.jinja").read_text()
    assert template_kwargs(tokenizer) == {} and opens_thinking(tokenizer, {})


@pytest.mark.fast
def test_reasoning_is_shown_apart_and_no_tag_or_blank_run_leaks(capsys):
    from app.chat_tab import for_chatbot, for_model
    from cli.chat import print_answer

    assert split_reasoning("</think>\n\nPixel.") == ("", "\n\nPixel.")  # a stray end tag just goes
    assert split_reasoning("<think>\nA cat.\n</think>\n\nPixel.") == ("\nA cat.\n", "\n\nPixel.")
    assert split_reasoning("A cat.</think>Pixel.", thinking=True) == ("A cat.", "Pixel.")
    assert split_reasoning("<think>still thinking") == ("still thinking", "")
    assert shown("\n" * 257) == "" and shown(" a\n\n\n \n\nb\n") == "a\n\nb"
    pieces = ["<think>", "\nA cat", ".\n", "</think>", "\n\n", "Pix", "\n\n\n", "\n", "el", "</think>", "."]
    answers = [shown(split_reasoning("".join(pieces[:n]))[1]) for n in range(len(pieces) + 1)]
    assert all(later.startswith(earlier) for earlier, later in zip(answers, answers[1:]))  # it only grows

    question = {"role": "user", "content": "What is the name of the studio cat?"}
    conversation = [question, {"role": "assistant", "content": "<think>\nA cat.\n</think>\n\nPixel."},
                    question, {"role": "assistant", "content": "\n" * 257}]
    assert for_chatbot(conversation, thinking=False) == [
        question, {"role": "assistant", "content": "A cat.", "metadata": {"title": "Reasoning", "status": "done"}},
        {"role": "assistant", "content": "Pixel."}, question, {"role": "assistant", "content": EMPTY_ANSWER}]
    assert for_chatbot(conversation[:2], thinking=False, answering=True)[1]["metadata"]["status"] == "done"
    assert for_chatbot([question, {"role": "assistant", "content": "<think>hm"}], False, answering=True)[1:] == [
        {"role": "assistant", "content": "hm", "metadata": {"title": "Reasoning", "status": "pending"}},
        {"role": "assistant", "content": ""}]  # no placeholder while the model is still writing
    assert [m["content"] for m in for_model(conversation, thinking=False)] == [question["content"], "Pixel.",
                                                                                question["content"], ""]

    events = [{"type": "token", "text": piece} for piece in pieces] + [{"type": "done"}]
    assert print_answer(events, thinking=False) == ({"type": "done"}, "Pix\n\nel.")
    out, err = capsys.readouterr()
    assert out == "Pix\n\nel.\n" and err == "(reasoning, not part of the answer: A cat.)\n"
    assert print_answer([{"type": "token", "text": "\n" * 257}, {"type": "done"}], thinking=False)[1] == ""
    assert capsys.readouterr().out == EMPTY_ANSWER + "\n"
