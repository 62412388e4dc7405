"""The padding a run's batches get, as TRL resolves it, and how many sequence lengths it allows.

On Trainium each distinct batch shape is a compilation of minutes, so the plan says, before any
data is read (the shape forecast needs the data on this machine; this needs only the settings),
what `pad_to_multiple_of` will be on the run's device and what that bounds: with max_length 1024
and a multiple of 128, at most 1024/128 = 8 sequence lengths. Pure: the planner calls it.

TRL's rule (TRL 1.16, trl/trainer/sft_config.py `SFTConfig.__post_init__`, the same code in
DPOConfig, KTOConfig, RewardConfig, GRPOConfig, RLOOConfig and DistillationConfig): the field
defaults to "auto"; a string other than "auto" is read as a number ("none"/"null": no padding);
"auto" becomes 128 when the config's device is neuron, else None (no padding).
"""

from __future__ import annotations

import math

AUTO = "auto"
NEURON_MULTIPLE = 128  # what TRL's "auto" pads to on neuron


def resolve(value, backend: str) -> int | None:
    """pad_to_multiple_of as TRL's config leaves it on `backend`'s device (None: no padding).
    ValueError for a string that is neither "auto", "none"/"null" nor a number, as TRL raises."""
    if isinstance(value, str) and value != AUTO:
        return None if value.lower() in ("none", "null") else int(value)
    if value == AUTO:
        return NEURON_MULTIPLE if backend == "neuron" else None
    return value


def describe(args: dict, fields: dict[str, dict], backend: str, generates: bool = False) -> str:
    """The resolved padding and the sequence lengths it allows, in one line; "" when the trainer's
    config has no pad_to_multiple_of. `args`: the run's TRL settings (the planner's defaults
    applied); `fields`: the trainer's TRL config fields with their defaults (trl_schema);
    `generates`: the trainer pads generated prompts and completions (online RL)."""
    if "pad_to_multiple_of" not in fields:
        return ""

    def setting(key: str):
        return args[key] if key in args else fields.get(key, {}).get("default")

    value = setting("pad_to_multiple_of")
    try:
        multiple = resolve(value, backend)
    except ValueError:
        return (f"pad_to_multiple_of {value!r} is not a number: TRL refuses it; write a number, \"auto\" or "
                "null")
    shown = "null" if value is None else value
    if multiple and value == AUTO:
        how = f"pad to a multiple of {multiple} on Neuron (auto)"
    elif multiple:
        how = f"pad to a multiple of {multiple} (pad_to_multiple_of: {shown})"
    elif value == AUTO:
        how = f"no padding on {backend} (auto pads only on Neuron): each batch is as long as its longest sample"
    else:
        how = f"no padding (pad_to_multiple_of: {shown}): each batch is as long as its longest sample"
    return f"{how}; {_lengths(setting, multiple, generates)}"


def _count(limit: int, multiple: int | None, what: str) -> str:
    """At most how many lengths up to `limit` tokens a batch can take, padded to `multiple`."""
    if not multiple:
        return f"every {what} length is a shape of its own: up to {limit} of them"
    count = math.ceil(limit / multiple)
    exact = f"{limit}/{multiple} = {count}" if limit % multiple == 0 else f"{count} ({limit}/{multiple}, rounded up)"
    return f"at most {exact} {what} length{'s' * (count != 1)}"


def _lengths(setting, multiple: int | None, generates: bool) -> str:
    if generates:  # GRPO/RLOO pad prompts (left) and completions (right) apart; only completions have a limit
        limit = setting("max_completion_length")
        completions = (_count(limit, multiple, "completion") + f" (max_completion_length {limit})" if limit
                       else "completion lengths are not bounded (max_completion_length: null)")
        return f"{completions}; prompts: as many padded lengths as the data's prompts span (no prompt length limit)"
    limit = setting("max_length")
    packing, strategy = setting("packing"), setting("packing_strategy")
    if packing and strategy == "wrapped" and limit:
        # trl/data_utils.py _pack_wrapped: rows cut every max_length tokens; in a batch the rows pad to
        # the longest, so only a batch made of chunk ends alone could be shorter
        return f"1 sequence length: wrapped packing cuts every row at max_length {limit}"
    if not limit:
        return "sequence lengths are not bounded (max_length: null): set max_length to bound them"
    if packing or setting("padding_free"):
        # SFT's collator (trl/trainer/sft_trainer.py DataCollatorForLanguageModeling) flattens a
        # padding-free batch into one row of its samples end to end, then pads that row
        batch = setting("per_device_train_batch_size") or 1
        return (f"padding-free batches are one row of up to {batch} x {limit} tokens: "
                + _count(batch * limit, multiple, "row"))
    return _count(limit, multiple, "sequence") + f" (max_length {limit})"
