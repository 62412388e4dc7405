"""`launch.py serve MODEL` against bad requests and its own ending (issue 29): a malformed request is
refused whole before it takes a place in the queue, so the next one is still answered; OpenAI's
fields it does not implement are refused, not ignored; a prompt too long says the limit and how to
raise it; a key file others can read is warned about; SIGTERM ends the requests in flight and
queued with an error, the chat process and the core's lease. The tests marked fast check the
rules in this process; the others serve the built-in tiny model (untrained: its answers are noise,
long enough to still be writing when the server is told to end)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cli.serve import read_api_key
from studio_core.machine import leases
from studio_core.data.builtin import BUILTIN_MODEL
from studio_core.serve.openai_request import ApiError, parse, too_long

ROOT = Path(__file__).resolve().parent.parent
MODEL = "served-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}

# (what the request adds or changes, the param named, what the message says)
MALFORMED = [
    ({"stream": True, "stream_options": "x"}, "stream_options", "must be an object"),
    ({"stream": True, "stream_options": [1]}, "stream_options", "must be an object"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "true or false"),
    ({"stream": True, "stream_options": {"usage": True}}, "stream_options.usage", "unknown field"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "goes with \"stream\": true"),
    ({"stream": "yes"}, "stream", "must be true or false"),
    ({"stream": 1}, "stream", "must be true or false"),
    ({"model": None}, "model", "must be a string"),
    ({"model": ["x"]}, "model", "must be a string"),
    ({"seed": 2**80}, "seed", "from -9223372036854775808 to 18446744073709551615"),
    ({"seed": "7"}, "seed", "must be a whole number"),
    ({"max_tokens": 2.0}, "max_tokens", "must be a whole number"),
    ({"max_tokens": "12"}, "max_tokens", "must be a whole number"),
    ({"max_completion_tokens": -1}, "max_tokens", "from 1 to"),
    ({"temperature": "hot"}, "temperature", "must be a number"),
    ({"temperature": True}, "temperature", "must be a number"),
    ({"top_p": [1]}, "top_p", "must be a number"),
    ({"n": "1"}, "n", "n must be 1"),
    ({"n": 2}, "n", "n must be 1"),
    ({"stop": 5}, "stop", "a list of up to 4"),
    ({"stop": {"a": 1}}, "stop", "a list of up to 4"),
    ({"stop": [""]}, "stop", "non-empty strings"),
    ({"messages": "Hi"}, "messages", "non-empty list"),
    ({"messages": [["user", "Hi"]]}, "messages[0].role", "role must be one of"),
    ({"messages": [{"role": "user", "content": {"text": "Hi"}}]}, "messages[0].content", "must be text"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     "messages[0].content", "holds an image, and model 'served-model' takes text alone"),
    ({"metadata": {"run": 1}}, "metadata.run", "must be a string"),
    ({"user": 5}, "user", "must be a string"),
    ({"stream_option": {"include_usage": True}}, "stream_option", "unknown field"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "does not do tool calls"),
    ({"tool_choice": "required"}, "tool_choice", "does not do tool calls"),
    ({"logprobs": True}, "logprobs", "does not do log probabilities"),
    ({"top_logprobs": 3}, "top_logprobs", "does not do log probabilities"),
    ({"response_format": {"type": "json_object"}}, "response_format", "does not do structured output"),
    ({"presence_penalty": 0.5}, "presence_penalty", "does not do penalties"),
    ({"logit_bias": {"50256": -100}}, "logit_bias", "does not do logit biases"),
]


@pytest.mark.fast
def test_too_many_images_for_a_vision_model_are_refused_before_any_is_read():
    """Five images, none of them real: refused for their count, not for the first one's bytes."""
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}
    body = {**CHAT, "messages": [{"role": "user", "content": [part] * 5 + [{"type": "text", "text": "Hi"}]}]}
    with pytest.raises(ApiError) as refused:
        parse(body, "chat", MODEL, max_cache_len=1024, vision=True)
    assert refused.value.status == 400 and "hold 5 images; this server takes at most 4" in refused.value.message
    with pytest.raises(ApiError, match="not an image Pillow can read"):  # one is read, and refused for its bytes
        parse({**body, "messages": [{"role": "user", "content": [part]}]}, "chat", MODEL, max_cache_len=1024,
              vision=True)


