"""LoRA adapters chosen per row of a batch at a fixed shape, for the batched engine
(serve/batching.py). Imports torch and PEFT: child processes only.

PEFT answers a batch of mixed adapters (`adapter_names`) by cutting the batch into one sub-batch
per adapter (peft/tuners/lora/layer.py, `_mixed_batch_forward`): the sub-batches' shapes depend on
the mix, so each mix would be a graph of its own, compiled again on Neuron. Here instead every
LoRA Linear of the model becomes a RowLora that holds all adapters stacked (A: adapters x rank x
in, B: adapters x out x rank, ranks padded with zeros; an adapter that does not touch a module
has zeros there) and gathers each row's A and B by its adapter number (`index_select`), so a
batch has one shape whatever its mix. NxD Inference serves several LoRA adapters the same way,
by the adapter's id per row. One adapter (a LoRA run served alone) is the same with one entry.

What RowLora does not do (`unsupported` says so, and the engine falls back to one request at a
time): LoRA variants such as DoRA (they change the base weight's output, not only add to it),
LoRA on other layers than Linear (embeddings, convolutions), a LoRA bias, fan_in_fan_out
(GPT-2's Conv1D), and a module trained whole (`modules_to_save`) in more than one adapter.
"""

from __future__ import annotations

import json
from pathlib import Path


class Rows:
    """Which adapter each row of the next forward uses: `ids`, a (b,) tensor on the model's
    device, set by the engine before each forward (inside the compiled function)."""

    ids = None


def unsupported(peft_model, names: list[str]) -> str | None:
    """Why the model's adapters cannot be gathered per row (None when they can)."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora import Linear as LoraLinear
    from peft.utils import ModulesToSaveWrapper

    for path, module in peft_model.named_modules():
        if isinstance(module, ModulesToSaveWrapper) and len(names) > 1:
            return f"{path} is trained whole (modules_to_save) by an adapter: one adapter at a time only"
        if not isinstance(module, LoraLayer):
            continue
        if type(module) is not LoraLinear:
            return f"{path} is a LoRA {type(module).__name__}, not a Linear"
        if module.lora_variant:
            variant = type(next(iter(module.lora_variant.values()))).__name__
            return f"{path} uses a LoRA variant ({variant}, e.g. DoRA)"
        if any(module.lora_bias.values()) or module.fan_in_fan_out:
            return f"{path} has a LoRA bias or fan_in_fan_out"
    return None


def config_problem(folders: list[str]) -> str | None:
    """What `unsupported` would say, read from the adapters' adapter_config.json (nothing loaded:
    `launch.py serve --plan`); the loaded model's own check decides at start."""
    configs = []
    for folder in folders:
        try:
            configs.append(json.loads((Path(folder) / "adapter_config.json").read_text()))
        except (OSError, ValueError) as error:
            return f"{folder}: its adapter_config.json cannot be read ({error})"
    for folder, config in zip(folders, configs):
        targets = config.get("target_modules") or []
        targets = [targets] if isinstance(targets, str) else targets
        if config.get("use_dora"):
            return f"{folder} uses a LoRA variant (DoRA)"
        if config.get("lora_bias") or config.get("fan_in_fan_out"):
            return f"{folder} has a LoRA bias or fan_in_fan_out"
        if any("embed" in str(name) for name in targets):
            return f"{folder} puts LoRA on an embedding ({', '.join(map(str, targets))}), not a Linear"
        if config.get("modules_to_save") and len(folders) > 1:
            return f"{folder} trains modules whole (modules_to_save): one adapter at a time only"
    return None


def install(peft_model, names: list[str]):
    """(the PEFT model's transformers model with every LoRA Linear replaced by a RowLora over the
    adapters `names` (adapter number = place in `names`), the Rows they read, a function that puts
    the LoRA layers back). Changes the model in place: until put back, it answers only through
    the engine. Check `unsupported` first."""
    import torch
    from peft.tuners.lora import LoraLayer

    rows = Rows()

    class RowLora(torch.nn.Module):
        """A Linear plus, for each row, its own adapter's B(A(x)) * scaling (see the module's doc)."""

        def __init__(self, layer):
            super().__init__()
            self.base = layer.get_base_layer()
            present = [n for n in names if n in layer.lora_A]
            rank = max(layer.r[n] for n in present)
            weight = layer.lora_A[present[0]].weight
            a = weight.new_zeros((len(names), rank, self.base.in_features))
            b = weight.new_zeros((len(names), self.base.out_features, rank))
            scale = weight.new_zeros(len(names))
            for number, name in enumerate(names):
                if name in present:
                    r = layer.r[name]
                    a[number, :r] = layer.lora_A[name].weight.detach()
                    b[number, :, :r] = layer.lora_B[name].weight.detach()
                    scale[number] = layer.scaling[name]
            self.register_buffer("a", a)
            self.register_buffer("b", b)
            self.register_buffer("scale", scale)

        def forward(self, x):
            result = self.base(x)
            ids = rows.ids
            a, b = self.a.index_select(0, ids), self.b.index_select(0, ids)
            # as PEFT does: the adapter's part in its own dtype, the sum back in the base's
            lora = torch.bmm(torch.bmm(x.to(a.dtype), a.transpose(1, 2)), b.transpose(1, 2))
            return (result + lora * self.scale.index_select(0, ids)[:, None, None]).to(result.dtype)

    model = peft_model.get_base_model()
    swaps = []
    for path, module in [(p, m) for p, m in model.named_modules() if isinstance(m, LoraLayer)]:
        parent, _, child = path.rpartition(".")
        parent = model.get_submodule(parent) if parent else model
        swaps.append((parent, child, module))
        setattr(parent, child, RowLora(module))

    def undo() -> None:
        for parent, child, module in swaps:
            setattr(parent, child, module)

    return model, rows, undo
