"""An OpenAI-compatible endpoint over a chat process: the tuned model for the user's own code.

    GET  /v1/models             the one model served (its name: the run id or model given)
    POST /v1/chat/completions   a conversation, rendered by the model's chat template as the chat
                                renders it; streamed as server-sent events with "stream": true
    POST /v1/completions        a plain prompt, no template
    GET  /v1/studio/stats       the studio's own figures: requests, queue, the input shapes so far

It answers through a ChatProcess (studio_core/chat.py): the same loading, static KV cache, prompt
buckets and core lease as the Chat tab, so however many requests come, the model sees at most a
prefill shape per bucket plus the one-token decode shape (on Neuron each is a compilation).
Requests are answered one at a time, in arrival order: batching them would add a shape per batch
size and bucket. At most `max_queue` wait; one more gets 503 at once. A client that disconnects
from a stream ends its generation after the current token and gives up its place.

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a request the
model cannot take (and what to change), 401 without the right key when one is set, 404 for another
model's name, 503 when the queue is full. The key is compared in constant time and never logged.

Built on FastAPI and uvicorn, which Gradio brings. No torch here: this runs in the app's process.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from collections import deque

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse

from studio_core.chat import ChatError
from studio_core.generation import buckets_for

DEFAULT_MAX_TOKENS = 128
MAX_QUEUE = 32
ROLES = ("system", "user", "assistant")
MAX_STOP = 4  # as OpenAI allows


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class Turns:
    """Requests take turns at the model in arrival order; at most `limit` wait (Full beyond)."""

    class Full(Exception):
        pass

    def __init__(self, limit: int):
        self.limit, self.waiting, self.cond = limit, deque(), threading.Condition()

    def enter(self) -> object:
        with self.cond:
            if len(self.waiting) > self.limit:  # the one answering now is not waiting
                raise Turns.Full()
            ticket = object()
            self.waiting.append(ticket)
            return ticket

    def wait(self, ticket: object) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.waiting[0] is ticket)

    def leave(self, ticket: object) -> None:
        with self.cond:
            self.waiting.remove(ticket)
            self.cond.notify_all()

    @property
    def queued(self) -> int:
        return max(0, len(self.waiting) - 1)


# --- what a request asks for ----------------------------------------------------------------
def sampling(body: dict, max_cache_len: int) -> dict:
    """max_tokens, temperature, top_p, seed, stop and n, checked; the chat process's fields."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    room = max_cache_len - buckets_for(max_cache_len, 1)[0]  # the smallest prompt bucket stays free
    if not _whole(max_tokens) or not 1 <= max_tokens <= room:
        raise ApiError(400, f"max_tokens must be a whole number from 1 to {room} (the model's cache holds "
                            f"{max_cache_len} tokens, prompt included), got {max_tokens!r}", "max_tokens")
    temperature = body.get("temperature", 1.0)
    temperature = 1.0 if temperature is None else temperature
    if not _number(temperature) or not 0 <= temperature <= 2:
        raise ApiError(400, f"temperature must be a number from 0 to 2, got {temperature!r}", "temperature")
    top_p = 1.0 if body.get("top_p") is None else body["top_p"]
    if not _number(top_p) or not 0 < top_p <= 1:
        raise ApiError(400, f"top_p must be above 0 and at most 1, got {top_p!r}", "top_p")
    seed = body.get("seed")
    if seed is not None and not _whole(seed):
        raise ApiError(400, f"seed must be a whole number, got {seed!r}", "seed")
    if body.get("n", 1) not in (1, None):
        raise ApiError(400, f"n must be 1: this server writes one answer per request, got {body['n']!r}", "n")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"stop must be a string or a list of up to {MAX_STOP} non-empty strings", "stop")
    return {"max_new_tokens": max_tokens, "temperature": float(temperature), "top_p": float(top_p), "seed": seed,
            "stop": stop}


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content}", "messages")
    found = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}",
                           f"messages[{i}].role")
        found.append({"role": role, "content": _text(message.get("content"), f"messages[{i}].content")})
    if found[-1]["role"] == "assistant":
        raise ApiError(400, "the last message must be the user's (or the system's): the model answers it",
                       f"messages[{len(found) - 1}].role")
    return found


