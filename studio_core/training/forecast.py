"""The shape forecast: before launch, the batch shapes a run will compile and its padding waste.

On Trainium every distinct batch shape that reaches the model is a compilation of minutes.
The forecast asks TRL itself rather than imitating it: it builds the run's own trainer (its
dataset preparation: chat template, truncation, packing; its collator: padding,
pad_to_multiple_of; its sampler: the same seed, batch size and drop_last) around a tiny
stand-in model with the tokenizer's vocabulary, and walks the batches the run will take.
At each batch the trainer's own loss code calls the model; the stand-in's forward pre-hook
reads the shape that reaches it and stops the forward there, so no model math runs.

Several data-parallel processes take turns at the batches (accelerate gives process r the
batches r, r+N, ...), so the forecast covers them all and reports the shapes of the busiest
one too. GRPO's shapes come from what the model generates, so GRPO is not forecast. A
vision-language model's trainer gets its processor, as in the run: TRL's vision collator puts each
image's tokens into the batches the walk sees (and TRL packs no images: no packing is suggested).

The suggestions are settings walked the same way (pad_to_multiple_of buckets, length-grouped
batches with buckets, max_length, packing), each with what it costs the data: the samples cut
at max_length, a changed order (length grouping), samples cut across rows (packing).

Runs in a child process (it imports TRL): `forecast_in_subprocess` for the app and the CLI,
which remembers each forecast on disk while nothing it read changed (data/remembered.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import subprocess
import sys
import tempfile
from collections import Counter

from studio_core.data import remembered, sources
from studio_core.machine import children
from studio_core.training import padding
from studio_core.recipe import trainers
from studio_core.recipe.spec import RunSpec, SpecError

MAX_MICRO_BATCHES = 20_000  # walk at most this many batches (say so when the run takes more)
# Padding the suggestions' ranking calls little: a suggestion over it comes after those under it.
LITTLE_WASTE = 0.15
BUCKETS = (32, 64, 128)  # pad_to_multiple_of tried alone
GROUPED_BUCKETS = (16, 32, 64, 128)  # and under length-grouped batches, whose padding is mostly the bucket's
# Settings the forecast's stand-in trainer must not take from the run: devices, compilation,
# logging, saving and the model's own loading (none of them changes a batch's shape).
NOT_FOR_DATA = ("use_cpu", "bf16", "fp16", "torch_compile", "torch_compile_backend", "torch_compile_mode",
                "report_to", "model_init_kwargs", "gradient_checkpointing", "save_strategy", "save_steps",
                "logging_steps", "precompute_ref_log_probs", "push_to_hub", "hub_model_id")
NOT_FOR_DATA_PREFIXES = ("ddp_", "fsdp", "deepspeed", "parallelism_config")  # one process walks for all


REFUSED = 3  # the forecast process's exit code when the data cannot train as set (its stdout says why)


@dataclasses.dataclass
class Forecast:
    trainer: str
    shapes: list[list[int]]  # [batch, length, how many batches], most frequent first
    micro_batches: int  # batches walked
    steps: int  # optimizer steps they make
    capped: bool  # the run takes more batches than were walked
    real_tokens: int
    padded_tokens: int  # tokens the model computes on, padding included
    lengths: list[int]  # every sample's tokenized length before truncation
    max_length: int | None
    truncated: int  # samples longer than max_length
    data_parallel: int
    busiest_rank_shapes: int
    # {"set", "graphs", "waste", "why", "truncated": samples cut at max_length, "cost": to the data, in words}
    suggestions: list[dict] = dataclasses.field(default_factory=list)
    eval_shapes: list[list[int]] = dataclasses.field(default_factory=list)  # an evaluation's, as `shapes`
    eval_batches: int = 0  # batches of one evaluation (each evaluation walks the same ones)

    @property
    def graphs(self) -> int:
        return len(self.shapes)

    @property
    def waste(self) -> float:
        return 1 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0

    def histogram(self, bins: int = 12) -> list[tuple[str, int]]:
        """Sequence lengths in equal-width buckets: (label, samples)."""
        if not self.lengths:
            return []
        top = max(self.lengths)
        width = max(1, math.ceil(top / bins))
        counts = Counter(min(length // width, bins - 1) for length in self.lengths)
        return [(f"{b * width}-{(b + 1) * width - 1}", counts.get(b, 0)) for b in range(bins)]

    def describe(self) -> str:
        lines = [f"Shape forecast ({trainers.get(self.trainer).name}, {self.micro_batches} batches = {self.steps} steps"
                 f"{', the first ones only' if self.capped else ''}):",
                 f"  {self.graphs} distinct batch shape(s), so {self.graphs} compilation(s) of the training "
                 "step (forward and backward; more pieces if the model has graph breaks)"]
        lines += [f"    {b} x {length}: {n} batch(es)" for b, length, n in self.shapes[:12]]
        if len(self.shapes) > 12:
            lines.append(f"    ... and {len(self.shapes) - 12} more")
        if self.data_parallel > 1:
            lines.append(f"  {self.data_parallel} data-parallel processes; the busiest compiles "
                         f"{self.busiest_rank_shapes} shape(s)")
        lines.append(f"  padding waste: {self.waste:.1%} of the tokens computed")
        if self.eval_batches:
            lines.append(f"  evaluation: {len(self.eval_shapes)} distinct batch shape(s) in its {self.eval_batches} "
                         "batches, each a compilation of its own (a forward-only graph), the same at every "
                         "evaluation")
            lines += [f"    {b} x {length}: {n} batch(es)" for b, length, n in self.eval_shapes[:6]]
        if self.lengths:
            lines.append(f"  sequence lengths: {min(self.lengths)}-{max(self.lengths)} tokens, median "
                         f"{sorted(self.lengths)[len(self.lengths) // 2]}; truncated at max_length "
                         f"{self.max_length}: {self.truncated} of {len(self.lengths)} samples")
        for s in self.suggestions:
            settings = ", ".join(f"{k}={v}" for k, v in s["set"].items())
            lines.append(f"  suggestion: {settings} -> {s['graphs']} shape(s), waste {s['waste']:.1%} ({s['why']})")
            lines.append(f"    costs the data: {s['cost']}")
        return "\n".join(lines)

    @classmethod
    def from_dict(cls, data: dict) -> Forecast:
        return cls(**data)


def forecast_in_subprocess(spec: RunSpec, backend: str, timeout: float = 900) -> Forecast:
    """`forecast` in a child Python process; a SpecError with its output when it fails."""
    trainer = spec.trainer_entry
    if not trainer.forecast:
        shown = ", ".join(t.name for t in trainers.TRAINERS.values() if t.forecast)
        raise SpecError([f"shape forecast: {trainer.name} is not forecast: {trainer.not_forecast}; {shown} runs "
                         "are"])
    spec_yaml = spec.to_yaml()
    digest = remembered.key("forecasts", [spec_yaml, backend], spec.to_dict())
    kept = remembered.load(digest) if digest else None
    if kept is not None:
        return Forecast.from_dict(kept)
    try:
        request = json.dumps({"spec": spec_yaml, "backend": backend})
        done = children.run("studio_core.training.forecast", input=request, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as error:
        raise SpecError([f"shape forecast: did not finish within {timeout:g} s"]) from error
    if done.returncode == REFUSED:  # the data cannot train as set: what to change
        raise SpecError([f"shape forecast: {p}" for p in json.loads(done.stdout.strip().splitlines()[-1])["problems"]])
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-6:])
        raise SpecError([f"shape forecast failed: {tail}"])
    found = json.loads(done.stdout.strip().splitlines()[-1])
    if digest:
        remembered.save(digest, found)
    return Forecast.from_dict(found)


def forecast(spec: RunSpec, backend: str) -> Forecast:
    """Walk the run's batches through its own TRL trainer (in this process: imports TRL).
    `backend` is the run's: the walk runs on this CPU, so TRL's device-dependent
    pad_to_multiple_of "auto" is resolved here by TRL's own rule (128 on neuron)."""
    import trl
    from transformers import AutoTokenizer

    from studio_core.training.train_data import load_datasets

    model_path = str(sources.builtin_folder(spec.model_name_or_path) or spec.model_name_or_path)
    remote = bool(spec.args.get("trust_remote_code"))
    if sources.is_vision_model(spec.model_name_or_path):  # its processor puts each image's tokens in, as in the run
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(model_path, trust_remote_code=remote)
        tokenizer = processor.tokenizer
    else:
        processor = tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=remote)
    dataset, eval_dataset = load_datasets(spec, shapes_only=True)
    entry = spec.trainer_entry
    model_fields = {f.name for f in dataclasses.fields(trl.ModelConfig)} | {
        f.name for f in dataclasses.fields(trl.ScriptArguments)}
    args = {k: v for k, v in spec.args.items() if k not in model_fields and k not in NOT_FOR_DATA
            and not k.startswith(NOT_FOR_DATA_PREFIXES)}
    if "pad_to_multiple_of" in args:  # the walk runs on this CPU: "auto" resolved for the run's device
        args["pad_to_multiple_of"] = padding.resolve(args["pad_to_multiple_of"], backend)
    dp = max(1, spec.layout.nproc // max(1, spec.layout.tp_size))
    with tempfile.TemporaryDirectory() as scratch:
        def build(**changes):
            config = getattr(trl, entry.config_class)(output_dir=scratch, use_cpu=True, report_to="none",
                                                      save_strategy="no", **{**args, **changes})
            extra = {"ref_model": _stand_in_model(tokenizer)} if entry.reference_model else {}
            return getattr(trl, entry.trainer_class)(model=_stand_in_model(tokenizer, entry.task), args=config,
                                                     train_dataset=dataset, eval_dataset=eval_dataset,
                                                     processing_class=processor, **extra)

        trainer = build()
        updates = _updates(trainer, dp)
        try:
            walk = _walk(trainer, updates, dp)
        except (ValueError, TypeError):  # as the processor fails on a sample cut inside its image
            cut = _images_cut(trainer) if getattr(trainer, "_is_vision_dataset", False) else None
            if cut is None:
                raise
            raise SpecError([cut]) from None
        lengths = _lengths(trainer, dataset, tokenizer)
        max_length = trainer.args.max_length
        result = Forecast(
            trainer=spec.trainer, shapes=_shape_list(walk["shapes"]), micro_batches=walk["micro_batches"],
            steps=walk["steps"], capped=walk["capped"], real_tokens=walk["real"], padded_tokens=walk["padded"],
            lengths=lengths, max_length=max_length,
            truncated=sum(length > max_length for length in lengths) if max_length else 0,
            data_parallel=dp, busiest_rank_shapes=walk["busiest"])
        result.suggestions = _suggestions(result, trainer, updates, dp, build)
        if eval_dataset is not None:
            result.eval_shapes, result.eval_batches = _walk_eval(trainer)
    return result


def _stand_in_model(tokenizer, task: str = "text-generation"):
    """A one-layer Qwen3 with the tokenizer's vocabulary: enough for TRL to build its trainer (a
    sequence classifier with one score for a reward model)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3ForSequenceClassification

    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=8, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return Qwen3ForCausalLM(config) if task == "text-generation" else Qwen3ForSequenceClassification(config)


class _Seen(Exception):
    """Raised by the stand-in's forward pre-hook: the shape is read, the forward is not needed."""


def _updates(trainer, dp: int) -> int:
    """The optimizer steps the run makes, as Trainer counts them."""
    args = trainer.args
    per_rank = math.ceil(len(trainer.get_train_dataloader()) / dp)
    per_epoch = max(1, math.ceil(per_rank / args.gradient_accumulation_steps))
    return args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * per_epoch)


