"""The chat process: holds one model (a run's output, or any model) and answers, streaming.

    python -m studio_core.serve.chat_worker      (started by studio_core.serve.chat.ChatProcess)

The first stdin line is its setup (JSON: the target, as studio_core.serve.chat.ChatTarget, the runs
folder, backend, cores, cache length); it takes its cores through the same leases as training
runs (kind "chat"), loads the model (studio_core.serve.generation, which says how generation is
shaped for Neuron) and says `ready` (with the chat template's arguments it renders prompts
with, the ones training rendered answers after, and whether answers start inside a <think>
block, the static KV cache's size in MiB, and what its tokenizer says of a prompt's length in
characters: `longest_token_chars`, `drops_characters`, see `tokenizer_reach`). Then each stdin
line is a request: {"op": "generate", "id", "which": "tuned"|"base", "messages" (or "text": a
plain prompt, no chat template), "temperature", "top_p", "max_new_tokens", "seed", "model"
(which of several runs' adapters answers), "whole" (a prompt that does not fit is an error with
code context_length_exceeded, not cut)}, {"op": "stop"} (ends the running generation) or {"op":
"quit"}. Each stdout line is a JSON event: ready, token {id, text}, done
{id, stopped, prompt_tokens, bucket, new_tokens, dropped_turns, ttft_s, seconds, text, shapes},
error.

With `max_batch` above 1 in its setup (`launch.py serve`), requests are answered together in
batches (serve/batching.py: continuous batching at fixed shapes), by the tuned model only, and
{"op": "cancel", "id"} ends one request; a long prompt is rendered and tokenized while the next
requests are read and the others' steps go on (`Orders`). Each step's new text comes as one
event, tokens {pieces: {id: text}}, then the done events of the requests that ended in it. Where
the engine compiles (a device, or `compile` in the setup), each graph compiled before `ready` is
said by a `warmup` event {done, total}; `ready` then says the engine ({mode, says, graphs,
warmup_s}) and the batch it takes (`max_batch`: 1 when the model is served one request at a time after all,
its adapters being of a kind the engine cannot gather per row, or a graph failing to compile).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback

from studio_core.machine import leases
from studio_core.machine.children import collection_off, set_up, skip_final_collection
from studio_core.serve.batching import BATCH_BUCKETS, BatchEngine, EnginePlan, Request, engine_plan
from studio_core.serve.images import text_of
from studio_core.serve.row_adapters import install, unsupported
from studio_core.serve.slots import cache_mib
from studio_core.serve.generation import Generator, NoRoom, TooLong, on_leased_cores


EMITTING = threading.Lock()  # a batched server's events come from several threads: a line each, whole
# A batched server's prompt of up to this many characters is tokenized as its order is read (a few
# ms); a longer one in a thread of its own, so that the requests after it need not wait for it.
INLINE_PROMPT_CHARS = 4096
# Runs of what a tokenizer might drop or fold into one token: whitespace, control and invisible
# characters, a combining mark, characters beyond a vocabulary (see tokenizer_reach).
FRAGILE = (" ", "\n", "\t", "\r", "\x00", "\x07", "\u00a0", "\u200b", "\ufeff", "\u0301", "\U0001f999", "\U000e0041",
           "a")


def emit(kind: str, **fields) -> None:
    with EMITTING:
        sys.stdout.write(json.dumps({"type": kind, **fields}) + "\n")
        sys.stdout.flush()


def serve(chat: Generator) -> None:
    """Answer the requests on stdin, one at a time, until quit or EOF (the parent is gone)."""
    requests: list[dict] = []
    ready = threading.Condition()

    def answer():
        while True:
            with ready:
                ready.wait_for(lambda: requests)
                request = requests.pop(0)
            if request["op"] == "quit":
                return
            rid = request.get("id")
            try:
                chat.stop.clear()
                done = chat.generate(request.get("messages"), which=request.get("which", "tuned"),
                                     temperature=float(request.get("temperature") or 0),
                                     top_p=float(request.get("top_p") or 1.0),
                                     max_new_tokens=int(request.get("max_new_tokens") or 128),
                                     on_text=lambda piece: emit("token", id=rid, text=piece),
                                     text=request.get("text"), whole=bool(request.get("whole")),
                                     seed=request.get("seed"), adapter=chat.adapter_names.get(request.get("model")))
                emit("done", id=rid, **done, shapes=sorted(list(s) for s in chat.shapes))
            except (TooLong, NoRoom) as error:
                emit("error", id=rid, message=str(error), code="context_length_exceeded")
            except Exception as error:
                emit("error", id=rid, message=f"{type(error).__name__}: {error}",
                     traceback=traceback.format_exc()[-2000:])

    server = threading.Thread(target=answer, name="serve", daemon=True)
    server.start()
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "stop":
            chat.stop.set()
            continue
        with ready:
            requests.append(request)
            ready.notify()
        if request["op"] == "quit":
            break
    chat.stop.set()
    with ready:
        requests.append({"op": "quit"})
        ready.notify()
    server.join(timeout=30)


def tokenizer_reach(tokenizer) -> dict:
    """What a prompt's length in characters says of its tokens, for the server to refuse a prompt
    that cannot fit before it is tokenized (openai_request.SizeLimits).

    `longest_token_chars`: the longest entry of the vocabulary, its special tokens included. No
    token covers more characters of a text than its entry has: a byte-level entry has a character
    per byte of the text, a SentencePiece one a character per character (U+2581 for a space), a
    byte-fallback or WordPiece one more ("<0xE2>", "##ing"); a normalizer that expands a character
    (U+FB01 to "fi") only adds tokens. So a text of n characters takes at least n / longest tokens,
    unless the tokenizer drops characters or folds several into one token (a WordPiece one drops
    spaces, a fused unknown token takes a whole run).
    `drops_characters`: a run of one of FRAGILE's characters takes fewer tokens than that, so the
    characters of a prompt bound nothing (the server then checks its tokens only)."""
    longest = max(len(token) for token in tokenizer.get_vocab())
    run = 4 * longest
    short = [c for c in FRAGILE if len(tokenizer(c * run, add_special_tokens=False)["input_ids"]) * longest < run]
    return {"longest_token_chars": longest, "drops_characters": bool(short)}


def start_engine(chat: Generator, plan: EnginePlan, max_batch: int, out: StepOutput):
    """The batched engine, warmed up when compiled (a `warmup` event per graph, with the count):
    (engine, plan, {"warmup_s"}); when a graph cannot be compiled, (None, a "single" plan saying
    why, {}): the model answers one request at a time, through transformers' generate, never op
    by op on Neuron."""
    engine, undo = batched_engine(chat, plan, max_batch, out)
    if plan.mode != "compiled":
        return engine, plan, {}
    try:
        warmup = engine.warm_up(lambda done, total: emit("warmup", done=done, total=total))
    except Exception as error:  # a graph the compiler refused: served the compiled single-request way
        undo()
        why = f"compiling the batched graphs failed ({type(error).__name__}: {str(error)[:300]})"
        return None, EnginePlan("single", None, why=why), {}
    return engine, plan, {"warmup_s": warmup["seconds"]}


def batched_engine(chat: Generator, plan: EnginePlan, max_batch: int, out: StepOutput):
    """The batched engine over the chat's model: its LoRA adapters gathered per row (the run's own
    adapter alone, or several runs'), compiled by the plan's compiler when it has one."""
    names = chat.peft_adapters
    model, rows, undo = install(chat.model, names) if names else (chat.model, None, lambda: None)
    chat.stop_counting()  # the engine counts its own shapes; a hook would be traced into its graphs
    engine = BatchEngine(model, chat.pad, eos_ids(chat), chat.max_cache_len,
                         batch_buckets=tuple(b for b in BATCH_BUCKETS if b <= max_batch), compiler=plan.compiler,
                         rows=rows, names=names, after_step=out.flush)
    return engine, undo


def serve_batched(chat: Generator, engine: BatchEngine, out: StepOutput) -> None:
    """Answer the requests on stdin together, in batches (serve/batching.py), until quit or EOF;
    {"op": "cancel", "id"} ends one (its row is free at the next step), a {"op": "stop"} every
    one. The tuned model only (no side-by-side base here)."""
    orders = Orders(chat, engine, out)
    stepping = threading.Thread(target=engine.run, name="batch", daemon=True)
    stepping.start()
    for line in sys.stdin:
        order = json.loads(line)
        if order["op"] == "quit":
            break
        if order["op"] == "stop":
            orders.cancel_all()
        elif order["op"] == "cancel":
            orders.cancel(order.get("id"))
        elif order["op"] == "generate":
            orders.take(order)
    engine.close()
    stepping.join(timeout=30)


class Orders:
    """The generate orders between stdin and the engine. A prompt of up to INLINE_PROMPT_CHARS
    characters is rendered and tokenized as its order is read, so requests join in arrival order; a
    longer one in a thread of its own, joining once ready, while the orders after it are read and
    the engine steps (the tokenizer lets go of the GIL while it works): one long prompt never holds
    up the others' answers. A cancel that comes while its prompt is tokenized ends it once ready."""

    def __init__(self, chat: Generator, engine: BatchEngine, out: StepOutput):
        self.chat, self.engine, self.out = chat, engine, out
        self.requests: dict[int, Request] = {}  # submitted (or about to be), until they end
        self.preparing: dict[int, bool] = {}  # tokenized aside now: whether cancelled meanwhile
        self.lock = threading.Lock()

    def take(self, order: dict) -> None:
        if prompt_chars(order) <= INLINE_PROMPT_CHARS:
            self.admit(order)
            return
        with self.lock:
            self.preparing[order.get("id")] = False
        threading.Thread(target=self.admit, args=(order,), name="prepare", daemon=True).start()

    def admit(self, order: dict) -> None:
        """Tokenize the order's prompt and hand its request to the engine (an error event if it
        cannot be answered)."""
        rid = order.get("id")
        request = batched_request(self.chat, self.engine, order, self.requests, self.out)
        with self.lock:
            cancelled = self.preparing.pop(rid, False)
        if request is None:
            return
        try:
            self.engine.submit(request)
        except ValueError as error:
            self.requests.pop(rid, None)
            emit("error", id=rid, message=str(error), code="context_length_exceeded")
            return
        if cancelled:
            self.engine.cancel(request)  # its end (done, stopped) comes at the next step boundary

    def cancel(self, rid) -> None:
        with self.lock:
            if rid in self.preparing:
                self.preparing[rid] = True
            elif (request := self.requests.get(rid)) is not None:  # else it has ended
                self.engine.cancel(request)

    def cancel_all(self) -> None:
        with self.lock:
            self.preparing = dict.fromkeys(self.preparing, True)
            for request in list(self.requests.values()):
                self.engine.cancel(request)


