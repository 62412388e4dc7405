"""`launch.py serve`'s size limits (issue 47): one huge request must not stall the others. The server
tokenized a prompt whole before its length check, so one 20 MB message took 32 s to get its 400 while
a normal request sent meanwhile waited as long. Now a body over a limit derived from the cache's
length is refused with 413 while it is read, a prompt of more characters than the longest prompt can
hold is refused as too long before anything reaches the chat process, and a batched chat process
tokenizes a long prompt beside the others' answers. The tests marked fast check the rules in this
process; the others serve the built-in tiny model (its tokenizer's longest token is 13 characters:
with the default 1024-token cache a prompt is at most 512 tokens, so 6,656 characters)."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from studio_core.data.builtin import BUILTIN_MODEL
from studio_core.serve.openai_request import (JSON_BYTES_PER_CHARACTER, REST_OF_REQUEST, ApiError, SizeLimits,
                                              check_size, parse)

ROOT = Path(__file__).resolve().parent.parent
TINY = SizeLimits(max_cache_len=1024, longest_token_chars=13)  # the built-in model's, at the default cache
SETTING = "launch.py serve --max-cache-len"


def chat_fields(*messages: tuple[str, str], max_tokens: int = 16) -> dict:
    body = {"model": "m", "messages": [{"role": role, "content": text} for role, text in messages],
            "max_tokens": max_tokens}
    return parse(body, "chat", "m", 1024)[0]


# --- the rules, in this process -------------------------------------------------------------
@pytest.mark.fast
def test_a_prompt_of_more_characters_than_the_longest_prompt_holds_is_too_long_without_tokenizing():
    assert TINY.longest_prompt == 512 and TINY.max_prompt_chars == 512 * 13
    check_size(chat_fields(("user", "x" * TINY.max_prompt_chars)), TINY, SETTING)  # may fit: the chat process counts
    with pytest.raises(ApiError) as raised:
        check_size(chat_fields(("system", "x" * 6000), ("user", "y" * 657)), TINY, SETTING)
    error = raised.value
    assert (error.status, error.param, error.code) == (400, "messages", "context_length_exceeded")
    assert error.message.startswith("the prompt is 6,657 characters, so at least 513 tokens (a token of this model "
                                    "covers at most 13 characters)")
    assert "the longest prompt this server takes is 512 tokens, whatever max_tokens" in error.message
    assert "shorten the prompt, or serve with a cache of at least 1040 tokens (launch.py serve --max-cache-len)" \
        in error.message
    text = parse({"model": "m", "prompt": "z" * 20_000_000}, "text", "m", 1024)[0]
    with pytest.raises(ApiError) as raised:
        check_size(text, TINY, SETTING)
    assert (raised.value.param, raised.value.code) == ("prompt", "context_length_exceeded")
    assert "20,000,000 characters, so at least 1,538,462 tokens" in raised.value.message
    assert "the largest prompt bucket there is holds 8192" in raised.value.message


@pytest.mark.fast
def test_what_a_chat_template_may_drop_is_not_counted_against_the_prompt():
    """Llama 3's template trims each message, Qwen3's drops an earlier answer's reasoning: a
    conversation that renders short is left to the chat process to count."""
    check_size(chat_fields(("user", " " * 50_000 + "Hi" + "\n" * 50_000)), TINY, SETTING)
    check_size(chat_fields(("user", "Hi"), ("assistant", "<think>" + "x" * 50_000 + "</think>Hello"),
                           ("user", "Again")), TINY, SETTING)
    with pytest.raises(ApiError):  # a user's own </think> is text the template keeps
        check_size(chat_fields(("user", "x" * 50_000 + "</think>Hi")), TINY, SETTING)


@pytest.mark.fast
def test_a_tokenizer_that_drops_characters_gets_no_character_bound_but_still_a_body_limit():
    lossy = SizeLimits(max_cache_len=1024, longest_token_chars=13, drops_characters=True)
    assert lossy.max_prompt_chars is None and lossy.max_body_bytes == TINY.max_body_bytes
    check_size(chat_fields(("user", "x" * 100_000)), lossy, SETTING)


@pytest.mark.fast
def test_the_body_limit_follows_the_cache_and_the_longest_token_and_says_what_to_change():
    assert TINY.max_body_bytes == 512 * 13 * JSON_BYTES_PER_CHARACTER + REST_OF_REQUEST == 1_128_448
    longer = SizeLimits(max_cache_len=4096, longest_token_chars=13)  # prompts of up to 2048 tokens
    assert longer.max_body_bytes == 2048 * 13 * 12 + REST_OF_REQUEST
    error = TINY.too_large(SETTING)
    assert (error.status, error.code, error.kind) == (413, "request_too_large", "invalid_request_error")
    assert error.message.startswith("the request body is over 1,128,448 bytes, the most this server reads: its "
                                    "prompts are at most 512 tokens, 6,656 characters")
    assert error.message.endswith("Shorten the prompt, or serve with a longer cache (launch.py serve --max-cache-len)")


# --- the chat process's measure of its tokenizer ----------------------------------------------
def test_no_token_of_the_tiny_tokenizer_covers_more_characters_than_it_says():
    """The bound is honest: random texts of every kind of character never take fewer tokens than
    their characters over the longest token; a tokenizer that drops spaces is said to."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from studio_core.data.builtin import ensure_tiny_model
    from studio_core.serve.chat_worker import tokenizer_reach

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
    assert tokenizer_reach(tokenizer) == {"longest_token_chars": 13, "drops_characters": False}
    pieces = [" ", "  ", "\n", "\t", "a", "Zorbia", "the", "ing", "é", "e\u0301", "\u200b", "日本", "🦙", "\x00",
              "<|endoftext|>", "<|im_start|>", "----", "    ", "1234"]
    chance = random.Random(47)
    for _ in range(300):
        text = "".join(chance.choice(pieces) * chance.randint(1, 40) for _ in range(chance.randint(1, 60)))
        tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert tokens * 13 >= len(text), text
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()  # spaces are no token at all
    lossy = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
    assert tokenizer_reach(lossy) == {"longest_token_chars": 5, "drops_characters": True}