def _walk(trainer, updates: int, dp: int) -> dict:
    """Every batch of the run, through the trainer's loss code to the model's door."""
    from transformers import set_seed

    # The run's Trainer seeds torch as it starts and draws its first order after that. A length-
    # grouped sampler shuffles with torch's global generator, so each walk starts from that seed.
    set_seed(trainer.args.seed)
    seen: list = []

    def hook(module, args, kwargs):
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        real = int(mask.sum()) if mask is not None and mask.dim() == 2 else ids.numel()
        seen.append((tuple(ids.shape), real, ids.numel()))
        raise _Seen

    models = [m for m in (trainer.model, getattr(trainer, "ref_model", None)) if m is not None]
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in models]
    accum = trainer.args.gradient_accumulation_steps
    loader = trainer.get_train_dataloader()
    shapes, ranks = Counter(), [set() for _ in range(dp)]
    real = padded = micro = steps = 0
    try:
        while steps < updates and micro < MAX_MICRO_BATCHES:
            epoch = _Epoch(loader, trainer, seen)  # the sampler reseeds itself per pass, as in training
            per_rank = math.ceil(len(loader) / dp)
            for start in range(0, per_rank, accum):
                if steps >= updates or micro >= MAX_MICRO_BATCHES:
                    break
                for rank_batch in range(start, min(start + accum, per_rank)):
                    for rank in range(dp):  # accelerate's even_batches: the short last round wraps around
                        shape, batch_real, batch_padded = epoch[(rank_batch * dp + rank) % len(loader)]
                        shapes[shape] += 1
                        ranks[rank].add(shape)
                        real, padded, micro = real + batch_real, padded + batch_padded, micro + 1
                steps += 1
            if steps < updates:
                epoch.finish()
    finally:
        for handle in handles:
            handle.remove()
    return {"shapes": shapes, "micro_batches": micro, "steps": steps, "capped": steps < updates,
            "real": real, "padded": padded, "busiest": max(len(r) for r in ranks)}


