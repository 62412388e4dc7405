"""The chat process: holds one model (a run's output, or any model) and answers, streaming.

    python -m studio_core.serve.chat_worker      (started by studio_core.serve.chat.ChatProcess)

The first stdin line is its setup (JSON: the target, as studio_core.serve.chat.ChatTarget, the runs
folder, backend, cores, cache length); it takes its cores through the same leases as training
runs (kind "chat"), loads the model (studio_core.serve.generation, which says how generation is
shaped for Neuron) and says `ready` (with the chat template's arguments it renders prompts
with, the ones training rendered answers after, and whether answers start inside a <think>
block). Then each stdin line is a request: {"op": "generate", "id", "which": "tuned"|"base",
"messages" (or "text": a plain prompt, no chat template), "temperature", "top_p", "max_new_tokens",
"seed", "whole" (a prompt that does not fit is an error with code context_length_exceeded, not
cut)}, {"op": "stop"} (ends the running generation) or {"op": "quit"}. Each stdout line is a JSON event: ready, token {id, text}, done
{id, stopped, prompt_tokens, bucket, new_tokens, dropped_turns, ttft_s, seconds, text, shapes},
error.
"""

from __future__ import annotations

import json
import sys
import threading
import traceback

from studio_core.machine import leases
from studio_core.serve.generation import Generator, TooLong, on_leased_cores


def emit(kind: str, **fields) -> None:
    print(json.dumps({"type": kind, **fields}), flush=True)


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
                                     seed=request.get("seed"))
                emit("done", id=rid, **done, shapes=sorted(list(s) for s in chat.shapes))
            except TooLong as error:
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


def main() -> int:
    setup = json.loads(sys.stdin.readline())
    target = setup["target"]
    try:
        with on_leased_cores(setup):
            try:
                chat = Generator(target, setup["backend"], setup["max_cache_len"])
            except Exception as error:
                emit("error", message=f"cannot load {target['label']}: {type(error).__name__}: {error}")
                return 1
            emit("ready", label=target["label"], cores=setup["cores"], backend=setup["backend"],
                 max_cache_len=chat.max_cache_len, has_base=chat.has_base, template_kwargs=chat.template_kwargs,
                 thinking=chat.thinking)
            serve(chat)
    except leases.CoresBusy as error:
        emit("error", message=str(error))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