def prompt_chars(order: dict) -> int:
    """An order's prompt's length in characters: its plain text's, or its messages' together."""
    if order.get("text") is not None:
        return len(order["text"])
    return sum(len(text_of(m.get("content"))) for m in order.get("messages") or [])


class StepOutput:
    """A step's output, said at its end in one `tokens` event ({"pieces": {id: text}}: each
    request's new text) and then its requests' ends: one write a step, not one a token."""

    def __init__(self):
        self.pieces: dict[int, str] = {}
        self.ends: list[tuple[str, dict]] = []

    def flush(self) -> None:
        if self.pieces:
            emit("tokens", pieces=self.pieces)
        for kind, fields in self.ends:
            emit(kind, **fields)
        self.pieces, self.ends = {}, []


def batched_request(chat: Generator, engine: BatchEngine, order: dict, requests: dict,
                    out: StepOutput) -> Request | None:
    """The engine's request for a generate order, its tokens streamed as text (a step's `tokens`
    event) and its end said (done) after them; None, with an error event, when it cannot be
    answered."""
    rid = order.get("id")
    try:
        if order.get("which", "tuned") != "tuned":
            raise ValueError("a batched server answers with the tuned model only")
        adapter = chat.adapter_names.get(order.get("model"), next(iter(engine.adapters), None))
        max_new = int(order.get("max_new_tokens") or 128)
        ids, _, dropped, _ = chat.fitted(order.get("messages"), order.get("text"), max_new, bool(order.get("whole")))
    except TooLong as error:
        emit("error", id=rid, message=str(error), code="context_length_exceeded")
        return None
    except (ValueError, TypeError) as error:
        emit("error", id=rid, message=str(error))
        return None
    began, said = time.time(), {"text": "", "first": None}

    def on_token(token: int) -> None:
        text = chat.tokenizer.decode(request.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a character cut between tokens: said with the next one
            return
        said["first"] = said["first"] or time.time()
        if len(text) > len(said["text"]):
            out.pieces[rid] = out.pieces.get(rid, "") + text[len(said["text"]):]
        said["text"] = text

    def on_done(reason: str) -> None:
        requests.pop(rid, None)
        if reason.startswith("error"):
            out.ends.append(("error", {"id": rid, "message": f"the model failed: {reason.removeprefix('error: ')}"}))
            return
        text = chat.tokenizer.decode(request.tokens, skip_special_tokens=True)
        if len(text) > len(said["text"]):
            out.pieces[rid] = out.pieces.get(rid, "") + text[len(said["text"]):]
        out.ends.append(("done", {
            "id": rid, "text": text, "prompt_tokens": len(ids), "bucket": request.bucket, "dropped_turns": dropped,
            "new_tokens": len(request.tokens), "finish": reason, "stopped": reason == "cancelled",
            "ttft_s": round((said["first"] or time.time()) - began, 4), "seconds": round(time.time() - began, 4),
            "shapes": sorted(list(s) for s in engine.shapes)}))

    request = Request(ids, max_new, temperature=float(order.get("temperature") or 0),
                      top_p=float(order.get("top_p") or 1.0), seed=order.get("seed"), on_token=on_token,
                      on_done=on_done, adapter=adapter)
    requests[rid] = request
    return request


def eos_ids(chat: Generator) -> set[int]:
    """The tokens that end an answer: the generation config's, and the tokenizer's."""
    eos = chat.model.generation_config.eos_token_id
    found = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return found | ({chat.tokenizer.eos_token_id} if chat.tokenizer.eos_token_id is not None else set())


def main() -> int:
    setup = json.loads(sys.stdin.readline())
    target = setup["target"]
    try:
        with on_leased_cores(setup):
            try:
                chat = Generator(target, setup["backend"], setup["max_cache_len"], adapters=setup.get("adapters"))
            except Exception as error:
                emit("error", message=f"cannot load {target['label']}: {type(error).__name__}: {error}")
                return 1
            set_up()  # imported and loaded: the collector on again (children.py)
            max_batch = setup.get("max_batch", 1)
            plan = engine_plan(setup["backend"], max_batch, chat.max_cache_len, bool(setup.get("compile")),
                               unsupported(chat.model, chat.peft_adapters) if chat.peft_adapters else None)
            if chat.vision and plan.mode != "single":
                plan = EnginePlan("single", None, why="a vision-language model, whose images the batched engine "
                                                      "does not take yet")
            engine, out, warmup = None, StepOutput(), {}
            if plan.mode != "single":
                engine, plan, warmup = start_engine(chat, plan, max_batch, out)
            rows = engine.rows if engine else 1
            emit("ready", label=target["label"], cores=setup["cores"], backend=setup["backend"],
                 max_cache_len=chat.max_cache_len, has_base=chat.has_base, template_kwargs=chat.template_kwargs,
                 thinking=chat.thinking, vision=chat.vision, models=list(chat.adapter_names) or [target["label"]],
                 **tokenizer_reach(chat.tokenizer),
                 cache_mib=round(cache_mib(chat.model, rows, chat.max_cache_len), 1), max_batch=rows,
                 engine={"mode": plan.mode, "says": plan.describe(), "graphs": plan.graphs, **warmup})
            if engine is not None:
                serve_batched(chat, engine, out)
            else:
                serve(chat)
    except leases.CoresBusy as error:
        emit("error", message=str(error))
        return 2
    return 0


if __name__ == "__main__":
    skip_final_collection()
    collection_off()
    sys.exit(main())