def completion_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt must be a non-empty string (one prompt per request)", "prompt")
    return prompt


def _text(content, param: str) -> str:
    """A message's content: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"{param} must be text (a string, or a list of {{type: text, text}} parts)", param)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


# --- answering ----------------------------------------------------------------------------
class Answering:
    """The model's side: turns, generation through the chat process, stop strings, counts."""

    def __init__(self, chat, model: str, max_queue: int = MAX_QUEUE):
        self.chat, self.model, self.turns = chat, model, Turns(max_queue)
        self.max_cache_len = chat.info["max_cache_len"]
        self.shapes: list = []
        self.counts = {"requests": 0, "completed": 0, "stopped": 0, "failed": 0}

    def run(self, ticket, request: dict, pieces=None, cancel: threading.Event | None = None) -> dict:
        """In a worker thread: wait for the turn, generate, hand each new piece of the answer to
        `pieces` (a callable) as it comes, return {text, finish_reason, usage}. Raises ApiError.
        With stop strings, the last characters that could begin one are held back until the
        next piece shows whether they do. `cancel` set (the client left): the generation is
        stopped after its current token, or never started."""
        stop_strings = request.pop("stop")
        hold = max((len(s) for s in stop_strings), default=1) - 1
        cut, text, sent, done = None, "", 0, {}
        try:
            self.turns.wait(ticket)
            if cancel is not None and cancel.is_set():
                self.counts["stopped"] += 1
                return {}
            for event in self.chat.generate(**request, whole=True):
                if event["type"] != "token":
                    done = event
                    continue
                if cancel is not None and cancel.is_set() and cut is None:
                    cut = len(text)
                    self.chat.stop_generation()
                if cut is not None:
                    continue  # after a stop string or the client's leaving: what is still coming is dropped
                text += event["text"]
                hit = min((i for i in (text.find(s) for s in stop_strings) if i >= 0), default=None)
                if hit is not None:
                    cut, text = hit, text[:hit]
                    self.chat.stop_generation()
                ready = len(text) if cut is not None else max(sent, len(text) - hold)
                if pieces is not None and ready > sent:
                    pieces(text[sent:ready])
                    sent = ready
            if pieces is not None and len(text) > sent:
                pieces(text[sent:])
        except ChatError as error:
            self.counts["failed"] += 1
            if error.code == "context_length_exceeded":
                raise ApiError(400, str(error), "messages", "context_length_exceeded") from None
            raise ApiError(500, f"the model failed: {error}", kind="server_error") from None
        finally:
            self.turns.leave(ticket)
        self.shapes = done.get("shapes", self.shapes)
        new_tokens = done.get("new_tokens", 0)
        if cancel is not None and cancel.is_set():
            self.counts["stopped"] += 1
            self.counts["stopped_after_tokens"] = new_tokens  # how far the last abandoned answer got
        else:
            self.counts["completed"] += 1
        finish = "stop" if cut is not None or new_tokens < request["max_new_tokens"] else "length"
        prompt_tokens = done.get("prompt_tokens", 0)
        return {"text": text, "finish_reason": finish,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": new_tokens,
                          "total_tokens": prompt_tokens + new_tokens}}


# --- the web app --------------------------------------------------------------------------
def build_api(answering: Answering, api_key: str | None = None):
    """The FastAPI app of the routes above."""
    api = FastAPI(title="trn-studio OpenAI-compatible endpoint", docs_url=None, redoc_url=None)

    @api.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status)

    @api.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key is not None:
            given = request.headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), api_key.encode()):
                what = "no API key was given" if not token else "the API key is not this server's"
                error = ApiError(401, f"{what}: send it as 'Authorization: Bearer KEY' (the openai client's "
                                 "api_key)", code="invalid_api_key")
                return JSONResponse(error.body(), status_code=401)
        return await call_next(request)

    async def body_of(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the request body must be JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model != answering.model:
            raise ApiError(404, f"model {model!r} is not served here; this server serves {answering.model!r} "
                           "(GET /v1/models)", "model", "model_not_found")
        return body

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": answering.model, "object": "model", "created": int(time.time()),
                                            "owned_by": "trn-studio"}]}

    @api.get("/v1/studio/stats")
    async def stats():
        return {**answering.counts, "queued": answering.turns.queued, "shapes": answering.shapes,
                "buckets": buckets_for(answering.max_cache_len, 1), "max_cache_len": answering.max_cache_len}

    async def answer(request: Request, kind: str):
        body = await body_of(request)
        fields = sampling(body, answering.max_cache_len)
        if kind == "chat":
            fields |= {"messages": chat_messages(body)}
        else:
            fields |= {"messages": None, "text": completion_prompt(body)}
        try:
            ticket = answering.turns.enter()
        except Turns.Full:
            raise ApiError(503, f"the server is busy: {answering.turns.limit} requests are waiting; try again "
                           "shortly", code="queue_full", kind="server_error") from None
        answering.counts["requests"] += 1
        made, rid = int(time.time()), f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if not body.get("stream"):
            result = await run_in_threadpool(answering.run, ticket, fields)
            return _whole_response(kind, rid, made, answering.model, result)
        usage_wanted = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_stream(answering, ticket, fields, kind, rid, made, usage_wanted),
                                 media_type="text/event-stream")

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, "chat")

    @api.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, "text")

    return api


