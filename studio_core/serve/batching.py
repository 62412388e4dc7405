"""Batched decoding at fixed shapes: requests answered together, joining and leaving a running
batch at step boundaries (continuous batching), while the model sees only a few input shapes (on
Neuron each new shape is a compilation). Imports torch: child processes only.

The cache: one static KV cache of `rows` rows (the largest batch bucket, 16 by default) by
`max_cache_len` cells (SlotCache); each row holds one request, from cell 0. A request joins at a
step boundary when a row is free: its prompt, left-padded to its length bucket Lb, is prefilled
into its row's cells [0, Lb), together with the others joining in the same bucket (a (b, Lb)
input, b a batch bucket but the widest, so 16 joining at once take two prefills of 8), and its
first token is sampled from that pass. A prefill attends to the cells it writes only, so its
cost and shape are the bucket's. Each step then decodes the active rows together: a (b, 1)
input, b the smallest batch bucket that holds them, each row writing its token at its own next
cell, with its own position and a mask of its own cells (a 4D mask: the model attends to
nothing else). Active rows are kept in rows 0..n-1 (a finished row's place is taken by the last
one, its cells copied), so rows n..b-1 only pad the batch. So the model sees at most a prefill
shape per batch bucket (but the widest) and length bucket, and a decode shape per batch bucket,
however many requests come: 4 x 4 + 5 = 21 with the defaults (a 1024-token cache: prompt buckets
64 to 512), within batch buckets x length buckets + 2.

Who joins when: waiting requests join in arrival order, as rows free up (a later one never passes
an earlier one). Every request fits a row (its bucket and max_new_tokens fit the cache: `submit`
refuses one that does not), so none waits for the others to drain.

Each request keeps its own sampling (temperature, top_p, a seeded generator), max_new_tokens and
end-of-sequence; `cancel` ends one at the next step boundary and frees its row. Greedy decoding
gives a request the same tokens alone or in a batch: its row sees its own cells only (the tests
compare them token for token; a float sum over a longer batch could in principle order its terms
otherwise, which they would catch).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

BATCH_BUCKETS = (1, 2, 4, 8, 16)


def batch_bucket(active: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int:
    """The smallest batch bucket that holds `active` rows."""
    return next(b for b in buckets if b >= active)


@dataclass
class Request:
    """One request: its prompt's token ids, bucket and settings; `on_token(id)` gets each new
    token as it comes, `on_done(reason)` once at its end ("stop": end of sequence, "length":
    max_new_tokens, "cancelled", or "error: ..." when the model failed)."""
    ids: list[int]
    bucket: int
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    on_token: Callable[[int], None] = lambda token: None
    on_done: Callable[[str], None] = lambda reason: None
    adapter: str | None = None  # the LoRA adapter its row is decoded with (several runs on one base)
    id: int = 0
    tokens: list[int] = field(default_factory=list)  # generated so far
    start: int = 0  # the cell of its first real token
    length: int = 0  # its tokens in the cache (prompt and generated)
    generator: object = None  # its torch.Generator when it samples
    cancelled: bool = False


def cache_mib(model, rows: int, max_cache_len: int) -> float:
    """The static KV cache's size in MiB: keys and values, every layer, rows x cells."""
    config = model.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_cell = 2 * config.num_hidden_layers * heads * head_dim * model.dtype.itemsize
    return rows * max_cache_len * per_cell / 2 ** 20


