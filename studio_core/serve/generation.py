"""One model (a run's output, or any model) loaded to answer and to score answers: what the
chat process and the evaluation process both hold. Imports torch when used: child processes only.

Generation is shaped for Neuron, where every new input shape is a compilation: a static KV
cache of a fixed length, prompts left-padded to a few bucket lengths, the model on
`device_map="neuron"` in bf16 there. Inputs are placed by studio_core.machine.placement's one rule
(generate's stay on CPU on Neuron, a forward's go to the model's device). A conversation then
reaches the model with at most one prefill shape per bucket plus the one-token decode shape.
Scoring an answer (its tokens' loss given the prompt) pads prompt + answer to a bucket the same
way and takes every position's loss on the device, so it adds at most one shape per bucket
whatever the answer's length. The shapes seen so far are kept in `shapes` (on Neuron each new
one is a compilation), counted on the Transformers model itself, under a LoRA run's PEFT
wrapper: PeftModel.generate calls the inner model's generate, which never goes through the
wrapper's own forward (a hook there saw only the scoring passes). The Neuron loading path
cannot run on this CPU build machine.

A prompt's length in tokens (`render`) needs only the tokenizer (`load_tokenizer`), so an
evaluation measures its prompts against the largest bucket before it loads the model.

A vision-language model (target["vision"]) is loaded with AutoModelForImageTextToText and its
processor, as its run trained it. A message's image parts (serve/images.py) become TRL's
placeholders; the processor renders the text with the chat template, puts the image's tokens in
(a fixed count per image for a model whose processor resizes to one resolution, as the built-in
LLaVA's does, or for any model once the run's studio.image_size resized each image first, as its
training did: data/image_size.py) and makes `pixel_values`, one tensor shape per count of images:
the prompt is bucketed as a text prompt is, and the images' shape is the only other input shape.
"""

from __future__ import annotations

import contextlib
import threading
import time

from studio_core.machine import leases
from studio_core.serve.batching import SMALLEST_LENGTH
from studio_core.serve.chat import opens_thinking, template_kwargs
from studio_core.data.image_size import resize
from studio_core.serve.images import has_images, take_images
from studio_core.machine.hardware import pin_to_cpu_cores
from studio_core.machine.placement import on_model_device

# Prompt lengths are left-padded up to the first bucket that holds them: 64, 128, ... 8192, the
# batched engine's length buckets too.
BUCKETS = tuple(SMALLEST_LENGTH << k for k in range(8))


class NoRoom(ValueError):
    """An answer so long that no prompt bucket is left beside it in the cache."""

    def __init__(self, max_cache_len: int, max_new_tokens: int):
        super().__init__(f"{max_new_tokens} new tokens leave no room for a prompt in the model's {max_cache_len}-token "
                         f"cache (its smallest prompt bucket is {BUCKETS[0]} tokens): ask for at most "
                         f"{max_cache_len - BUCKETS[0]} new tokens")


def buckets_for(max_cache_len: int, max_new_tokens: int) -> list[int]:
    """The prompt buckets that leave room for the answer in the cache; NoRoom when none does
    (a bucket cut to the room left would be a new shape, a compilation on Neuron, for every
    such max_new_tokens)."""
    fitting = [b for b in BUCKETS if b <= max_cache_len - max_new_tokens]
    if not fitting:
        raise NoRoom(max_cache_len, max_new_tokens)
    return fitting


def cache_for(prompt_tokens: int, max_new_tokens: int) -> int | None:
    """The shortest static cache that holds a prompt of this length whole (its bucket) with the
    answer; None when it is longer than the largest bucket there is."""
    bucket = next((b for b in BUCKETS if b >= prompt_tokens), None)
    return None if bucket is None else bucket + max_new_tokens


def load_tokenizer(target: dict):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target["tokenizer"])


def load_processor(target: dict):
    """A vision-language target's processor (its tokenizer and image processor)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(target["tokenizer"], trust_remote_code=bool(target.get("trust_remote_code")))


def encode_vision(processor, kwargs: dict, messages: list[dict], answer: str | None = None,
                  image_size: int | None = None) -> tuple[list[int], dict]:
    """A vision-language conversation as TRL's vision collator makes it in training: the image parts
    as placeholders, the text rendered by the processor's chat template (up to the answer's start;
    with `answer`, to its end), then the processor puts each image's tokens in (no special tokens
    added: the template writes them) and makes their `pixel_values`; each image first resized to
    the run's `image_size` (studio.image_size), as its training resized them. (token ids, the other inputs)."""
    placed, images = take_images(messages)
    images = [resize(image, image_size) for image in images] if image_size else images
    turns = placed + ([{"role": "assistant", "content": answer}] if answer is not None else [])
    text = processor.apply_chat_template(turns, add_generation_prompt=answer is None, tokenize=False, **kwargs)
    inputs = processor(text=[text], images=images or None, add_special_tokens=False, return_tensors="pt")
    extras = {key: value for key, value in inputs.items() if key not in ("input_ids", "attention_mask")}
    return inputs["input_ids"][0].tolist(), extras


