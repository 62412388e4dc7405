"""Batched decoding at fixed, compiled shapes: requests answered together, joining and leaving a
running batch at step boundaries (continuous batching), each step one whole graph of a bucket.
The plan (`engine_plan`, `BATCH_BUCKETS`, `length_buckets`) is pure; the engine imports torch:
child processes only.

Why: on Neuron a forward called op by op runs every ATen op as a NEFF of its own, and every new
input shape of a compiled graph is a compilation of minutes. So the model runs only inside
`torch.compile(..., fullgraph=True, dynamic=False)` graphs (backend "neuron" on Neuron, Inductor on
CUDA), one per bucket, all compiled before the first request (`warm_up`: their count and time are
said), and after that a new shape is an error, never a silent compilation
(`torch.compiler.set_stance("fail_on_recompile")`). On the CPU nothing is compiled unless asked
(`compiled=True`): an eager op costs nothing more there, and the shapes are the same.

The cache (serve/slots.py): `rows` rows (the largest batch bucket) of `cells` cells; a request
holds one row from cell 0 for its life. Its prompt of n tokens is prefilled alone, right-padded:
its first n-1 tokens, padded to a length bucket, written at cells [0, L) of its row (the padding's
cells are masked and written over later). Each step then decodes every active row together: a
(b, 1) input, b the smallest batch bucket that holds them, each row feeding its next token (at
first its prompt's last) at its own next cell and attending to its own cells of the first K, K
the smallest length bucket past every row's cell. Rows past the active ones only pad the batch:
they read and write a scratch row. So the graphs are one prefill per length bucket below the
cache's length and one decode per batch bucket and length bucket; 4 + 5 x 5 = 29 with the
defaults (16 rows, a 1024-token cache: lengths 64 to 1024), whatever the requests.

Several LoRA adapters (runs on one base) are gathered per row at a fixed shape (serve/
row_adapters.py): a batch has one shape whatever its mix of adapters. What cannot be served that
way (a LoRA variant such as DoRA, say) is served one request at a time by transformers' compiled
single-request generate instead (`engine_plan`'s "single" mode), and the server says why.

Who joins when: waiting requests join in arrival order as rows free up (a later one never passes
an earlier one). `submit` refuses a request whose prompt and answer do not fit a row. Each request
keeps its own sampling (temperature, top_p, a seeded generator), max_new_tokens and end of
sequence; `cancel` ends one at the next step boundary and frees its row. Greedy decoding gives a
request the same tokens alone or in a batch: its row sees its own cells only (the tests compare
them token for token with the chat's own generate()).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

BATCH_BUCKETS = (1, 2, 4, 8, 16)
SMALLEST_LENGTH = 64  # the smallest length bucket; the others double up to the cache's length
COMPILERS = {"neuron": "neuron", "cuda": "inductor", "cpu": "inductor"}  # torch.compile's backend per device


def batch_bucket(active: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int:
    """The smallest batch bucket that holds `active` rows."""
    return next(b for b in buckets if b >= active)


def length_buckets(cells: int) -> tuple[int, ...]:
    """The lengths a decode step attends to: powers of two from SMALLEST_LENGTH below the cache's
    length, then the cache's length."""
    lengths = []
    while (SMALLEST_LENGTH << len(lengths)) < cells:
        lengths.append(SMALLEST_LENGTH << len(lengths))
    return (*lengths, cells)


@dataclass(frozen=True)
class EnginePlan:
    """How a server's model will answer: "compiled" (a graph per bucket, all compiled at start by
    `compiler`), "eager" (batched, op by op: the CPU only) or "single" (one request at a time,
    through transformers' generate, compiled per prompt bucket on Neuron); why, when not compiled."""
    mode: str
    compiler: str | None
    prefill: tuple[int, ...] = ()  # one prompt per prefill, padded to one of these lengths
    decode: tuple[tuple[int, int], ...] = ()  # (batch bucket, length bucket)
    why: str = ""

    @property
    def graphs(self) -> int:
        return len(self.prefill) + len(self.decode) if self.mode == "compiled" else 0

    def describe(self) -> str:
        if self.mode == "single":
            return f"one request at a time (transformers' generate): {self.why}"
        batches = sorted({b for b, _ in self.decode})
        shapes = (f"prefills of one prompt at {', '.join(map(str, self.prefill))} tokens, decodes of "
                  f"{', '.join(map(str, batches))} rows x {', '.join(map(str, sorted({k for _, k in self.decode})))} cells")
        if self.mode == "compiled":
            return f"{self.graphs} graphs compiled at start by {self.compiler} ({shapes}); none after"
        return f"batched, not compiled ({self.why}): {shapes}"