def slot_cache(model, rows: int, max_cache_len: int):
    """A static cache of `rows` rows for `model` (see the module's doc): `prefill_at(row)` or
    `decode_at(cells)` sets where the next forward writes."""
    import torch
    from transformers.cache_utils import Cache, StaticLayer

    class SlotLayer(StaticLayer):
        """Transformers' static layer with a fixed number of rows. A prefill of b rows (`cells`
        None) writes rows [row, row + b) at cells [0, q) and attends to those cells only; a decode
        step writes row i at its own cell cells[i] and attends to rows [0, b), every cell (the
        mask says which)."""

        row, cells = 0, None

        def lazy_initialization(self, key_states, value_states) -> None:
            shape = key_states.shape
            super().lazy_initialization(key_states.new_zeros((rows, *shape[1:])),
                                        value_states.new_zeros((rows, *value_states.shape[1:])))

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            b, length = key_states.shape[0], key_states.shape[-2]
            if self.cells is None:
                self.keys[self.row:self.row + b, :, :length] = key_states
                self.values[self.row:self.row + b, :, :length] = value_states
                return key_states, value_states
            batch = torch.arange(b, device=self.device)
            self.keys[batch, :, self.cells] = key_states[:, :, 0]
            self.values[batch, :, self.cells] = value_states[:, :, 0]
            return self.keys[:b], self.values[:b]

    class SlotCache(Cache):
        def __init__(self):
            layers = model.config.get_text_config().num_hidden_layers
            super().__init__(layers=[SlotLayer(max_cache_len=max_cache_len) for _ in range(layers)])

        def prefill_at(self, row: int) -> None:
            for layer in self.layers:
                layer.row, layer.cells = row, None

        def decode_at(self, cells) -> None:
            """Row i of the next forward writes at cells[i] (a (b,) tensor on the model's device)."""
            for layer in self.layers:
                layer.cells = cells

        def move(self, source: int, target: int) -> None:
            """Row `source`'s cells copied into row `target`."""
            for layer in self.layers:
                if layer.is_initialized:
                    layer.keys[target].copy_(layer.keys[source])
                    layer.values[target].copy_(layer.values[source])

    return SlotCache()