def render(tokenizer, kwargs: dict, messages: list[dict], answer: str | None = None) -> list[int]:
    """The token ids of a conversation up to the answer's start (with `answer`: to its end),
    rendered with the chat template's arguments `kwargs` (template_kwargs: as training rendered it)."""
    turns = messages + ([{"role": "assistant", "content": answer}] if answer is not None else [])
    ids = tokenizer.apply_chat_template(turns, add_generation_prompt=answer is None, tokenize=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@contextlib.contextmanager
def on_leased_cores(setup: dict):
    """Hold the setup's cores (leases.CoresBusy if another holds one) for the block, this process
    on them (on the CPU backend: pinned, one torch thread per core)."""
    with leases.acquire(setup["runs_dir"], setup["backend"], setup["cores"], holder=setup["target"]["label"],
                        kind=setup["kind"]):
        if setup["backend"] == "cpu":
            import torch

            pin_to_cpu_cores(setup["cores"])
            torch.set_num_threads(len(setup["cores"]))
        yield


class TooLong(ValueError):
    """A prompt that does not fit the static cache with room for the answer."""

    def __init__(self, tokens: int, room: int):
        super().__init__(f"the prompt is {tokens} tokens; with the answer's max tokens, at most {room} fit the "
                         "model's cache: shorten it or ask for fewer tokens")
        self.tokens, self.room = tokens, room


class Generator:
    """`target`: a ChatTarget's fields (model, tokenizer, adapter: a LoRA run's, base: a full
    run's base model, trust_remote_code); `backend`; `max_cache_len`: the static cache's length;
    `tokenizer`: the target's, when the caller has it loaded already; `adapters`: {model name: LoRA
    folder} of several runs on the target's base, served together (the target's own adapter among
    them). A vision-language target (target["vision"]) loads its processor too, whose tokenizer
    is `tokenizer`."""

    def __init__(self, target: dict, backend: str, max_cache_len: int, tokenizer=None,
                 adapters: dict[str, str] | None = None):
        import torch

        self.setup, self.backend, self.max_cache_len = target, backend, max_cache_len
        load = {"dtype": torch.bfloat16, "device_map": "neuron"} if self.backend == "neuron" else (
            {"device_map": {"": 0}} if self.backend == "cuda" else {})
        self.load_kwargs = {**load, "trust_remote_code": bool(target.get("trust_remote_code"))}
        self.vision = bool(target.get("vision"))
        self.processor = None
        if self.vision:
            self.processor = load_processor(target)
            tokenizer = self.processor.tokenizer
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(target)
        self.model = self.model_class().from_pretrained(target["model"], **self.load_kwargs)
        # several LoRA runs on this base (a server's): each loaded under a name of its own, adapter0, ...
        self.adapter_names = {label: f"adapter{n}" for n, label in enumerate(adapters or {})}
        if adapters:
            from peft import PeftModel

            (first, path), *rest = adapters.items()
            self.model = PeftModel.from_pretrained(self.model, path, adapter_name=self.adapter_names[first])
            for label, path in rest:
                self.model.load_adapter(path, adapter_name=self.adapter_names[label])
        elif target.get("adapter"):
            from peft import PeftModel

            self.model = PeftModel.from_pretrained(self.model, target["adapter"])
        self.model.eval()
        self.template_kwargs = template_kwargs(self.tokenizer)
        self.thinking = opens_thinking(self.tokenizer, self.template_kwargs)
        self.base = None  # a full run's base model, loaded on first use
        self.shapes: set[tuple[int, ...]] = set()
        self.counting = []  # the hooks that count them (a compiled engine takes them off: see stop_counting)
        self._count_shapes(self.model)
        self.stop = threading.Event()
        tokenizer = self.tokenizer
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def model_class(self):
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        return AutoModelForImageTextToText if self.vision else AutoModelForCausalLM

    @property
    def peft_adapters(self) -> list[str]:
        """The PEFT adapter names the model holds: several runs' (adapter0, ...), a LoRA run's own
        ("default", PEFT's name for it), or none."""
        return list(self.adapter_names.values()) or (["default"] if self.setup.get("adapter") else [])

    @property
    def has_base(self) -> bool:
        return bool(self.setup.get("adapter") or self.setup.get("base"))

    def _count_shapes(self, model) -> None:
        """Count the input shapes that reach `model`: on the Transformers model, which both
        generate() and a forward call reach, also under a PEFT wrapper (see the module's doc)."""
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.counting.append(inner.register_forward_pre_hook(self._record_shape, with_kwargs=True))

    def stop_counting(self) -> None:
        """Take the shape-counting hooks off (a hook is traced into a compiled graph, and its set
        of shapes would make every new shape a guard: the batched engine counts its own)."""
        for hook in self.counting:
            hook.remove()
        self.counting = []

    def _record_shape(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.shapes.add(tuple(ids.shape))

    def model_for(self, which: str):
        """The tuned model, or the base: a LoRA run's adapter switched off, or a full run's base."""
        if which == "tuned":
            return self.model, contextlib.nullcontext()
        if self.setup.get("adapter"):
            return self.model, self.model.disable_adapter()
        if not self.setup.get("base"):
            raise ValueError("this model has no base model to compare with (it was loaded as a model, not a run)")
        if self.base is None:
            self.base = self.model_class().from_pretrained(self.setup["base"], **self.load_kwargs).eval()
            self._count_shapes(self.base)
        return self.base, contextlib.nullcontext()

    def render(self, messages: list[dict], answer: str | None = None) -> list[int]:
        """The token ids of a conversation up to the answer's start (with `answer`: to its end),
        rendered as training rendered it (template_kwargs)."""
        return render(self.tokenizer, self.template_kwargs, messages, answer)

    def encode(self, messages: list[dict], answer: str | None = None) -> tuple[list[int], dict]:
        """A conversation's token ids up to the answer's start (with `answer`: to its end), and the
        model's other inputs for it ({"pixel_values"} for a vision-language model's images; {}
        otherwise)."""
        if not self.vision:
            if has_images(messages):
                raise ValueError(f"{self.setup['label']} is a text model: it takes no images; send text alone, "
                                 "or chat with a vision-language model's run")
            return self.render(messages, answer), {}
        return encode_vision(self.processor, self.template_kwargs, messages, answer, self.setup.get("image_size"))

    def prompt(self, messages: list[dict], max_new_tokens: int) -> tuple[list[int], int, int, dict]:
        """The prompt's token ids, fitted into the cache: the oldest turns are dropped first
        (the system prompt is kept); returns (ids, bucket, turns dropped, the other inputs). A
        vision-language prompt is never cut inside: its image's tokens must stay whole."""
        room = buckets_for(self.max_cache_len, max_new_tokens)[-1]
        system = [m for m in messages[:1] if m["role"] == "system"]
        turns = messages[len(system):]
        dropped = 0
        while True:
            ids, extras = self.encode(system + turns)
            if len(ids) <= room or len(turns) <= 1:
                break
            turns, dropped = turns[1:], dropped + 1
            while len(turns) > 1 and turns[0]["role"] != "user":  # a conversation starts with the user
                turns, dropped = turns[1:], dropped + 1
        if len(ids) > room and self.vision:
            raise TooLong(len(ids), room)
        ids = ids[-room:]  # a single message longer than the cache keeps its end
        bucket = next(b for b in buckets_for(self.max_cache_len, max_new_tokens) if b >= len(ids))
        return ids, bucket, dropped, extras

    def _padded(self, ids: list[int], length: int, model, generate: bool, extras: dict | None = None) -> dict:
        """input_ids and attention_mask, left-padded to `length`, and `extras` (a vision-language
        prompt's pixel_values, in the model's dtype), placed for `model`'s forward or its
        generate() (placement.on_model_device: on Neuron, generate's stay on CPU)."""
        import torch

        input_ids = torch.tensor([[self.pad] * (length - len(ids)) + ids])
        attention_mask = torch.tensor([[0] * (length - len(ids)) + [1] * len(ids)])
        extras = {key: value.to(model.dtype) if key == "pixel_values" else value for key, value in (extras or {}).items()}
        # the images' tensors go where a forward's inputs go, for generate() too: one fixed shape, read
        # by the vision tower in the first forward, never grown by the loop as the ids are
        return {**on_model_device(model, generate=generate, input_ids=input_ids, attention_mask=attention_mask),
                **on_model_device(model, **extras)}

    def fitted(self, messages: list[dict] | None, text: str | None, max_new_tokens: int,
               whole: bool) -> tuple[list[int], int, int, dict]:
        """(prompt ids, bucket, turns dropped, other inputs: see encode) of a conversation, or of a
        plain `text` prompt (no chat template). `whole`: a prompt that does not fit the cache is a
        TooLong, not cut."""
        if text is None and not whole:
            return self.prompt(messages, max_new_tokens)
        extras = {}
        if text is None:  # whole: rendered once, never cut
            ids, extras = self.encode(messages)
        else:
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) or [self.pad]
        room = buckets_for(self.max_cache_len, max_new_tokens)[-1]
        if len(ids) > room:
            if whole or extras:
                raise TooLong(len(ids), room)
            ids = ids[-room:]
        return ids, next(b for b in buckets_for(self.max_cache_len, max_new_tokens) if b >= len(ids)), 0, extras

    def generate(self, messages: list[dict] | None, which: str = "tuned", temperature: float = 0.0,
                 top_p: float = 1.0, max_new_tokens: int = 128, on_text=None, text: str | None = None,
                 whole: bool = False, seed: int | None = None, adapter: str | None = None) -> dict:
        """Answer the conversation (or continue a plain `text` prompt); `on_text(piece)` gets the
        text as it comes; `seed` makes sampling repeatable; `adapter`: which of several runs'
        adapters answers (their adapter_names), when the model holds several. Returns the text, prompt_tokens,
        bucket, new_tokens, dropped_turns, ttft_s, seconds, stopped (by `stop`)."""
        import torch
        from transformers import StoppingCriteria, TextIteratorStreamer

        stop = self.stop

        class StopOnRequest(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return stop.is_set()

        ids, bucket, dropped, extras = self.fitted(messages, text, max_new_tokens, whole)
        if seed is not None:
            torch.manual_seed(seed)
        model, context = self.model_for(which)
        if adapter is not None:
            self.model.set_adapter(adapter)
        inputs = self._padded(ids, bucket, model, generate=True, extras=extras)
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {
            "do_sample": False}
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        failure: list[BaseException] = []

        def run():
            try:
                with context, torch.inference_mode():
                    model.generate(**inputs, max_new_tokens=max_new_tokens,
                                   cache_implementation="static", max_cache_len=self.max_cache_len,
                                   pad_token_id=self.pad, streamer=streamer, stopping_criteria=[StopOnRequest()],
                                   **sampling)
            except BaseException as error:  # raised below, after the streamer is released
                failure.append(error)
                streamer.end()

        start, first, pieces = time.time(), None, []
        worker = threading.Thread(target=run, name="generate", daemon=True)
        worker.start()
        for piece in streamer:
            if piece:
                first = first or time.time()
                pieces.append(piece)
                if on_text is not None:
                    on_text(piece)
        worker.join()
        if failure:
            raise failure[0]
        text = "".join(pieces)
        return {"text": text, "prompt_tokens": len(ids), "bucket": bucket, "dropped_turns": dropped,
                "new_tokens": len(self.tokenizer(text, add_special_tokens=False)["input_ids"]),
                "ttft_s": round((first or time.time()) - start, 4), "seconds": round(time.time() - start, 4),
                "stopped": stop.is_set()}

    def score(self, messages: list[dict], answer: str, which: str = "tuned") -> tuple[float, int]:
        """(summed loss, tokens) of `answer` after the conversation, as training counts it: the
        answer's tokens as the template writes them (its end-of-turn too), each predicted from
        what precedes it. Prompt + answer are left-padded to a bucket; (0, 0) when none fits."""
        import torch

        prompt, extras = self.encode(messages)
        full, _ = self.encode(messages, answer)
        if full[:len(prompt)] != prompt:  # a template that renders the prompt otherwise before an answer
            full = prompt + list(self.tokenizer(answer, add_special_tokens=False)["input_ids"])
        fitting = [b for b in BUCKETS if b <= self.max_cache_len and b >= len(full)]
        if len(full) <= len(prompt) or not fitting:
            return 0.0, 0
        model, context = self.model_for(which)
        inputs = self._padded(full, fitting[0], model, generate=False, extras=extras)
        inputs["position_ids"] = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        with context, torch.inference_mode():
            logits = model(**inputs, use_cache=False).logits[0, :-1].float()
            # Every position's loss, then the answer's picked on CPU: the device sees one shape
            # per bucket, whatever the answer's length (on Neuron a new shape is a compilation).
            losses = torch.nn.functional.cross_entropy(logits, inputs["input_ids"][0, 1:], reduction="none").cpu()
        answer_len = len(full) - len(prompt)
        return float(losses[-answer_len:].sum()), answer_len
