"""The batched engine's KV cache (serve/batching.py): one static cache of `rows` rows by `cells`
cells, plus a scratch row that padding rows of a batch write to. Imports torch: child processes only.

Every write and read happens inside the model's forward, so inside the compiled graph of its
bucket: the step's new keys and values go in with one `index_copy_` on the (rows x cells) axis,
at each query's own cell (`write`: row * cells + cell, flattened), and a decode step reads its
rows back with one `index_select` (`read`: the rows of the batch, in order) cut to its length
bucket. No slice with gaps is written outside a graph: on TorchNeuron such a write goes through
the host, the whole destination both ways (the project's third Neuron audit of the TorchNeuron
native backend's copy path), and an eager op is a NEFF launch of its own. NxD Inference updates
its KV cache the same way, by scatter on the sequence dimension at each row's position
(neuronx-distributed-inference, modules/kvcache/kv_cache_manager.py, `update_cache`).

Layout: keys and values are (rows + 1, cells, kv_heads, head_dim), so (row, cell) flattens to one
index; a read gives the attention (b, kv_heads, K, head_dim), K the step's length bucket.
"""

from __future__ import annotations


def kv_shape(config) -> tuple[int, int]:
    """(key-value heads, head size) of a decoder's attention, from its (text) config."""
    config = config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return heads, head_dim


def slot_cache(model, rows: int, cells: int):
    """A SlotCache of `rows` rows (and the scratch row, number `rows`) by `cells` cells for
    `model`, on its device in its dtype. Before each forward, `at(write, read, length)` says where
    the step writes and what it reads (see the module's doc)."""
    import torch
    from transformers.cache_utils import Cache, StaticLayer

    heads, head_dim = kv_shape(model.config)
    config = model.config.get_text_config()

    class SlotLayer(StaticLayer):
        """A layer of the cache. `update` writes the step's keys and values at `owner.write` and
        returns what the step attends to: a prefill (`owner.read` None) its own keys, a decode
        step its rows' first `owner.length` cells."""

        def __init__(self, owner):
            super().__init__(max_cache_len=cells)
            self.owner = owner
            shape = (rows + 1, cells, heads, head_dim)
            self.keys = torch.zeros(shape, dtype=model.dtype, device=model.device)
            self.values = torch.zeros(shape, dtype=model.dtype, device=model.device)
            self.device, self.is_initialized = model.device, True

        def lazy_initialization(self, key_states, value_states) -> None:
            raise RuntimeError("a slot cache is made whole before the first step")

        def update(self, key_states, value_states, *args, **kwargs):
            b, h, q, d = key_states.shape
            if (h, d) != (heads, head_dim):
                raise ValueError(f"the model's attention gives {h} heads of {d}; the cache was made for {heads} of "
                                 f"{head_dim} (from its config)")
            owner = self.owner
            for cache, new in ((self.keys, key_states), (self.values, value_states)):
                cache.view(-1, h, d).index_copy_(0, owner.write, new.transpose(1, 2).reshape(b * q, h, d))
            if owner.read is None:
                return key_states, value_states
            keys = self.keys[:, :owner.length].index_select(0, owner.read).transpose(1, 2)
            values = self.values[:, :owner.length].index_select(0, owner.read).transpose(1, 2)
            return keys, values

    class SlotCache(Cache):
        def __init__(self):
            super().__init__(layers=[SlotLayer(self) for _ in range(config.num_hidden_layers)])
            self.write, self.read, self.length = None, None, cells

        def at(self, write, read, length: int) -> None:
            """The next forward writes its (b x q) queries' keys at `write` (flattened cells, b*q
            of them) and, a decode step, reads rows `read` (b of them) to cell `length`."""
            self.write, self.read, self.length = write, read, length

    return SlotCache()


def cache_mib(model, rows: int, cells: int) -> float:
    """The static KV cache's size in MiB: keys and values, every layer, its rows (and the scratch
    row, with more than one) x cells."""
    heads, head_dim = kv_shape(model.config)
    per_cell = 2 * model.config.get_text_config().num_hidden_layers * heads * head_dim * model.dtype.itemsize
    return (rows + (rows > 1)) * cells * per_cell / 2 ** 20
