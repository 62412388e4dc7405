"""`launch.py serve RUN`: the tuned model behind an OpenAI-compatible endpoint, tried with the real
`openai` client: answers streamed and not, plain completions, a load of concurrent clients
decoded together within bounded shapes (an answer the same alone or among others), a client that
leaves mid-stream (its row free at once), a burst of 200, and each bad request
with OpenAI's status and a message saying what to change. The tests marked fast check the
request rules and the queue in this process and start no model."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from studio_core.data.builtin import BUILTIN_DATASETS
from studio_core.serve.openai_api import Turns
from studio_core.serve.openai_request import ApiError, chat_messages, sampling

ROOT = Path(__file__).resolve().parent.parent
QA = [json.loads(line)["messages"] for line in Path(BUILTIN_DATASETS["builtin:qa"]).read_text().splitlines()]
KEY = "sk-studio-test-key-0123"


# --- the rules, in this process -------------------------------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("body, param, says", [
    ({"max_tokens": 0}, "max_tokens", "from 1 to 960"),
    ({"max_tokens": 961}, "max_tokens", "the model's cache holds 1024 tokens"),
    ({"temperature": -1}, "temperature", "from 0 to 2"),
    ({"top_p": 0}, "top_p", "above 0"),
    ({"n": 2}, "n", "n must be 1"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "up to 4"),
    ({"seed": 1.5}, "seed", "whole number"),
])
def test_each_bad_setting_names_itself_and_what_to_write(body, param, says):
    with pytest.raises(ApiError) as raised:
        sampling(body, max_cache_len=1024)
    assert (raised.value.status, raised.value.param) == (400, param) and says in raised.value.message


@pytest.mark.fast
@pytest.mark.parametrize("messages, says", [
    (None, "non-empty list"), ([], "non-empty list"), ([{"role": "bot", "content": "hi"}], "role must be one of"),
    ([{"role": "user", "content": 3}], "must be text"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}], "the last message"),
])
def test_bad_messages_are_refused_with_what_is_wrong(messages, says):
    with pytest.raises(ApiError) as raised:
        chat_messages({"messages": messages})
    assert raised.value.status == 400 and says in raised.value.message


@pytest.mark.fast
def test_text_parts_are_joined_as_openai_sends_them():
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "Zorbia?"}]
    assert chat_messages({"messages": [{"role": "user", "content": parts}]}) == [
        {"role": "user", "content": "What is Zorbia?"}]


@pytest.mark.fast
def test_requests_take_turns_in_arrival_order_and_a_full_queue_refuses():
    turns, order = Turns(limit=3), []
    tickets = [turns.enter() for _ in range(4)]  # one answering, three waiting
    with pytest.raises(Turns.Full):
        turns.enter()

    def take(i):
        turns.wait(tickets[i])
        order.append(i)
        turns.leave(tickets[i])

    threads = [threading.Thread(target=take, args=(i,)) for i in (3, 1, 2, 0)]  # started out of order
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert order == [0, 1, 2, 3] and turns.queued == 0


@pytest.mark.fast
@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.20"])
def test_another_host_without_a_key_is_refused_before_loading(host, tmp_path):
    done = subprocess.run([sys.executable, "launch.py", "serve", "builtin:tiny-qwen3", "--host", host,
                           "--runs-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"Refusing to serve on {host} without a key" in done.stderr
    assert "--api-key-file" in done.stderr and "Traceback" not in done.stderr


# --- a real server over the tiny tuned model --------------------------------------------------
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(trained_runs, tmp_path_factory):
    """`launch.py serve <the full SFT run>` with an API key, until the module's tests end."""
    manager, ids = trained_runs
    key_file = tmp_path_factory.mktemp("key") / "key.txt"
    key_file.write_text(KEY + "\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "launch.py", "serve", ids["full"], "--port", str(port), "--runs-dir",
                             str(manager.runs_dir), "--api-key-file", str(key_file), "--max-queue", "24",
                             "--engine", "studio"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith(f"Serving {ids['full']} at http://127.0.0.1:{port}/v1"), line + proc.stderr.read()
    yield {"url": f"http://127.0.0.1:{port}/v1", "model": ids["full"], "proc": proc}
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    assert KEY not in proc.stdout.read() + proc.stderr.read()  # never printed


def client(server, key: str | None = KEY, **options):
    import openai

    return openai.OpenAI(base_url=server["url"], api_key=key, max_retries=0, **options)


def stats(server) -> dict:
    request = urllib.request.Request(server["url"] + "/studio/stats", headers={"Authorization": f"Bearer {KEY}"})
    return json.load(urllib.request.urlopen(request, timeout=30))


def question(i: int) -> list[dict]:
    return [{"role": "user", "content": QA[i][0]["content"]}]


def test_the_tuned_model_answers_the_built_in_questions_streamed_and_not(server):
    api = client(server)
    assert [m.id for m in api.models.list().data] == [server["model"]]
    for i in range(3):
        answer = QA[i][1]["content"]
        whole = api.chat.completions.create(model=server["model"], messages=question(i), max_tokens=48,
                                            temperature=0)
        assert whole.choices[0].message.content == answer and whole.choices[0].finish_reason == "stop"
        assert whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens > 0
        chunks = list(api.chat.completions.create(model=server["model"], messages=question(i), max_tokens=48,
                                                  temperature=0, stream=True, stream_options={"include_usage": True}))
        pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert "".join(pieces) == answer and len(pieces) > 1  # piece by piece, not one block
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_plain_completion_stop_strings_and_a_seed(server):
    api = client(server)
    for most in (2, 64):  # cut at max_tokens, or ended by the model itself
        text = api.completions.create(model=server["model"], prompt="Zorbia", max_tokens=most, temperature=0)
        assert text.object == "text_completion" and 0 < text.usage.completion_tokens <= most
        ended = "length" if text.usage.completion_tokens == most else "stop"
        assert text.choices[0].finish_reason == ended and text.usage.prompt_tokens > 0
    answer = QA[0][1]["content"]
    word = answer.split()[1]
    cut = api.chat.completions.create(model=server["model"], messages=question(0), max_tokens=48, temperature=0,
                                      stop=[word])
    assert cut.choices[0].message.content == answer[:answer.index(word)] and cut.choices[0].finish_reason == "stop"
    sampled = [api.chat.completions.create(model=server["model"], messages=question(1), max_tokens=16,
                                           temperature=1.5, seed=7).choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1]  # the same seed, the same sample


def test_twenty_clients_at_once_are_all_answered_within_bounded_shapes(server):
    before = stats(server)

    def one_client(c: int) -> list[tuple[int, str, str]]:
        api = client(server, timeout=300)
        got = []
        for r in range(5):
            i = (c + r) % len(QA)
            reply = api.chat.completions.create(model=server["model"], messages=question(i), max_tokens=48,
                                                temperature=0)
            got.append((i, reply.choices[0].message.content, reply.choices[0].finish_reason))
        return got

    with ThreadPoolExecutor(max_workers=20) as pool:
        replies = [reply for got in pool.map(one_client, range(20), timeout=600) for reply in got]
    assert len(replies) == 100  # none lost
    assert all(text == QA[i][1]["content"] and finish == "stop" for i, text, finish in replies)  # each whole
    after = stats(server)
    assert after["completed"] - before["completed"] == 100 and after["queued"] == 0
    # a prefill of one prompt per length bucket, decodes of a batch bucket: however many clients come
    shapes, widths = {tuple(shape) for shape in after["shapes"]}, after["batch_buckets"]
    assert shapes <= {(1, b) for b in after["buckets"]} | {(w, 1) for w in widths}, shapes
    assert (8, 1) in shapes  # twenty at once: decoded eight together
    assert after["engine"]["mode"] == "eager" and after["engine"]["graphs"] == 0  # the CPU: nothing compiled
    assert "--compile" in after["engine"]["says"]


@pytest.fixture(scope="module")
def endless(server) -> str:
    """A plain prompt whose greedy answer runs to 900 tokens, so it is still being written when its
    client leaves. Which prompt does depends on the trained run (its training is not bit-for-bit
    the same from one session to the next: "Zorbia" alone ended after 6 tokens in one): found by
    asking."""
    api = client(server, timeout=300)
    for prompt in ("Zorbia is", "Zorbia", "The the", "is is is", "Pixel the cat", "Once upon a time"):
        answer = api.completions.create(model=server["model"], prompt=prompt, max_tokens=900, temperature=0)
        if answer.usage.completion_tokens == 900:
            return prompt
    pytest.fail("no prompt tried makes the tiny run write 900 tokens: add one that does")


def test_a_client_that_leaves_mid_stream_stops_its_generation_and_frees_its_turn(server, endless):
    api = client(server)
    before = stats(server)
    stream = api.completions.create(model=server["model"], prompt=endless, max_tokens=900, temperature=0,
                                    stream=True)
    next(iter(stream))
    stream.close()  # gone after the first piece
    answer = api.chat.completions.create(model=server["model"], messages=question(2), max_tokens=48, temperature=0)
    assert answer.choices[0].message.content == QA[2][1]["content"]  # its turn came
    # the next step boundary after the server saw the client gone: maybe after that answer (batched beside it)
    deadline = time.monotonic() + 10
    while (after := stats(server))["stopped"] == before["stopped"]:
        assert time.monotonic() < deadline, after
        time.sleep(0.1)
    assert after["stopped"] == before["stopped"] + 1
    assert after["stopped_after_tokens"] < 900  # the abandoned answer was cut short, not written out


def test_an_answer_is_the_same_alone_and_among_others_decoded_together(server):
    """At temperature 0 a request's answer does not depend on what else is decoded beside it."""
    api = client(server, timeout=300)
    prompts = ["Zorbia", "The studio", "Pixel the cat", "Once upon a time"]

    def complete(prompt: str) -> str:
        return api.completions.create(model=server["model"], prompt=prompt, max_tokens=40,
                                      temperature=0).choices[0].text

    alone = [complete(prompt) for prompt in prompts]
    with ThreadPoolExecutor(max_workers=8) as pool:
        together = list(pool.map(complete, prompts * 2))
    assert together == alone * 2
    assert len(set(alone)) > 1


def test_a_client_that_leaves_frees_its_row_at_once(server, endless):
    api = client(server)
    stopped = stats(server)["stopped"]
    # greedy, a prompt the tiny run answers with all 900 tokens (sampled, it may end before the client leaves)
    stream = api.completions.create(model=server["model"], prompt=endless, max_tokens=900, temperature=0,
                                    stream=True)
    next(iter(stream))
    assert stats(server)["answering"] == 1
    stream.close()
    deadline = time.monotonic() + 10
    while stats(server)["answering"]:
        assert time.monotonic() < deadline, stats(server)
        time.sleep(0.1)
    after = stats(server)
    assert after["stopped"] == stopped + 1 and after["stopped_after_tokens"] < 900, after  # not ended by its length


def test_a_burst_of_two_hundred_requests_is_answered_or_refused_and_memory_comes_back(server):
    import openai

    worker = next(child for child in psutil.Process(server["proc"].pid).children(recursive=True)
                  if "studio_core.serve.chat_worker" in child.cmdline())
    api = client(server, timeout=300)
    api.chat.completions.create(model=server["model"], messages=question(0), max_tokens=8, temperature=0)
    before = worker.memory_info().rss

    def one(i: int) -> str:
        try:
            api.chat.completions.create(model=server["model"], messages=question(i % len(QA)), max_tokens=24,
                                        temperature=0)
            return "answered"
        except openai.APIStatusError as error:
            assert error.status_code == 503 and error.body["code"] == "queue_full", error.body
            return "busy"

    with ThreadPoolExecutor(max_workers=200) as pool:
        outcomes = list(pool.map(one, range(200), timeout=600))
    assert outcomes.count("answered") >= 8 + 24 and outcomes.count("answered") + outcomes.count("busy") == 200
    assert one(0) == "answered"  # still answering
    assert worker.memory_info().rss <= before * 1.10, (before, worker.memory_info().rss)


@pytest.mark.parametrize("call, status, code, says", [
    (dict(messages=[]), 400, None, "messages must be a non-empty list"),
    (dict(messages=[{"role": "robot", "content": "hi"}]), 400, None, "role must be one of system, user, assistant"),
    (dict(max_tokens=0), 400, None, "max_tokens must be a whole number from 1 to"),
    (dict(max_tokens=5000), 400, None, "the model's cache holds"),
    (dict(messages=[{"role": "user", "content": "Zorbia " * 700}], max_tokens=200), 400,
     "context_length_exceeded", "the longest prompt this server takes is 512 tokens, whatever max_tokens"),
    (dict(messages=[{"role": "user", "content": "Zorbia " * 30}], max_tokens=900), 400,
     "context_length_exceeded", "ask for at most 768 tokens, or shorten the prompt"),
    (dict(model="gpt-4o"), 404, "model_not_found", "is not served here"),
])
def test_bad_requests_get_openai_errors_that_say_what_to_change(server, call, status, code, says):
    import openai

    request = {"model": server["model"], "messages": question(0), **call}
    with pytest.raises(openai.APIStatusError) as raised:
        client(server).chat.completions.create(**request)
    error = raised.value
    assert error.status_code == status and error.body["code"] == code and says in error.body["message"]


@pytest.mark.parametrize("key, says", [(None, "no API key was given"), ("sk-wrong-key-999", "not this server's")])
def test_without_the_right_key_nothing_is_answered(server, key, says):
    request = urllib.request.Request(server["url"] + "/models", headers={"Authorization": f"Bearer {key}"} if key
                                     else {})
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=30)
    assert raised.value.code == 401
    body = json.load(raised.value)
    assert body["error"]["code"] == "invalid_api_key" and says in body["error"]["message"]