def _walk_eval(trainer) -> tuple[list[list[int]], int]:
    """One evaluation's batches (every evaluation walks the same ones, in order): their shapes."""
    seen: list = []

    def hook(module, args, kwargs):
        seen.append(tuple(kwargs["input_ids"].shape))
        raise _Seen

    shapes = Counter()
    models = [m for m in (trainer.model, getattr(trainer, "ref_model", None)) if m is not None]
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in models]
    try:
        for batch in trainer.get_eval_dataloader():
            del seen[:]
            try:
                trainer.compute_loss(trainer.model, batch)
            except _Seen:
                shapes[seen[0]] += 1
    finally:
        for handle in handles:
            handle.remove()
    return _shape_list(shapes), sum(shapes.values())


class _Epoch:
    """One pass of the data loader, read as far as needed: for each batch, (shape, real
    tokens, computed tokens) of what reaches the model."""

    def __init__(self, loader, trainer, seen: list):
        self.batches, self.trainer, self.seen, self.read = iter(loader), trainer, seen, []

    def __getitem__(self, index: int):
        while len(self.read) <= index:
            batch = next(self.batches)
            del self.seen[:]
            try:
                self.trainer.compute_loss(self.trainer.model, batch)
                raise RuntimeError("the trainer's loss code did not call the model for a batch")
            except _Seen:  # the pre-hook has read the shape and stopped the forward
                self.read.append(self.seen[0])
        return self.read[index]

    def finish(self) -> None:
        """Run the pass to its end, so the sampler moves on to the next epoch's order."""
        for _ in self.batches:
            pass