def engine_plan(backend: str, max_batch: int, cells: int, compiled: bool = False,
                unsupported: str | None = None) -> EnginePlan:
    """The plan for a server of up to `max_batch` requests at once over a `cells`-token cache on
    `backend`; `compiled`: compile on the CPU too; `unsupported`: why the model's adapters cannot be
    gathered per row (row_adapters.unsupported), which leaves one request at a time."""
    if max_batch == 1:
        return EnginePlan("single", None, why="--max-batch 1")
    if unsupported:
        return EnginePlan("single", None, why=f"{unsupported}, which the batched engine cannot gather per row")
    lengths = length_buckets(cells)
    buckets = tuple(b for b in BATCH_BUCKETS if b <= max_batch)
    shapes = {"prefill": lengths[:-1] or lengths, "decode": tuple((b, k) for b in buckets for k in lengths)}
    if backend == "cpu" and not compiled:
        return EnginePlan("eager", None, **shapes, why="on the CPU an op costs no compilation; --compile compiles")
    return EnginePlan("compiled", COMPILERS[backend], **shapes)


@dataclass
class Request:
    """One request: its prompt's token ids and settings; `on_token(id)` gets each new token as it
    comes, `on_done(reason)` once at its end ("stop": end of sequence, "length": max_new_tokens,
    "cancelled", or "error: ..." when the model failed)."""
    ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    on_token: Callable[[int], None] = lambda token: None
    on_done: Callable[[str], None] = lambda reason: None
    adapter: str | None = None  # the LoRA adapter its row is decoded with (several runs on one base)
    id: int = 0
    bucket: int = 0  # its prefill's length bucket (set by submit)
    tokens: list[int] = field(default_factory=list)  # generated so far
    row: int = -1  # its row of the cache, while it is active
    cell: int = 0  # the cell its next input token is written at (= that token's position)
    next: int = 0  # its next input token
    generator: object = None  # its torch.Generator when it samples
    cancelled: bool = False


def _forward(model, cache, rows, ids, positions, masks, write, read, length: int, adapters):
    """One step of the model: what each bucket's graph is compiled from (see the module's doc)."""
    cache.at(write, read, length)
    if rows is not None:
        rows.ids = adapters
    out = model(input_ids=ids, position_ids=positions, attention_mask=masks, cache=cache, use_cache=True,
                logits_to_keep=1)
    return out.logits[:, -1].float()


