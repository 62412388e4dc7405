"""An OpenAI-compatible endpoint over a chat process: the tuned model for the user's own code.

    GET  /v1/models             the one model served (its name: the run id or model given)
    POST /v1/chat/completions   a conversation, rendered by the model's chat template as the chat
                                renders it; streamed as server-sent events with "stream": true
    POST /v1/completions        a plain prompt, no template
    GET  /v1/studio/stats       the studio's own figures: requests, answering, queue, the input shapes so far,
                                the engine (batched and compiled per bucket, eager, or one at a time),
                                the size limits (body bytes, prompt characters)

It answers through a ChatProcess (studio_core/serve/chat.py): the same loading, static KV cache, prompt
buckets and core lease as the Chat tab, so however many requests come, the model sees at most a
prefill shape per bucket plus the one-token decode shape (on Neuron each is a compilation).
Requests are answered in arrival order: with a batched chat process (`launch.py serve`, max_batch
above 1) up to max_batch at once, decoded together at fixed shapes (serve/batching.py: a prefill per
length bucket and a decode per batch and length bucket, compiled at start on a device); else one
at a time. At most
`max_queue` wait beyond those; one more gets 503 at once. A client that disconnects from a stream
ends its generation after the current token (a batched one frees its row at the next step) and
gives up its place.

A request is weighed before it is read whole: a body over `SizeLimits.max_body_bytes` (from the
cache's length and the tokenizer's longest token: studio_core/serve/openai_request.py) is refused
with 413 as soon as its Content-Length says so, or once that much has come. It is checked whole
before it takes its place (`parse`: a strict pydantic model of OpenAI's fields, then their ranges;
`check_size`: a prompt of more characters than the cache's longest prompt can hold is refused as
too long without being tokenized), so no bad field fails once it holds a turn, and a turn is given
back however its answer ends. A prompt that passes is tokenized in the chat process; a batched
one tokenizes a long prompt beside the others' answers (chat_worker.Orders). OpenAI's fields that
this server does not implement (tools, logprobs, penalties, response_format...) are refused unless
they hold their default: never ignored.
`Answering.close` (the server's stop: SIGTERM, Unload) ends every request at once: the one being
answered after its current token, the waiting ones with 503.

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a request the
model cannot take (and what to change), 401 without the right key when one is set, 404 for another
model's name, 413 for a body over the limit, 503 when the queue is full or the server is ending.
The key is compared in constant time and never logged.

Built on FastAPI and uvicorn, which Gradio brings. No torch here: this runs in the app's process.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import threading
import time
import secrets
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from studio_core.serve.chat import BATCH_BUCKETS, ChatError
from studio_core.serve.generation import buckets_for
from studio_core.serve.openai_request import CACHE_SETTING, ApiError, SizeLimits, check_size, parse, too_long

MAX_QUEUE = 32


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down: ask again once it is back", code="server_shutting_down",
                    kind="server_error")


class Turns:
    """Requests take turns at the model in arrival order, `width` at a time (a batched chat
    process answers that many together); at most `limit` wait (Full beyond). Once closed, no one
    enters and every waiter gets Closed."""

    class Full(Exception):
        pass

    class Closed(Exception):
        pass

    def __init__(self, limit: int, width: int = 1):
        self.limit, self.width, self.waiting, self.closed = limit, width, deque(), False
        self.cond = threading.Condition()

    def enter(self) -> object:
        with self.cond:
            if self.closed:
                raise Turns.Closed()
            if len(self.waiting) >= self.limit + self.width:  # the ones answered now are not waiting
                raise Turns.Full()
            ticket = object()
            self.waiting.append(ticket)
            return ticket

    def wait(self, ticket: object) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.closed or ticket in itertools.islice(self.waiting, self.width))
            if self.closed:
                raise Turns.Closed()

    def leave(self, ticket: object) -> None:
        with self.cond:
            self.waiting.remove(ticket)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    @property
    def queued(self) -> int:
        return max(0, len(self.waiting) - self.width)


# --- answering ----------------------------------------------------------------------------
class Answering:
    """The model's side: turns, generation through the chat process, stop strings, counts.
    `setting`: what the user changes to serve a longer cache (for the too-long message)."""

    def __init__(self, chat, model: str, max_queue: int = MAX_QUEUE, setting: str = CACHE_SETTING):
        self.chat, self.model, self.turns, self.setting = chat, model, Turns(max_queue, chat.max_batch), setting
        several = chat.info.get("models") or []  # several runs' adapters on one base: each its run's name
        self.models = several if len(several) > 1 else [model]
        self.max_cache_len = chat.info["max_cache_len"]
        self.vision = bool(chat.info.get("vision"))
        self.limits = SizeLimits(self.max_cache_len, chat.info["longest_token_chars"], chat.info["drops_characters"],
                                 self.vision)
        self.shapes: list = []
        self.counts = {"requests": 0, "completed": 0, "stopped": 0, "failed": 0}
        self.cancels: set[threading.Event] = set()  # one per request in progress, set by close()
        # the threads that answer: one per request answered or waiting (each waits for its turn in one)
        self.threads = ThreadPoolExecutor(max_workers=max_queue + chat.max_batch, thread_name_prefix="answer")

    def enter(self) -> tuple[object, threading.Event]:
        """A turn in the queue and the event that cancels its answer; ApiError 503 if full or closed."""
        try:
            ticket = self.turns.enter()
        except Turns.Closed:
            raise shutting_down() from None
        except Turns.Full:
            raise ApiError(503, f"the server is busy: {self.turns.limit} requests are waiting; try again "
                           "shortly", code="queue_full", kind="server_error") from None
        cancel = threading.Event()
        self.cancels.add(cancel)
        self.counts["requests"] += 1
        return ticket, cancel

    def close(self) -> None:
        """End every request now: the answer being written after its current token, the waiting ones."""
        self.turns.close()
        for cancel in list(self.cancels):
            cancel.set()
        self.threads.shutdown(wait=False)  # each ends as its request does

    def run(self, ticket, request: dict, pieces=None, cancel: threading.Event | None = None) -> dict:
        """In a worker thread: wait for the turn, generate, hand each new piece of the answer to
        `pieces` (a callable, called from the thread that reads the chat process) as it comes,
        return {text, finish_reason, usage}. Raises ApiError.
        The turn is given back however this ends. With stop strings, the last characters that
        could begin one are held back until the next piece shows whether they do. `cancel` set
        (the client left, the server ends): the generation is stopped after its current token,
        or never started."""
        cancel = cancel or threading.Event()
        done = {}
        try:
            answer = Writing(request.pop("stop"), pieces, cancel)
            try:
                self.turns.wait(ticket)
            except Turns.Closed:
                raise shutting_down() from None
            if cancel.is_set():
                self.counts["stopped"] += 1
                raise shutting_down() if self.turns.closed else ApiError(499, "the client left", kind="server_error")
            for event in self.chat.generate(**request, whole=True, halt=answer.halt, on_text=answer.add):
                done = event  # the text went to answer.add as it came: what is left is the end
            answer.finish()
        except ChatError as error:
            self.counts["failed"] += 1
            if error.code == "context_length_exceeded":
                message = too_long(str(error), self.max_cache_len, request["max_new_tokens"], self.setting)
                raise ApiError(400, message, "messages", "context_length_exceeded") from None
            raise ApiError(500, f"the model failed: {error}", kind="server_error") from None
        finally:
            self.turns.leave(ticket)
            self.cancels.discard(cancel)
        self.shapes = done.get("shapes", self.shapes)
        new_tokens = done.get("new_tokens", 0)
        if cancel.is_set():
            self.counts["stopped"] += 1
            self.counts["stopped_after_tokens"] = new_tokens  # how far the last abandoned answer got
            if self.turns.closed:
                raise ApiError(503, f"the server is shutting down: the answer was cut after {new_tokens} tokens; "
                               "ask again once it is back", code="server_shutting_down", kind="server_error")
        else:
            self.counts["completed"] += 1
        finish = "stop" if answer.cut is not None or new_tokens < request["max_new_tokens"] else "length"
        prompt_tokens = done.get("prompt_tokens", 0)
        return {"text": answer.text, "finish_reason": finish,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": new_tokens,
                          "total_tokens": prompt_tokens + new_tokens}}


class Writing:
    """An answer as its text comes, in the thread that reads the chat process (`add`): cut at the
    first stop string (which halts the generation), the last characters that could begin one held
    back until the next piece shows whether they do, each piece ready handed to `pieces`. Once
    `cancel` is set (the client left, the server ends) what still comes is dropped."""

    def __init__(self, stop_strings: list[str], pieces, cancel: threading.Event):
        self.stop_strings, self.pieces, self.cancel = stop_strings, pieces, cancel
        self.hold = max((len(s) for s in stop_strings), default=1) - 1
        self.halt = Either(cancel, threading.Event())  # set: the chat process ends this answer
        self.text, self.cut, self.sent = "", None, 0

    def add(self, piece: str) -> None:
        if self.cancel.is_set() and self.cut is None:
            self.cut = len(self.text)
        if self.cut is not None:
            return  # after a stop string or the client's leaving
        self.text += piece
        hit = min((i for i in (self.text.find(s) for s in self.stop_strings) if i >= 0), default=None)
        if hit is not None:
            self.cut, self.text = hit, self.text[:hit]
            self.halt.events[1].set()
        ready = len(self.text) if self.cut is not None else max(self.sent, len(self.text) - self.hold)
        if self.pieces is not None and ready > self.sent:
            self.pieces(self.text[self.sent:ready])
            self.sent = ready

    def finish(self) -> None:
        """The generation ended: what was held back goes out."""
        if self.pieces is not None and len(self.text) > self.sent and not self.cancel.is_set():
            self.pieces(self.text[self.sent:])


class Either:
    """Set when any of its events is set (what the chat process's generate() looks at)."""

    def __init__(self, *events: threading.Event):
        self.events = events

    def is_set(self) -> bool:
        return any(event.is_set() for event in self.events)


def _answer_in_thread(answering: Answering, ticket, fields: dict, cancel: threading.Event,
                      streamed: bool) -> asyncio.Queue:
    """Start the answer in one of the answering threads, which owns the turn from here on: it gives
    it back however the answer ends. The queue gets the pieces (when `streamed`), then the result
    or an ApiError."""
    loop, items = asyncio.get_running_loop(), asyncio.Queue()

    def put(item) -> None:
        try:
            loop.call_soon_threadsafe(items.put_nowait, item)
        except RuntimeError:  # the server's loop has ended (shutdown): nobody is left to read it
            cancel.set()

    def work() -> None:
        try:
            put(answering.run(ticket, fields, put if streamed else None, cancel))
        except ApiError as error:
            put(error)
        except Exception as error:  # a bug here must still answer the client and free the turn (run did)
            put(ApiError(500, f"the server failed: {type(error).__name__}: {error}", kind="server_error"))

    try:
        answering.threads.submit(work)
    except BaseException as error:  # the server is ending (its threads take no more) or a thread cannot start
        answering.turns.leave(ticket)
        answering.cancels.discard(cancel)
        if isinstance(error, RuntimeError) and answering.turns.closed:
            raise shutting_down() from None
        raise
    return items


class _Stream(StreamingResponse):
    """A streamed answer whose generation is cancelled however the response ends early (the client
    left, even before the first byte; the server stopped)."""

    def __init__(self, content, cancel: threading.Event):
        super().__init__(content, media_type="text/event-stream")
        self.cancel = cancel

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.cancel.set()  # after a whole answer this changes nothing: its run has returned


# --- the web app --------------------------------------------------------------------------
def build_api(answering: Answering, api_key: str | None = None):
    """The FastAPI app of the routes above."""

    async def check_key(request: Request) -> None:
        if api_key is not None:
            given = request.headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), api_key.encode()):
                what = "no API key was given" if not token else "the API key is not this server's"
                raise ApiError(401, f"{what}: send it as 'Authorization: Bearer KEY' (the openai client's "
                               "api_key)", code="invalid_api_key")

    # each answer's id: this server's random part and a count (a fresh random id each took a system call)
    server_id, numbers = secrets.token_hex(8), itertools.count()
    api = FastAPI(title="trn-studio OpenAI-compatible endpoint", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(check_key)])

    @api.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status)

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "trn-studio"} for name in answering.models]}

    @api.get("/v1/studio/stats")
    async def stats():
        turns = answering.turns
        return {**answering.counts, "queued": turns.queued, "answering": len(turns.waiting) - turns.queued,
                "shapes": answering.shapes, "buckets": buckets_for(answering.max_cache_len, 1),
                "batch_buckets": [b for b in BATCH_BUCKETS if b <= answering.chat.max_batch],
                "max_cache_len": answering.max_cache_len, "engine": answering.chat.info.get("engine"),
                "limits": {"max_body_bytes": answering.limits.max_body_bytes,
                           "max_prompt_chars": answering.limits.max_prompt_chars,
                           "longest_token_chars": answering.limits.longest_token_chars}}

    async def answer(request: Request, kind: str):
        try:
            body = json.loads(await _read_body(request, answering.limits, answering.setting))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the request body must be JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        fields, stream, usage_wanted = parse(body, kind, answering.models, answering.max_cache_len,
                                             answering.vision)
        check_size(fields, answering.limits, answering.setting)  # before it queues, and before any tokenizing
        ticket, cancel = answering.enter()
        made, rid = int(time.time()), f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{server_id}{next(numbers):08x}"
        items = _answer_in_thread(answering, ticket, fields, cancel, stream)
        if stream:
            return _Stream(_stream(items, kind, rid, made, fields["model"], usage_wanted), cancel)
        result = await items.get()
        if isinstance(result, ApiError):
            raise result
        return _whole_response(kind, rid, made, fields["model"], result)

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, "chat")

    @api.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, "text")

    return api