def _lengths(trainer, dataset, tokenizer) -> list[int]:
    """Each sample's tokenized length as the trainer tokenizes it, before truncation and packing."""
    columns, rows = trainer.train_dataset.column_names, trainer.train_dataset
    prompts = rows["prompt_ids"] if "prompt_ids" in columns else [[]] * len(rows)
    # DPO, reward modeling and KTO truncate in their collators, so their prepared rows are whole
    if "chosen_ids" in columns:
        return [len(p) + max(len(c), len(r)) for p, c, r in zip(prompts, rows["chosen_ids"], rows["rejected_ids"])]
    if "completion_ids" in columns and "input_ids" not in columns:
        return [len(p) + len(c) for p, c in zip(prompts, rows["completion_ids"])]
    if getattr(trainer, "_is_vision_dataset", False):  # images and text go through the processor in the collator
        return _vision_lengths(trainer)
    args = trainer.args
    kept = args.max_length
    args.max_length = None  # not a copy of the config: making one resets accelerate's state
    try:
        whole = trainer._prepare_dataset(dataset, tokenizer, args, False, None, "train")
    finally:
        args.max_length = kept
    return [len(ids) for ids in whole["input_ids"]]


def _uncut_samples(trainer) -> list[dict]:
    """Each vision sample as TRL's vision collator makes it, image tokens included (the processor
    puts them in), before truncation: the collator run on the sample alone, with no max_length."""
    collator = trainer.data_collator
    kept = collator.max_length
    collator.max_length = None
    try:
        return [collator([dict(row)]) for row in trainer.train_dataset]
    finally:
        collator.max_length = kept