# --- a real server over the built-in tiny model ---------------------------------------------
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "launch.py", "serve", BUILTIN_MODEL, "--port", str(port), "--runs-dir",
                             str(tmp_path_factory.mktemp("runs")), "--engine", "studio"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith(f"Serving {BUILTIN_MODEL} at http://127.0.0.1:{port}/v1"), line + proc.stderr.read()
    yield {"url": f"http://127.0.0.1:{port}/v1", "port": port}
    proc.terminate()
    assert proc.wait(timeout=60) == 0


def stats(server) -> dict:
    return json.load(urllib.request.urlopen(server["url"] + "/studio/stats", timeout=30))


def api(server):
    import openai

    return openai.OpenAI(base_url=server["url"], api_key="unused", max_retries=0, timeout=300)


def tokenizing_time(text: str, share: int) -> float:
    """A lower bound of the seconds the tiny model's tokenizer takes over `text`: its 1/`share`
    part's, times `share` (tokenizing grows at least in proportion to the text)."""
    from transformers import AutoTokenizer

    from studio_core.data.builtin import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
    part = text[:len(text) // share]
    began = time.perf_counter()
    tokenizer(part, add_special_tokens=False)
    return (time.perf_counter() - began) * share


def normal_answers_while(server, busy: threading.Thread) -> list[float]:
    """Normal requests, one after another, until `busy` has ended and three were answered: each one's
    seconds to its answer."""
    seconds, client = [], api(server)
    while busy.is_alive() or len(seconds) < 3:
        began = time.perf_counter()
        answer = client.chat.completions.create(model=BUILTIN_MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=2, temperature=0)
        assert answer.usage.completion_tokens > 0
        seconds.append(time.perf_counter() - began)
    return seconds


def test_a_body_over_the_limit_is_refused_before_it_is_sent(server):
    """Its Content-Length says it all: the 413 comes with none of the 50 MB sent."""
    with socket.create_connection(("127.0.0.1", server["port"]), timeout=20) as connection:
        connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: here\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 50000000\r\n\r\n{\"model\": ")
        head, body = read_response(connection)
    assert head.startswith("HTTP/1.1 413"), head
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert stats(server)["limits"] == {"max_body_bytes": 1_128_448, "max_prompt_chars": 6656, "longest_token_chars": 13}


def test_a_body_without_a_length_is_refused_once_it_passes_the_limit(server):
    """Sent in chunks: refused once 1,128,448 bytes have come, not after the whole 4 MB."""
    chunk = b"x" * 65536
    with socket.create_connection(("127.0.0.1", server["port"]), timeout=20) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: here\r\nContent-Type: application/json\r\n"
                           b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(18):  # 1,179,648 bytes: just over the limit, and the body never ends
            connection.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        head, body = read_response(connection)
    assert head.startswith("HTTP/1.1 413"), head
    assert "the most this server reads" in json.loads(body)["error"]["message"]


def read_response(connection: socket.socket) -> tuple[str, bytes]:
    """(status line and headers, body) of one response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += connection.recv(65536) or pytest.fail(f"the server closed the connection: {data!r}")
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += connection.recv(65536) or pytest.fail("the server closed the connection mid-body")
    return head.decode(), body


def ask_refused(server, text: str, refused: list) -> None:
    """Ask with `text` as the message; the refusal (an APIStatusError) goes to `refused`."""
    import openai

    try:
        api(server).chat.completions.create(model=BUILTIN_MODEL, messages=[{"role": "user", "content": text}],
                                            max_tokens=16)
    except openai.APIStatusError as error:
        refused.append(error)


def test_a_20_mb_message_gets_its_413_and_stalls_no_one(server):
    """The issue's case, through the openai client: the huge message is refused with the limit and
    what to change, and each normal request sent meanwhile is answered before the server could even
    have tokenized the huge one (as it did, 32 s, holding every other request)."""
    huge = "hello world " * 1_700_000  # 20.4 MB
    refused = []

    def send_huge():
        ask_refused(server, huge, refused)

    sending = threading.Thread(target=send_huge)
    sending.start()
    seconds = normal_answers_while(server, sending)
    sending.join()
    assert [(e.status_code, e.body["code"]) for e in refused] == [(413, "request_too_large")], refused
    assert "over 1,128,448 bytes, the most this server reads" in refused[0].body["message"]
    assert max(seconds) < tokenizing_time(huge, share=100), seconds


def test_ten_1_mb_messages_are_refused_as_too_long_before_reaching_the_chat_process(server):
    """Under the body limit but over 6,656 characters: each a context_length_exceeded at once, none
    taking a place in the queue (the requests count stays), none tokenized; normal requests sent
    meanwhile are answered before the chat process could have tokenized them."""
    huge = "hello world " * 83_000  # 996,000 characters
    before = stats(server)
    refused = []

    def send_huge():
        ask_refused(server, huge, refused)

    senders = [threading.Thread(target=send_huge) for _ in range(10)]
    for sender in senders:
        sender.start()
    sending = threading.Thread(target=lambda: [sender.join() for sender in senders])
    sending.start()
    seconds = normal_answers_while(server, sending)
    sending.join()
    assert [(e.status_code, e.body["code"], e.body["param"]) for e in refused] == [
        (400, "context_length_exceeded", "messages")] * 10
    # its last space not counted: a template may trim it
    assert refused[0].body["message"].startswith("the prompt is 995,999 characters, so at least 76,616 tokens")
    assert stats(server)["requests"] == before["requests"] + len(seconds)  # only the normal ones entered
    assert max(seconds) < 10 * tokenizing_time(huge, share=10), seconds


# --- the chat process tokenizes a long prompt beside the others' answers ----------------------
class Sent:
    """A generation's halt that is never set; the first look at it says the request was written
    (ChatProcess.generate looks only once its order is sent)."""

    def __init__(self):
        self.written = threading.Event()

    def is_set(self) -> bool:
        self.written.set()
        return False


def test_a_long_prompt_being_tokenized_holds_up_no_other_request(tmp_path):
    """A batched chat process: a 1.2 MB prompt (one the server's character bound admits with a long
    enough cache and tokens) is still being tokenized when a short request comes after it, and the
    short one is answered first; the long one then gets its context_length_exceeded."""
    from studio_core.machine.hardware import cpu_hardware
    from studio_core.serve.chat import ChatError, ChatProcess

    chat = ChatProcess.start(BUILTIN_MODEL, tmp_path / "runs", cpu_hardware(), max_batch=2)
    try:
        ended, sent = [], Sent()

        def long_one():
            with pytest.raises(ChatError) as raised:
                list(chat.generate(None, text="hello world " * 100_000, max_new_tokens=8, whole=True, halt=sent))
            ended.append(("long", raised.value.code))

        writing = threading.Thread(target=long_one)
        writing.start()
        assert sent.written.wait(timeout=60)
        events = list(chat.generate(None, text="Zorbia", max_new_tokens=2, whole=True))
        ended.append(("short", events[-1]["type"]))
        writing.join(timeout=120)
        assert ended == [("short", "done"), ("long", "context_length_exceeded")]
        # a request whose client leaves while its long prompt (4,400 characters, 400 tokens) is tokenized
        # aside ends, stopped, once ready: its cancel is not lost
        gone = threading.Event()
        gone.set()
        events = list(chat.generate(None, text=" lighthouse" * 400, max_new_tokens=400, whole=True, halt=gone))
        assert events[-1]["type"] == "done" and events[-1]["stopped"], events[-1]
    finally:
        chat.unload()
