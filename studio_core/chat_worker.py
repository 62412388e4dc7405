"""The chat process: holds one model (a run's output, or any model) and answers, streaming.

    python -m studio_core.chat_worker      (started by studio_core.chat.ChatProcess)

The first stdin line is its setup (JSON: tuned model folder or id, adapter, base, runs
folder, backend, cores, cache length); it takes its cores through the same leases as
training runs (kind "chat"), loads the model and says `ready` (with the chat template's
arguments it renders prompts with, the ones training rendered answers after, and whether
answers start inside a <think> block). Then each stdin line is
a request: {"op": "generate", "id", "which": "tuned"|"base", "messages", "temperature",
"top_p", "max_new_tokens"}, {"op": "stop"} (ends the running generation) or {"op":
"quit"}. Each stdout line is a JSON event: ready, token {id, text}, done {id, stopped,
prompt_tokens, bucket, new_tokens, dropped_turns, ttft_s, seconds, shapes}, error.

Generation is shaped for Neuron, where every new input shape is a compilation: a static KV
cache of a fixed length, prompts left-padded to a few bucket lengths, inputs kept on CPU, the model on
`device_map="neuron"` in bf16 there. A conversation then reaches the model with at most
one prefill shape per bucket plus the one-token decode shape; the shapes seen so far
are reported with each answer (on Neuron each new one is a compilation). The Neuron
loading path cannot run on this CPU build machine.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback

from studio_core import leases
from studio_core.chat import opens_thinking, template_kwargs
from studio_core.hardware import pin_to_cpu_cores

# Prompt lengths are left-padded up to the first bucket that holds them.
BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)


def emit(kind: str, **fields) -> None:
    print(json.dumps({"type": kind, **fields}), flush=True)


def buckets_for(max_cache_len: int, max_new_tokens: int) -> list[int]:
    """The prompt buckets that leave room for the answer in the cache (at least one)."""
    room = max_cache_len - max_new_tokens
    return [b for b in BUCKETS if b <= room] or [max(1, room)]


class Chat:
    def __init__(self, setup: dict):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.setup, self.backend = setup, setup["backend"]
        self.max_cache_len = setup["max_cache_len"]
        load = {"dtype": torch.bfloat16, "device_map": "neuron"} if self.backend == "neuron" else (
            {"device_map": {"": 0}} if self.backend == "cuda" else {})
        self.load_kwargs = {**load, "trust_remote_code": bool(setup.get("trust_remote_code"))}
        self.tokenizer = AutoTokenizer.from_pretrained(setup["tokenizer"])
        self.model = AutoModelForCausalLM.from_pretrained(setup["model"], **self.load_kwargs)
        if setup.get("adapter"):
            from peft import PeftModel

            self.model = PeftModel.from_pretrained(self.model, setup["adapter"])
        self.model.eval()
        self.template_kwargs = template_kwargs(self.tokenizer)
        self.thinking = opens_thinking(self.tokenizer, self.template_kwargs)
        self.base = None  # a full run's base model, loaded on first use
        self.shapes: set[tuple[int, ...]] = set()
        for module in self._models():
            module.register_forward_pre_hook(self._record_shape, with_kwargs=True)
        self.stop = threading.Event()

    def _models(self):
        return [m for m in (self.model, self.base) if m is not None]

    def _record_shape(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.shapes.add(tuple(ids.shape))

    def model_for(self, which: str):
        """The tuned model, or the base: a LoRA run's adapter switched off, or a full run's base."""
        import contextlib

        if which == "tuned":
            return self.model, contextlib.nullcontext()
        if self.setup.get("adapter"):
            return self.model, self.model.disable_adapter()
        if not self.setup.get("base"):
            raise ValueError("this chat has no base model to compare with (it was started on a model, not a run)")
        if self.base is None:
            from transformers import AutoModelForCausalLM

            self.base = AutoModelForCausalLM.from_pretrained(self.setup["base"], **self.load_kwargs).eval()
            self.base.register_forward_pre_hook(self._record_shape, with_kwargs=True)
        return self.base, contextlib.nullcontext()

    def prompt(self, messages: list[dict], max_new_tokens: int) -> tuple[list[int], int, int]:
        """The prompt's token ids, fitted into the cache: the oldest turns are dropped first
        (the system prompt is kept); returns (ids, bucket, turns dropped)."""
        room = buckets_for(self.max_cache_len, max_new_tokens)[-1]
        system = [m for m in messages[:1] if m["role"] == "system"]
        turns = messages[len(system):]
        dropped = 0
        while True:
            ids = self.tokenizer.apply_chat_template(system + turns, add_generation_prompt=True, tokenize=True,
                                                     **self.template_kwargs)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            if len(ids) <= room or len(turns) <= 1:
                break
            turns, dropped = turns[1:], dropped + 1
            while len(turns) > 1 and turns[0]["role"] != "user":  # a conversation starts with the user
                turns, dropped = turns[1:], dropped + 1
        ids = ids[-room:]  # a single message longer than the cache keeps its end
        bucket = next(b for b in buckets_for(self.max_cache_len, max_new_tokens) if b >= len(ids))
        return ids, bucket, dropped

    def generate(self, request: dict) -> None:
        import torch
        from transformers import StoppingCriteria, TextIteratorStreamer

        stop = self.stop

        class StopOnRequest(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return stop.is_set()

        rid, max_new = request["id"], int(request.get("max_new_tokens") or 128)
        ids, bucket, dropped = self.prompt(request["messages"], max_new)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        input_ids = torch.tensor([[pad] * (bucket - len(ids)) + ids])  # left padding; stays on CPU
        attention_mask = torch.tensor([[0] * (bucket - len(ids)) + [1] * len(ids)])
        if self.backend == "cuda":
            input_ids, attention_mask = input_ids.cuda(), attention_mask.cuda()
        temperature = float(request.get("temperature") or 0)
        sampling = {"do_sample": True, "temperature": temperature, "top_p": float(request.get("top_p") or 1.0)} \
            if temperature > 0 else {"do_sample": False}
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        model, context = self.model_for(request.get("which", "tuned"))
        failure: list[BaseException] = []

        def run():
            try:
                with context, torch.inference_mode():
                    model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new,
                                   cache_implementation="static", max_cache_len=self.max_cache_len,
                                   pad_token_id=pad, streamer=streamer, stopping_criteria=[StopOnRequest()],
                                   **sampling)
            except BaseException as error:  # reported below, after the streamer is released
                failure.append(error)
                streamer.end()

        stop.clear()
        start, first, pieces = time.time(), None, []
        worker = threading.Thread(target=run, name=f"generate-{rid}", daemon=True)
        worker.start()
        for piece in streamer:
            if piece:
                first = first or time.time()
                pieces.append(piece)
                emit("token", id=rid, text=piece)
        worker.join()
        if failure:
            raise failure[0]
        new_tokens = len(self.tokenizer("".join(pieces), add_special_tokens=False)["input_ids"])
        emit("done", id=rid, stopped=stop.is_set(), prompt_tokens=len(ids), bucket=bucket,
             new_tokens=new_tokens, dropped_turns=dropped, ttft_s=round((first or time.time()) - start, 4),
             seconds=round(time.time() - start, 4), text="".join(pieces),
             shapes=sorted(list(s) for s in self.shapes))


def main() -> int:
    setup = json.loads(sys.stdin.readline())
    try:
        lease = leases.acquire(setup["runs_dir"], setup["backend"], setup["cores"],
                               holder=setup["label"], kind="chat")
    except leases.CoresBusy as error:
        emit("error", message=str(error))
        return 2
    with lease:
        if setup["backend"] == "cpu":
            pin_to_cpu_cores(setup["cores"])
            import torch

            torch.set_num_threads(len(setup["cores"]))
        try:
            chat = Chat(setup)
        except Exception as error:
            emit("error", message=f"cannot load {setup['label']}: {type(error).__name__}: {error}")
            return 1
        emit("ready", label=setup["label"], cores=setup["cores"], backend=setup["backend"],
             max_cache_len=chat.max_cache_len, has_base=bool(setup.get("adapter") or setup.get("base")),
             template_kwargs=chat.template_kwargs, thinking=chat.thinking)
        requests: list[dict] = []
        ready = threading.Condition()

        def serve():
            while True:
                with ready:
                    ready.wait_for(lambda: requests)
                    request = requests.pop(0)
                if request["op"] == "quit":
                    return
                try:
                    chat.generate(request)
                except Exception as error:
                    emit("error", id=request.get("id"), message=f"{type(error).__name__}: {error}",
                         traceback=traceback.format_exc()[-2000:])

        server = threading.Thread(target=serve, name="serve", daemon=True)
        server.start()
        for line in sys.stdin:  # the parent's requests; EOF (the parent is gone) ends the chat
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