def _vision_lengths(trainer) -> list[int]:
    """Each vision sample's length before truncation (_uncut_samples), its padding left out."""
    return [int(sample["attention_mask"].sum()) for sample in _uncut_samples(trainer)]


def _images_cut(trainer) -> str | None:
    """What to set when max_length cuts into samples' image tokens (None when it cuts none): the
    processor refuses such a batch (LLaVA's: ValueError "Mismatch in `image` token count between text
    and `input_ids`"; Idefics3's: a TypeError), and the run would stop at its first one. Where each
    sample's image tokens end, from the collator with no max_length (_uncut_samples)."""
    limit, token = trainer.data_collator.max_length, getattr(trainer.processing_class, "image_token_id", None)
    if limit is None or token is None:
        return None
    ids = [sample["input_ids"][0].tolist() for sample in _uncut_samples(trainer)]
    ends = [max((i + 1 for i, t in enumerate(row) if t == token), default=0) for row in ids]
    cut = sum(end > limit for end in ends)
    if not cut:
        return None
    return (f"max_length: {limit} cuts into the image tokens of {cut} of {len(ends)} samples, which the model's "
            "processor refuses: the run would stop at its first batch holding one; set max_length to at least "
            f"{max(ends)} (where the last sample's image tokens end; the text after them needs more), or null")


def _suggestions(current: Forecast, trainer, updates: int, dp: int, build) -> list[dict]:
    """Settings that cut compilations or padding, each with its effect from a real walk and what it
    costs the data. Ranked: little padding (up to LITTLE_WASTE) first, and among those what keeps
    each sample whole in a row of its own (padding, then length grouping, which changes only the
    order) before packing, which cuts samples across rows and lets a row's samples attend to one
    another; then the fewest shapes, then the least padding."""
    args, collator = trainer.args, trainer.data_collator
    multiple = getattr(collator, "pad_to_multiple_of", None)
    packing = getattr(args, "packing", False)
    grouped = getattr(args, "train_sampling_strategy", None) == "group_by_length"
    limit, samples = current.max_length, len(current.lengths)
    cut = (f"{current.truncated} of {samples} samples cut at max_length {limit}, as now" if limit
           else "no max_length: none cut")
    vision = getattr(trainer, "_is_vision_dataset", False)
    # a VLM's processor truncates and pads in one call, and refuses a max_length that is not a multiple
    fits = [m for m in BUCKETS if (limit or m + 1) > m and not (vision and limit and limit % m)]
    candidates = [({"pad_to_multiple_of": m}, f"pads each batch up to a multiple of {m} tokens", 0,
                   f"none beyond padding: the same batches in the same order; {cut}")
                  for m in fits if m != multiple]  # (settings, why, rank of its cost to the data, that cost)
    if limit and multiple != limit and not packing:
        candidates.append(({"pad_to_multiple_of": limit}, f"pads every batch to max_length {limit}: one shape", 0,
                           f"none beyond padding: the same batches in the same order; {cut}"))
    if "input_ids" in trainer.train_dataset.column_names and not packing:  # the sampler's lengths: SFT's rows
        order = _grouped_order(trainer)
        candidates += [({"train_sampling_strategy": "group_by_length", "pad_to_multiple_of": m},
                        f"batches of like lengths, each padded up to a multiple of {m} tokens", 1, f"{order}; {cut}")
                       for m in GROUPED_BUCKETS if (limit or m + 1) > m and not (grouped and m == multiple)]
    found = []
    for settings, why, rank, cost in candidates:
        with _changed(trainer, settings):
            found.append((settings, why, rank, cost, current.truncated, _walk(trainer, updates, dp)))
    if hasattr(args, "packing_strategy") and limit and not packing and not vision:  # SFT packs (no images)
        packed = build(packing=True, packing_strategy="wrapped")
        split = _split_by_rows(current.lengths, limit)
        found.append(({"packing": True, "packing_strategy": "wrapped"},
                      f"joins samples into rows of max_length {limit}: one shape, padding only in the last rows", 2,
                      f"samples end to end in data order, cut every {limit} tokens: about {split} of {samples} "
                      "samples split across rows, and a row's samples attend to one another (wrapped packing "
                      "keeps no boundary); none cut off at max_length", 0, _walk(packed, _updates(packed, dp), dp)))
    ranked, cheapest = [], {}  # cheapest: (graphs, waste) -> the least cost to the data that gets them
    for settings, why, rank, cost, truncated, walk in found:
        graphs = len(walk["shapes"])
        waste = round(1 - walk["real"] / walk["padded"] if walk["padded"] else 0.0, 4)
        if graphs < current.graphs or waste < current.waste - 0.05:
            cheapest[graphs, waste] = min(cheapest.get((graphs, waste), rank), rank)
            over = waste > LITTLE_WASTE  # over it, what the data pays no longer decides the order
            ranked.append(((over, 0 if over else rank, graphs, waste), rank,
                           {"set": settings, "graphs": graphs, "waste": waste, "why": why,
                            "truncated": truncated, "cost": cost}))
    # a dearer way to the same shapes and waste is left out (grouping when padding alone does it)
    return [s for _, rank, s in sorted(ranked, key=lambda entry: entry[0])
            if rank == cheapest[s["graphs"], s["waste"]]]