class BatchEngine:
    """Answers requests in batches (see the module's doc). `submit` from any thread; one thread
    runs `run()` (or the caller steps it with `step()`)."""

    def __init__(self, model, pad: int, eos: set[int], max_cache_len: int,
                 batch_buckets: tuple[int, ...] = BATCH_BUCKETS, forward_kwargs: Callable[[list], dict] | None = None,
                 after_step: Callable[[], None] = lambda: None):
        import torch

        self.model, self.pad, self.eos, self.max_cache_len = model, pad, set(eos), max_cache_len
        self.cells = torch.arange(max_cache_len)  # the cache's cell numbers, for each step's masks
        self.buckets = tuple(sorted(batch_buckets))
        self.rows = self.buckets[-1]
        self.cache = slot_cache(model, self.rows, max_cache_len)
        self.active: list[Request] = []  # row i holds active[i]
        self.waiting: deque[Request] = deque()
        self.lock = threading.Condition()
        self.closed = False
        self.ids = itertools.count(1)
        # extra forward arguments for the rows in order (e.g. PEFT's adapter_names); None: none
        self.forward_kwargs = forward_kwargs or (lambda requests: {})
        self.after_step = after_step  # called by run() after each step (a caller's batched output goes out)

    # --- from any thread ------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        if request.bucket + request.max_new_tokens > self.max_cache_len:
            raise ValueError(f"a prompt bucket of {request.bucket} tokens and {request.max_new_tokens} new tokens do "
                             f"not fit a cache of {self.max_cache_len}")
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
                failed, self.active = self.active, []
                for request in failed:
                    request.on_done(f"error: {type(error).__name__}: {error}")
            self.after_step()
        for request in [*self.active, *self.waiting]:
            request.on_done("cancelled")
        self.active, self.waiting = [], deque()
        self.after_step()

    # --- the engine's thread --------------------------------------------------------------
    def step(self) -> None:
        """One step boundary: the cancelled leave, the waiting that fit join (each prefilled,
        its first token out), then one decode step of every active row."""
        import torch

        with torch.inference_mode():  # the cache's tensors are made and changed in it
            self._leave([r for r in self.active if r.cancelled], "cancelled")
            joined = self._joining()
            firsts = [pair for group in self._prefill_groups(joined) for pair in self._prefill(group)]
            for request, logits in firsts:  # after every prefill: a first token may end a request and move rows
                self._emit(request, logits)
            if self.active:
                self._decode()

    def _joining(self) -> list[Request]:
        """The waiting requests that join now, in arrival order, each given its row (the cancelled
        ones end)."""
        joined = []
        with self.lock:
            for request in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(request)
                request.on_done("cancelled")
            while self.waiting and len(self.active) < self.rows:
                request = self.waiting.popleft()
                self.active.append(request)
                joined.append(request)
        return joined

    def _prefill_groups(self, joined: list[Request]) -> list[tuple[int, int, list[Request]]]:
        """The joined requests (the last rows), put in order of their buckets and cut into
        prefills: (first row, batch bucket, requests) of one bucket each, a batch bucket wide
        (the rows past the requests pad it: free rows, or rows of later prefills, written again
        by them)."""
        if not joined:
            return []
        first = len(self.active) - len(joined)
        self.active[first:] = sorted(joined, key=lambda r: r.bucket)  # stable: arrival order within a bucket
        groups, row = [], first
        widths = self.buckets[:-1] or self.buckets  # not the widest: a bound on the shapes (the module's doc)
        for _, same in itertools.groupby(self.active[first:], key=lambda r: r.bucket):
            same = list(same)
            while same:
                width = batch_bucket(min(len(same), widths[-1]), widths)
                if row + width > self.rows:  # no rows left to pad with: the widest bucket the requests fill
                    width = max(b for b in widths if b <= len(same))
                groups.append((row, width, same[:width]))
                row, same = row + min(width, len(same)), same[width:]
        return groups

    def _prefill(self, group: tuple[int, int, list[Request]]) -> list[tuple[Request, object]]:
        """One prefill of a bucket's requests into rows [row, row + width): each prompt left-padded
        to the bucket, written at cells [0, bucket), attending to those cells only.
        -> each request with its last token's logits."""
        import torch

        row, width, requests = group
        bucket = requests[0].bucket
        keys = torch.arange(bucket)
        ids, positions, seen = [], [], []
        for request in requests:
            count = len(request.ids)
            request.start, request.length = bucket - count, count
            ids.append([self.pad] * (bucket - count) + request.ids)
            positions.append([0] * (bucket - count) + list(range(count)))
            # query j sees the real cells up to its own (causal); a pad sees only itself
            seen.append((keys[None, :] >= bucket - count) & (keys[None, :] <= keys[:, None]))
        for _ in range(width - len(requests)):  # rows that only pad the batch: each query sees itself
            ids.append([self.pad] * bucket)
            positions.append([0] * bucket)
            seen.append(torch.zeros(bucket, bucket, dtype=torch.bool))
        seen = torch.stack(seen) | torch.eye(bucket, dtype=torch.bool)[None]
        self.cache.prefill_at(row)
        logits = self._forward(torch.tensor(ids), torch.tensor(positions), seen,
                               requests + [None] * (width - len(requests)))[:, -1]  # the last (real) token's
        return list(zip(requests, logits))

    def _decode(self) -> None:
        import torch

        n = len(self.active)
        b = batch_bucket(n, self.buckets)
        last = [r.tokens[-1] for r in self.active] + [self.pad] * (b - n)
        positions = [r.length for r in self.active] + [0] * (b - n)
        starts = torch.tensor([r.start for r in self.active] + [0] * (b - n))  # a padding row: cell 0 alone
        cells = torch.tensor([r.start + r.length for r in self.active] + [0] * (b - n))  # where each row writes
        seen = (self.cells[None, :] >= starts[:, None]) & (self.cells[None, :] <= cells[:, None])  # its own cells
        self.cache.decode_at(cells.to(self.model.device))
        logits = self._forward(torch.tensor(last)[:, None], torch.tensor(positions)[:, None], seen[:, None],
                               self.active + [None] * (b - n))[:, -1]
        for request, row_logits in zip(list(self.active), logits):
            request.length += 1
            self._emit(request, row_logits)

    def _forward(self, ids, positions, seen, requests: list):
        """The model on (b, q) ids; `seen` (b, q, cells): which cells each query attends to."""
        import torch

        mask = seen[:, None]  # (b, 1, q, cells), as Transformers' attention takes a prepared mask
        if getattr(self.model.config, "_attn_implementation", "sdpa") == "eager":
            mask = torch.zeros(mask.shape, dtype=self.model.dtype).masked_fill(~mask, torch.finfo(self.model.dtype).min)
        device = self.model.device
        out = self.model(input_ids=ids.to(device), position_ids=positions.to(device), attention_mask=mask.to(device),
                         cache=self.cache, use_cache=True, logits_to_keep=1, **self.forward_kwargs(requests))
        return out.logits.float().cpu()

    def _emit(self, request: Request, logits) -> None:
        """The request's next token from its logits, out; it leaves when it ends."""
        token = self._sample(request, logits)
        request.tokens.append(token)
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
        """The requests leave their rows; the last active row moves into each freed one."""
        for request in requests:
            if request not in self.active:
                continue
            row, last = self.active.index(request), len(self.active) - 1
            if row != last:
                self.cache.move(last, row)
                self.active[row] = self.active[last]
            self.active.pop()
            request.on_done(reason)