@pytest.mark.fast
@pytest.mark.parametrize("change, param, says", MALFORMED)
def test_a_malformed_request_is_refused_whole_with_the_field_and_what_to_write(change, param, says):
    with pytest.raises(ApiError) as raised:
        parse({**CHAT, **change}, "chat", MODEL, max_cache_len=1024)
    assert (raised.value.status, raised.value.param) == (400, param) and says in raised.value.message


@pytest.mark.fast
def test_a_request_without_a_model_is_a_400_naming_the_field():
    with pytest.raises(ApiError) as raised:
        parse({"messages": CHAT["messages"]}, "chat", MODEL, max_cache_len=1024)
    error = raised.value
    assert (error.status, error.param) == (400, "model") and error.message.startswith("model is required")
    assert MODEL in error.message


@pytest.mark.fast
def test_openai_fields_at_their_default_and_a_clients_labels_are_taken():
    fields, stream, usage = parse({**CHAT, "tools": [], "tool_choice": "none", "logprobs": False, "n": 1,
                                   "response_format": {"type": "text"}, "presence_penalty": 0, "user": "me",
                                   "metadata": {"job": "eval"}, "parallel_tool_calls": True, "stream": True,
                                   "stream_options": {"include_usage": True}, "seed": 2**64 - 1}, "chat", MODEL, 1024)
    assert (stream, usage, fields["seed"], fields["messages"]) == (True, True, 2**64 - 1, CHAT["messages"])
    text, stream, usage = parse({"model": MODEL, "prompt": "Hi", "echo": False, "best_of": 1}, "text", MODEL, 1024)
    assert (text["text"], stream, usage) == ("Hi", False, False)
    with pytest.raises(ApiError) as raised:
        parse({"model": MODEL, "prompt": "Hi", "echo": True}, "text", MODEL, 1024)
    assert raised.value.param == "echo"


@pytest.mark.fast
def test_a_prompt_too_long_for_any_max_tokens_says_the_limit_and_the_setting_that_raises_it():
    chats = "the prompt is 702 tokens; with the answer's max tokens, at most 512 fit the model's cache"
    said = too_long(chats, max_cache_len=1024, max_tokens=200, setting="launch.py serve --max-cache-len")
    assert "the longest prompt this server takes is 512 tokens, whatever max_tokens" in said
    assert "a cache of at least 1224 tokens (launch.py serve --max-cache-len)" in said
    assert "fewer" not in said and "ask for at most" not in said


@pytest.mark.fast
def test_a_prompt_that_fits_with_fewer_answer_tokens_says_how_many():
    said = too_long("the prompt is 200 tokens; ...", max_cache_len=1024, max_tokens=900)
    assert "padded to 256" in said and "ask for at most 768 tokens" in said


@pytest.mark.fast
@pytest.mark.parametrize("mode, warned", [(0o644, True), (0o640, True), (0o600, False), (0o400, False)])
def test_a_key_file_other_users_can_read_is_warned_about_as_ssh_does(tmp_path, capsys, mode, warned):
    key_file = tmp_path / "key.txt"
    key_file.write_text("sk-studio-test-key-0123\n")
    key_file.chmod(mode)
    assert read_api_key(str(key_file)) == "sk-studio-test-key-0123"
    err = capsys.readouterr().err
    assert (f"chmod 600 {key_file}" in err and str(key_file) in err) == warned, err
    assert "sk-studio-test-key-0123" not in err


# --- a real server over the built-in tiny model ---------------------------------------------
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(runs_dir: Path, max_queue: int, max_batch: int = 8) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "launch.py", "serve", BUILTIN_MODEL, "--port", str(port), "--runs-dir",
                             str(runs_dir), "--max-queue", str(max_queue), "--max-batch", str(max_batch),
                             "--engine", "studio"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith(f"Serving {BUILTIN_MODEL} at http://127.0.0.1:{port}/v1"), line + proc.stderr.read()
    return proc, f"http://127.0.0.1:{port}/v1"


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