@contextlib.contextmanager
def _changed(trainer, settings: dict):
    """The trainer with a suggestion's collator padding and sampling strategy, for one walk."""
    collator, args = trainer.data_collator, trainer.args
    kept = collator.pad_to_multiple_of, getattr(args, "train_sampling_strategy", None)
    collator.pad_to_multiple_of = settings.get("pad_to_multiple_of", kept[0])
    if "train_sampling_strategy" in settings:  # the sampler is made anew by each walk's data loader
        args.train_sampling_strategy = settings["train_sampling_strategy"]
    try:
        yield trainer
    finally:
        collator.pad_to_multiple_of = kept[0]
        if "train_sampling_strategy" in settings:
            args.train_sampling_strategy = kept[1]


def _grouped_order(trainer) -> str:
    """What length grouping does to the order, with this run's megabatch (Transformers'
    get_length_grouped_indices: at most 50 batches, at least 4 megabatches)."""
    batch = trainer.args.train_batch_size * trainer.args.gradient_accumulation_steps
    mega = max(1, min(len(trainer.train_dataset) // (batch * 4), 50))
    return (f"order: shuffled, then sorted by length within megabatches of {mega} batches ({mega * batch} samples), "
            "the longest batch first, so a batch holds samples of like length rather than a random draw")


def _split_by_rows(lengths: list[int], row: int) -> int:
    """Samples that wrapped packing (every sample end to end, cut each `row` tokens) splits."""
    split = end = 0
    for length in lengths:
        start, end = end, end + length
        split += start // row != (end - 1) // row
    return split


def _shape_list(shapes: Counter) -> list[list[int]]:
    return [[*shape, n] for shape, n in shapes.most_common()]


def _main() -> None:
    from studio_core.recipe.spec import read_yaml

    request = json.load(sys.stdin)
    try:
        result = forecast(RunSpec.from_dict(read_yaml(request["spec"])), request["backend"])
    except SpecError as error:  # what to change, said without a traceback
        print(json.dumps({"problems": error.problems}))
        sys.exit(REFUSED)
    print(json.dumps(dataclasses.asdict(result)))


if __name__ == "__main__":
    from studio_core.machine.children import skip_final_collection

    skip_final_collection()
    _main()