class BatchEngine:
    """Answers requests in batches (see the module's doc). `model`: a transformers causal LM (its
    LoRA layers gathered per row by row_adapters.install, with `rows` and the adapters' `names` in
    order); `compiler`: torch.compile's backend, or None to run eagerly. `submit` from any thread;
    one thread runs `run()` (or the caller steps it with `step()`), after `warm_up()` when compiled."""

    def __init__(self, model, pad: int, eos: set[int], cells: int, batch_buckets: tuple[int, ...] = BATCH_BUCKETS,
                 compiler: str | None = None, rows=None, names: list[str] = (),
                 after_step: Callable[[], None] = lambda: None):
        import torch

        from studio_core.serve.slots import slot_cache

        self.model, self.pad, self.eos, self.cells = model, pad, set(eos), cells
        self.buckets = tuple(sorted(batch_buckets))
        self.rows = self.buckets[-1]
        self.scratch = self.rows  # the cache's extra row, which padding rows read and write
        self.lengths = length_buckets(cells)
        self.prefills = self.lengths[:-1] or self.lengths
        self.adapter_rows, self.adapters = rows, {name: number for number, name in enumerate(names)}
        with torch.no_grad():
            self.cache = slot_cache(model, self.rows, cells)
        self.graphs = len(self.prefills) + len(self.buckets) * len(self.lengths)  # a prefill or decode a bucket
        self.compiler, self.strict = compiler, False
        self.forward = _forward
        if compiler:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, self.graphs + 8)
            self.forward = torch.compile(_forward, backend=compiler, fullgraph=True, dynamic=False)
        text = model.config.get_text_config()
        self.mask_types = set(getattr(text, "layer_types", None) or ["full_attention"])
        self.window = getattr(text, "sliding_window", None)
        self.free = list(range(self.rows))
        self.ran: set[tuple[int, int, int]] = set()  # (rows, input length, cells attended) of each step run
        self.active: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.lock = threading.Condition()
        self.closed = False
        self.ids = itertools.count(1)
        self.after_step = after_step  # called by run() after each step (a caller's batched output goes out)

    @property
    def shapes(self) -> set[tuple[int, int]]:
        """The input shapes (rows, length) run so far."""
        return {(b, q) for b, q, _ in self.ran}

    # --- from any thread ------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        count = len(request.ids)
        if not count or count - 1 > self.prefills[-1] or count + request.max_new_tokens - 1 > self.cells:
            raise ValueError(f"a prompt of {count} tokens and {request.max_new_tokens} new tokens do not fit a row "
                             f"of {self.cells} cells (prompts up to {self.prefills[-1] + 1} tokens)")
        if request.adapter is not None and request.adapter not in self.adapters:
            raise ValueError(f"no adapter {request.adapter!r} here; these are: {', '.join(self.adapters)}")
        request.bucket = next(b for b in self.prefills if b >= count - 1)
        with self.lock:
            request.id = next(self.ids)
            self.waiting.append(request)
            self.lock.notify_all()
        return request

    def cancel(self, request: Request) -> None:
        """End the request at the next step boundary (at once if it waits), freeing its row."""
        with self.lock:
            request.cancelled = True
            self.lock.notify_all()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.lock.notify_all()

    def run(self) -> None:
        """Step until closed, sleeping while nothing is asked. A step that fails (the device out of
        memory, say) ends the requests in the batch with the error, and the engine goes on."""
        while True:
            with self.lock:
                self.lock.wait_for(lambda: self.closed or self.active or self.waiting)
                if self.closed:
                    break
            try:
                self.step()
            except Exception as error:  # every request of the batch is told; the next ones start afresh
                failed, self.active, self.free = self.active, [], list(range(self.rows))
                for request in failed:
                    request.on_done(f"error: {type(error).__name__}: {error}")
            self.after_step()
        for request in [*self.active, *self.waiting]:
            request.on_done("cancelled")
        self.active, self.waiting = [], deque()
        self.after_step()

    # --- the engine's thread --------------------------------------------------------------
    def warm_up(self, on_graph: Callable[[int, int], None] = lambda done, total: None) -> dict:
        """Run every bucket once (on the scratch row), so that a compiled engine compiles each graph
        now; from here a new shape is an error. -> {"graphs": how many ran, "seconds"}."""
        import torch

        began = time.monotonic()
        with torch.no_grad():
            for done, length in enumerate(self.prefills, 1):
                self._prefill_at([], self.scratch, length, 0)
                on_graph(done, self.graphs)
            for done, (width, length) in enumerate(itertools.product(self.buckets, self.lengths), done + 1):
                self._decode_at([], width, length)
                on_graph(done, self.graphs)
        self.strict = self.compiler is not None
        self.ran.clear()  # what requests ran, from here
        return {"graphs": self.graphs, "seconds": round(time.monotonic() - began, 2)}

    def step(self) -> None:
        """One step boundary: the cancelled leave, the waiting that fit join (each prefilled), then
        one decode step of every active row (a joined one's first token comes from it)."""
        import torch

        with torch.no_grad():
            self._leave([r for r in self.active if r.cancelled], "cancelled")
            for request in self._joining():
                self._prefill(request)
            if self.active:
                self._decode()

    def _joining(self) -> list[Request]:
        """The waiting requests that join now, in arrival order, each given a free row (the
        cancelled ones end)."""
        joined = []
        with self.lock:
            for request in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(request)
                request.on_done("cancelled")
            while self.waiting and self.free:
                request = self.waiting.popleft()
                request.row = self.free.pop(0)
                self.active.append(request)
                joined.append(request)
        return joined

    def _prefill(self, request: Request) -> None:
        """The request's prompt but its last token, right-padded to its bucket, into its row's
        first cells; its last token is its first decode step's input."""
        request.cell, request.next = len(request.ids) - 1, request.ids[-1]
        if request.cell:
            self._prefill_at(request.ids[:-1], request.row, request.bucket, self._adapter(request))

    def _prefill_at(self, ids: list[int], row: int, length: int, adapter: int) -> None:
        """A prefill of `ids`, right-padded to `length`, into `row`'s first cells."""
        import torch

        cells = torch.arange(length)
        self._run(torch.tensor([ids + [self.pad] * (length - len(ids))]), cells[None],
                  self._masks(cells[None, :], cells[:, None], (1, 1, length, length)),  # causal: padding unseen
                  row * self.cells + cells, None, length, [adapter])

    def _masks(self, keys, queries, shape: tuple[int, ...]) -> dict:
        """Each attention kind's mask of the model (a bool per query and key cell: the key at or
        before the query, and within the window for sliding layers), in `shape`."""
        seen = keys <= queries
        masks = {"full_attention": seen}
        if "sliding_attention" in self.mask_types:
            masks["sliding_attention"] = seen & (keys > queries - self.window)
        return {kind: mask.reshape(shape) for kind, mask in masks.items() if kind in self.mask_types}

    def _decode(self) -> None:
        n = len(self.active)
        length = next(k for k in self.lengths if k > max(r.cell for r in self.active))
        logits = self._decode_at(self.active, batch_bucket(n, self.buckets), length)
        for request, row_logits in zip(list(self.active), logits[:n]):
            request.cell += 1
            self._emit(request, row_logits)

    def _decode_at(self, requests: list[Request], width: int, length: int):
        """A decode step of `requests` in a batch of `width` rows attending to `length` cells."""
        import torch

        pad = width - len(requests)
        cells = torch.tensor([r.cell for r in requests] + [0] * pad)
        rows = torch.tensor([r.row for r in requests] + [self.scratch] * pad)
        masks = self._masks(torch.arange(length)[None, :], cells[:, None], (width, 1, 1, length))  # its own cells
        ids = torch.tensor([[r.next] for r in requests] + [[self.pad]] * pad)
        return self._run(ids, cells[:, None], masks, rows * self.cells + cells, rows, length,
                         [self._adapter(r) for r in requests] + [0] * pad)

    def _adapter(self, request: Request) -> int:
        return self.adapters.get(request.adapter, 0)

    def _run(self, ids, positions, masks, write, read, length: int, adapters: list[int]):
        """The step's graph on the model's device (its inputs made on the CPU and moved whole);
        its last position's logits back on the CPU."""
        import torch

        self.ran.add((*ids.shape, length))
        device, dtype = self.model.device, self.model.dtype
        if getattr(self.model.config, "_attn_implementation", "sdpa") == "eager":  # an additive mask
            masks = {kind: torch.zeros(m.shape, dtype=dtype).masked_fill(~m, torch.finfo(dtype).min)
                     for kind, m in masks.items()}
        inputs = (ids.to(device), positions.to(device), {kind: m.to(device) for kind, m in masks.items()},
                  write.to(device), None if read is None else read.to(device), length,
                  torch.tensor(adapters).to(device))
        with torch.compiler.set_stance("fail_on_recompile") if self.strict else contextlib.nullcontext():
            return self.forward(self.model, self.cache, self.adapter_rows, *inputs).cpu()

    def _emit(self, request: Request, logits) -> None:
        """The request's next token from its logits, out; it leaves when it ends."""
        token = self._sample(request, logits)
        request.tokens.append(token)
        request.next = token
        request.on_token(token)
        if token in self.eos:
            self._leave([request], "stop")
        elif len(request.tokens) >= request.max_new_tokens:
            self._leave([request], "length")

    @staticmethod
    def _sample(request: Request, logits) -> int:
        import torch

        if request.temperature <= 0:
            return int(torch.argmax(logits))
        if request.generator is None:
            request.generator = torch.Generator()
            if request.seed is not None:
                request.generator.manual_seed(request.seed)
            else:
                request.generator.seed()
        probs = torch.softmax(logits / request.temperature, dim=-1)
        if request.top_p < 1.0:
            ordered, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(ordered, dim=-1) - ordered < request.top_p  # the smallest set reaching top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
        return int(torch.multinomial(probs, 1, generator=request.generator))

    def _leave(self, requests: list[Request], reason: str) -> None:
        """The requests leave; their rows are free for the next to join."""
        for request in requests:
            if request not in self.active:
                continue
            self.active.remove(request)
            self.free.append(request.row)
            self.free.sort()
            request.on_done(reason)