async def _read_body(request: Request, limits: SizeLimits, setting: str) -> bytes:
    """The request's body, refused (413) once it is over the limit: at once when its Content-Length
    says so, else as soon as that much has come; nothing more of it is read."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise limits.too_large(setting)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise limits.too_large(setting)
        chunks.append(chunk)
    return b"".join(chunks)


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


async def _stream(items: asyncio.Queue, kind: str, rid: str, made: int, model: str, usage_wanted: bool):
    """Server-sent events: the pieces as the model writes them, the finish reason, [DONE]; an error
    after the headers are sent goes in the stream, in OpenAI's shape."""

    def sse(data) -> str:
        return f"data: {json.dumps(data)}\n\n"

    if kind == "chat":
        yield sse(_chunk(kind, rid, made, model, None, None, first=True))
    while isinstance(item := await items.get(), str):
        yield sse(_chunk(kind, rid, made, model, item, None))
    if isinstance(item, ApiError):
        yield sse(item.body())
    else:
        yield sse(_chunk(kind, rid, made, model, None, item["finish_reason"]))
        if usage_wanted:
            yield sse({"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                       "created": made, "model": model, "choices": [], "usage": item["usage"]})
    yield "data: [DONE]\n\n"


class ApiServer:
    """uvicorn serving build_api() in a thread of this process, until stop()."""

    def __init__(self, chat, model: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                 max_queue: int = MAX_QUEUE, setting: str = CACHE_SETTING):
        import uvicorn

        self.answering = Answering(chat, model, max_queue, setting)
        self.host, self.port = host, port
        # requests are ended by Answering.close first; the grace only covers a client slow to read the last bytes
        config = uvicorn.Config(build_api(self.answering, api_key), host=host, port=port, log_level="warning",
                                access_log=False, lifespan="off", timeout_graceful_shutdown=3)
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
        """End every request (503 to the waiting ones, the one answering cut after its token), then
        the server."""
        self.answering.close()
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=10)