@pytest.fixture(scope="module")
def one_place_server(tmp_path_factory):
    """A server whose queue has one place: a turn that is never given back would hold it for good."""
    proc, url = start_server(tmp_path_factory.mktemp("runs"), max_queue=1)
    yield url
    proc.terminate()
    assert proc.wait(timeout=60) == 0


@pytest.mark.parametrize("change, param, says", MALFORMED[:12] + MALFORMED[-7:])
def test_a_malformed_request_leaves_the_server_answering_the_next(one_place_server, change, param, says):
    status, body = post(one_place_server + "/chat/completions", {**CHAT, "model": BUILTIN_MODEL, **change})
    assert (status, body["error"]["param"]) == (400, param) and says in body["error"]["message"], body
    status, body = post(one_place_server + "/chat/completions", {**CHAT, "model": BUILTIN_MODEL, "max_tokens": 2},
                        timeout=60)
    assert status == 200 and body["usage"]["completion_tokens"] > 0, body


@pytest.mark.parametrize("max_batch, where", [(1, "queued"), (8, "answering")])
def test_sigterm_ends_the_requests_in_flight_and_queued_the_chat_process_and_the_core(tmp_path, max_batch, where):
    """One at a time, three requests wait in the queue; batched, all four are decoded together.

    Greedy: the tiny model then writes all 900 tokens (sampled, it often ends early, and an answer
    that has ended is neither in flight nor queued when the signal comes)."""
    runs_dir = tmp_path / "runs"
    proc, url = start_server(runs_dir, max_queue=8, max_batch=max_batch)
    try:
        count = os.cpu_count() or 1
        chat_pids = [info["pid"] for info in leases.holders(runs_dir, "cpu", count).values()
                     if info.get("kind") == "chat"]
        assert len(chat_pids) == 1
        host, port = url.split("//")[1].split("/")[0].split(":")
        streamed = http.client.HTTPConnection(host, int(port), timeout=120)
        streamed.request("POST", "/v1/completions", json.dumps({"model": BUILTIN_MODEL, "prompt": "Zorbia",
                                                                "stream": True, "max_tokens": 900,
                                                                "temperature": 0}),
                         {"Content-Type": "application/json"})
        stream = streamed.getresponse()
        assert stream.status == 200
        events = []
        while not events or "choices" not in events[-1]:  # the first piece of the answer: it is being written
            line = stream.readline().decode()
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
        queued = []
        waiting = [threading.Thread(target=lambda: queued.append(post(url + "/completions", {
            "model": BUILTIN_MODEL, "prompt": "Zorbia", "max_tokens": 900, "temperature": 0}))) for _ in range(3)]
        for thread in waiting:
            thread.start()
        deadline = time.monotonic() + 120
        wanted = 3 if max_batch == 1 else 4
        while json.load(urllib.request.urlopen(url + "/studio/stats", timeout=30))[where] < wanted:
            assert time.monotonic() < deadline, f"the three requests are not {where}"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        rest = stream.read().decode()  # until the server closes the stream
        events += [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
        assert proc.wait(timeout=120) == 0
        for thread in waiting:
            thread.join(timeout=120)
        assert events[-1]["error"]["code"] == "server_shutting_down", events[-1]  # said, not a stream cut short
        assert "data: [DONE]" in rest
        assert [status for status, _ in queued] == [503] * 3, queued
        assert all(body["error"]["code"] == "server_shutting_down" for _, body in queued)
    finally:  # a failure above must not leave the server running
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with pytest.raises(ProcessLookupError):
        os.kill(chat_pids[0], 0)  # the chat process is gone, reaped
    assert leases.holders(runs_dir, "cpu", count) == {}  # its core is free
    assert "Stopped (SIGTERM)" in proc.stderr.read()