def _whole_response(kind: str, rid: str, made: int, model: str, result: dict) -> dict:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": result["text"]},
                  "finish_reason": result["finish_reason"], "logprobs": None}
        return {"id": rid, "object": "chat.completion", "created": made, "model": model, "choices": [choice],
                "usage": result["usage"]}
    choice = {"index": 0, "text": result["text"], "finish_reason": result["finish_reason"], "logprobs": None}
    return {"id": rid, "object": "text_completion", "created": made, "model": model, "choices": [choice],
            "usage": result["usage"]}


def _chunk(kind: str, rid: str, made: int, model: str, text: str | None, finish: str | None,
           first: bool = False) -> dict:
    if kind == "chat":
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {"id": rid, "object": "chat.completion.chunk", "created": made, "model": model, "choices": [choice]}
    choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "text_completion", "created": made, "model": model, "choices": [choice]}


async def _stream(answering: Answering, ticket, fields: dict, kind: str, rid: str, made: int, usage_wanted: bool):
    """Server-sent events: the pieces as the model writes them, the finish reason, [DONE]. If the
    client goes away, the generation is stopped (the turn is given up when it has ended)."""
    loop, pieces = asyncio.get_running_loop(), asyncio.Queue()
    model = answering.model

    def work():
        try:
            result = answering.run(ticket, fields, lambda piece: loop.call_soon_threadsafe(pieces.put_nowait, piece),
                                   cancel)
            loop.call_soon_threadsafe(pieces.put_nowait, result)
        except ApiError as error:
            loop.call_soon_threadsafe(pieces.put_nowait, error)

    def sse(data) -> str:
        return f"data: {json.dumps(data)}\n\n"

    cancel = threading.Event()
    worker = threading.Thread(target=work, name=f"answer-{rid}", daemon=True)
    worker.start()
    finished = False
    try:
        if kind == "chat":
            yield sse(_chunk(kind, rid, made, model, None, None, first=True))
        while True:
            item = await pieces.get()
            if isinstance(item, str):
                yield sse(_chunk(kind, rid, made, model, item, None))
                continue
            finished = True
            if isinstance(item, ApiError):  # the headers are sent: the error goes in the stream
                yield sse(item.body())
            else:
                yield sse(_chunk(kind, rid, made, model, None, item["finish_reason"]))
                if usage_wanted:
                    yield sse({"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                               "created": made, "model": model, "choices": [], "usage": item["usage"]})
            yield "data: [DONE]\n\n"
            return
    finally:
        if not finished:  # the client went away mid-answer: its generation ends, its turn is given up
            cancel.set()


class ApiServer:
    """uvicorn serving build_api() in a thread of this process, until stop()."""

    def __init__(self, chat, model: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                 max_queue: int = MAX_QUEUE):
        import uvicorn

        self.answering = Answering(chat, model, max_queue)
        self.host, self.port = host, port
        config = uvicorn.Config(build_api(self.answering, api_key), host=host, port=port, log_level="warning",
                                access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self, timeout: float = 30) -> ApiServer:
        self.thread = threading.Thread(target=self.server.run, name="openai-api", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"cannot serve on {self.host}:{self.port} (is the port in use?)")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=10)
