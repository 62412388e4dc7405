"""Will it fit? Device memory per core, estimated before launch from the model's config alone.

No weights are read: the sizes come from config.json (hidden size, layers, heads, vocabulary,
MLP width, experts), so a model that is not on this machine is estimated through its config.
The estimate is for the busiest core (rank 0) and counts, per core:

- weights: every parameter in its load dtype (TRL loads in float32 unless `dtype` or
  `model_init_kwargs.dtype` says otherwise); the decoder layers' share split by TP, everything
  split by FSDP (which gathers one whole layer at a time for its forward and backward);
- gradients and optimizer state of what trains (AdamW: two states per trained parameter, in
  the parameter's dtype, as torch.optim.AdamW keeps them); LoRA trains only its adapters,
  which PEFT keeps in float32, and leaves the base weights frozen;
- activations: what the backward pass keeps of each layer per token, all layers without
  gradient checkpointing, else each layer's input plus one layer recomputed (TRL's trainers
  turn it on by default); the LM head, which TRL computes in tiles of the logits (TILE_COPIES),
  with the float32 gradients of its weight and of the hidden states, often the biggest part;
  attention scores too with eager attention;
- a reference model for DPO and KTO when the whole model trains (with LoRA the base is the
  reference); DPO's batches hold the chosen and the rejected answers, twice the sequences;
- a vision-language model's vision tower and projector (vision_parts): their weights, what
  trains of them, and their activations for one image per sample;
- for GRPO and RLOO the generation's KV cache (keys and values of every layer for every
  sequence generated at once, prompt plus completion).

- on Neuron only, the Neuron runtime's own fixed costs (runtime_costs): its microcode, its
  scratchpad, and a margin for DMA rings and collectives buffers (each term's source is beside it).

It does not count allocator fragmentation or what the sizes above miss: the check leaves 10% for
them (over 90% is a warning). Lengths are the longest a batch can be (`max_length`), so a run
whose batches are shorter uses less.

Device memory per core (Hardware): on Trainium the chip's HBM shared by its logical cores
(hardware.py's instance table: a Trainium2 chip has 96 GiB and 4 logical cores at LNC=2, so
24 GiB each; 12 GiB at LNC=1); on the CPU the host's memory shared by the run's processes; on
CUDA unknown here (the estimate is shown without a limit). The HBM is four banks (stacks), each
serving two physical cores: at LNC=2 a logical core is those two cores and has its bank alone; at
LNC=1 a core's 12 GiB is a fair share of the bank it shares with its neighbour, not a limit (a core
can use the whole bank when its neighbour does not). So at LNC=1 the estimate is held against
the fair share, a run over it but within the bank is a warning, and over the bank an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from studio_core.data.model_check import size_problem
from studio_core.recipe import trainers

GIB = 2**30
WARN_FRACTION = 0.9
MEMORY_ERROR = "device memory: "  # how the plan's memory error begins
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}
# Decoder-only families whose layers are attention + a gated MLP (gate, up, down) with RMSNorm,
# counted from their config's keys. Others are not counted (said, and the launch goes on).
GATED = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
         "gemma3_text", "phi3", "olmo", "olmo2", "granite", "smollm3", "ministral", "helium", "glm", "cohere"}
QK_NORM = {"qwen3", "qwen3_moe", "olmo2", "gemma3_text"}  # a norm on each head's queries and keys
QKV_BIAS = {"qwen2", "qwen2_moe"}
ARCHITECTURE_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                      "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                      "MixtralForCausalLM": "mixtral", "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2",
                      "Phi3ForCausalLM": "phi3", "OlmoForCausalLM": "olmo", "Olmo2ForCausalLM": "olmo2",
                      "GraniteForCausalLM": "granite", "SmolLM3ForCausalLM": "smollm3"}
ADAM_STATES = 2
DEFAULT_LENGTH = 1024  # TRL's max_length, what a run without one is counted at
# TRL's trainers score tokens through a fused LM head (trl/trainer/utils.py add_fused_lm_head, its
# kernel trl/kernels/chunked_logprob.py ChunkedLogProbFunction): the logits are never whole, but
# computed tile by tile, [up to TOKEN_CHUNK rows, up to VOCAB_CHUNK columns], in the compute dtype,
# forward and again in backward, with the gradients of the hidden states and of the head's weight
# (only where it trains: not with LoRA, ChunkedLogProbFunction.backward's needs_input_grad)
# accumulated in float32. Without Triton (on the CPU, and on Neuron) the tile goes through plain
# torch ops: 8.5 tiles' worth at its peak, measured on this machine's CPU in float32 (34 bytes per
# tile element, fitted over vocabularies of 8,000 to 64,000 and 256 to 2,048 tokens:
# bench/memory.py). Assumed to scale with the compute dtype on Neuron, where it is not measured.
TOKEN_CHUNK = 4096  # trl/kernels/chunked_logprob.py TOKEN_CHUNK_SIZE (tests/test_memory.py checks both)
VOCAB_CHUNK = 32768  # trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE
TILE_COPIES = 8.5
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_LORA_TARGETS = ["q_proj", "v_proj"]  # PEFT's for Llama, Qwen2/3, Mistral, Gemma (tests/test_memory.py)
# The Neuron runtime's own device memory (AWS Neuron docs, "Neuron Device Memory",
# awsdocs-neuron.readthedocs-hosted.com/en/latest/neuron-runtime/explore/device-memory.html; its
# categories: tensors, model constants, model code, profile buffers, scratchpad, DMA rings,
# collectives). Counted per logical core, on Neuron only (runtime_costs):
# - model code includes a microcode overhead of 96 MB per physical NeuronCore (the page's out-of-
#   memory table shows 96.065MB of model code on a core that loaded two tiny NEFFs); its MB are MiB
#   (its 512 MB scratchpad page is 536870912 bytes). A logical core at LNC=2 is 2 physical cores.
# - scratchpad: where a running NEFF spills what does not fit on chip; "for a training workload,
#   scratchpad usage is usually determined by the size of activation between forward and backward
#   layer". The runtime keeps one shared scratchpad per core, as large as the largest scratchpad of
#   the NEFFs loaded on it, allocated in pages (512 MB by default, NEURON_SCRATCHPAD_PAGE_SIZE).
#   Estimated as the activations term (computed for the longest batch: the largest compiled
#   shape), rounded up to whole pages. Variables larger than a page get private allocations on top
#   (the page's "non-shared scratchpad"): not counted.
# - DMA rings (descriptors of the NEFFs' data movements) and collectives buffers: the page gives
#   no size (its examples show tens to hundreds of KB per small NEFF), so a margin, said to be one:
#   DMA_MARGIN always, COLLECTIVES_MARGIN more where the run has more than one process.
# - profile buffers (about 2 GB while neuron-profile captures): not counted, runs do not profile.
MICROCODE = 96 * 2**20  # per physical NeuronCore
SCRATCHPAD_PAGE = 512 * 2**20
DMA_MARGIN = 64 * 2**20  # a margin, not a documented size
COLLECTIVES_MARGIN = 256 * 2**20  # a margin, not a documented size
# Trainium2 and Trainium3 chips have 4 HBM stacks for their 8 physical cores (AWS Neuron docs, NKI's
# "Trainium2 Architecture Guide", nki/arch/trainium2_arch.html, and "Trainium3 Architecture Guide",
# nki/about/trainium3_arch.html). At LNC=1 two neighbouring cores share an
# HBM stack, and a core can run out of memory earlier than expected depending on what its
# neighbour loaded ("Neuron Device Memory", its Logical Neuron Cores note, shown for trn2; trn3 is
# assumed alike). So a core's even share at LNC=1 is half a stack, and its limit the whole stack.
HBM_BANKS_PER_CHIP = 4


@dataclass(frozen=True)
class Shape:
    """A decoder's sizes, read from its config."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    experts: int = 0  # 0: a dense MLP
    expert_intermediate: int = 0

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int, int]]:
        """Each linear layer of one decoder layer: (in, out, copies)."""
        h, width = self.hidden, self.expert_intermediate if self.experts else self.intermediate
        copies = self.experts or 1
        return {"q_proj": (h, self.q_width, 1), "k_proj": (h, self.kv_width, 1), "v_proj": (h, self.kv_width, 1),
                "o_proj": (self.q_width, h, 1), "gate_proj": (h, width, copies), "up_proj": (h, width, copies),
                "down_proj": (width, h, copies)}

    def layer_params(self) -> int:
        linear = sum(i * o * n for i, o, n in self.linear_shapes().values())
        bias = self.q_width + 2 * self.kv_width if self.model_type in QKV_BIAS else 0
        norms = 2 * self.hidden + (2 * self.head_dim if self.model_type in QK_NORM else 0)
        router = self.hidden * self.experts
        return linear + bias + norms + router

    def other_params(self) -> int:
        """Embeddings, the LM head (when not tied to them) and the final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        return self.layers * self.layer_params() + self.other_params()


def read_shape(config: dict | None) -> tuple[Shape | None, str]:
    """The decoder's sizes, or None and what could not be read: a size the config lacks, or one
    that is there but not a whole number above 0 (said as it is: data.model_check's rule)."""
    if not isinstance(config, dict):
        return None, "the model's config.json could not be read"
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    architectures = config.get("architectures")
    names = [a for a in (architectures if isinstance(architectures, list) else [architectures]) if isinstance(a, str)]
    model_type = text.get("model_type") if isinstance(text.get("model_type"), str) else None
    model_type = model_type or next((ARCHITECTURE_TYPES[a] for a in names if a in ARCHITECTURE_TYPES), None)
    if model_type not in GATED:
        return None, (f"its architecture ({model_type or ', '.join(names) or 'unknown'})"
                      " is not one the estimate knows how to count")
    try:
        hidden, heads = config_size(text, "hidden_size"), config_size(text, "num_attention_heads")
        experts = config_size(text, "num_experts", config_size(text, "num_local_experts", 0, least=0), least=0)
        intermediate = config_size(text, "intermediate_size")
        layers, kv_heads = config_size(text, "num_hidden_layers"), config_size(text, "num_key_value_heads", heads)
        shape = Shape(model_type, hidden, layers, heads, kv_heads, config_size(text, "head_dim", hidden // heads),
                      intermediate, config_size(text, "vocab_size", 151936),
                      tied(config, text), experts,
                      config_size(text, "moe_intermediate_size", intermediate) if experts else 0)
    except KeyError as error:
        return None, f"its config.json lacks a size the estimate needs ({error.args[0]})"
    except ValueError as error:
        return None, f"its config.json's {error}"
    return shape, ""


def tied(config: dict, text: dict) -> bool:
    """Whether the LM head is the embeddings: a composite model's (a VLM's) own setting says it for
    its text model (Transformers ties at the top), else the text model's."""
    if text is not config and "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    return bool(text.get("tie_word_embeddings", False))


def config_size(config: dict, key: str, default: int | None = None, least: int = 1) -> int:
    """A size of the config, or `default` where it has none (null counts as none); KeyError where
    it has none and there is no default, ValueError (saying what it is) where it is no size."""
    value = config.get(key)
    if value is None:
        if default is None:
            raise KeyError(key)
        return default
    problem = size_problem(key, value, least)
    if problem:
        raise ValueError(problem)
    return value


@dataclass
class Estimate:
    """Bytes per core by part, for the busiest core; `available` None when unknown."""

    parts: dict[str, int] = field(default_factory=dict)
    available: int | None = None
    available_source: str = ""
    not_counted: list[str] = field(default_factory=list)  # what it could not count, said
    # At LNC=1 on Trainium, the most a core can use (its HBM bank, when the neighbour sharing it
    # uses none); `available` is then its fair share. None: `available` is the limit.
    limit: int | None = None
    limit_source: str = ""
    notes: dict[str, str] = field(default_factory=dict)  # a part's name: where its size comes from

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def fraction(self) -> float | None:
        return self.total / self.available if self.available and self.parts else None

    def record(self) -> dict:
        """What launch.json keeps of it: bytes per core in all and by part, what a core has."""
        return {"bytes": self.total if self.parts else None, "parts": self.parts, "available": self.available,
                "limit": self.limit, "not_counted": self.not_counted}

    def describe(self) -> list[str]:
        if not self.parts:
            return [f"  not estimated: {'; '.join(self.not_counted)}"]
        lines = [f"  {gib(self.total)} of {gib(self.available) if self.available else 'an unknown amount'}"
                 f"{f' ({self.fraction:.0%})' if self.fraction is not None else ''} per core"
                 f"{f': {self.available_source}' if self.available_source else ''}"]
        if self.limit_source:
            lines.append(f"  {f'up to {gib(self.limit)}' if self.limit else 'no more'}: {self.limit_source}")
        lines += [f"    {name}: {gib(size)}{f' ({self.notes[name]})' if name in self.notes else ''}"
                  for name, size in self.parts.items() if size]
        lines += [f"  not counted: {item}" for item in self.not_counted]
        return lines


def gib(size: float) -> str:
    """Bytes in the unit device memory is sold in: 742 MiB, 2.22 GiB, 15.1 GiB."""
    if size < GIB:
        return f"{size / 2**20:.0f} MiB"
    return f"{size / GIB:.2f} GiB" if size < 10 * GIB else f"{size / GIB:.1f} GiB"


def dtype_bytes(args: dict, shape_config: dict | None) -> int:
    """What the weights are loaded in: the recipe's dtype, else TRL's default, float32."""
    wanted = (args.get("model_init_kwargs") or {}).get("dtype") or args.get("dtype") or "float32"
    if wanted == "auto":
        wanted = (shape_config or {}).get("dtype") or (shape_config or {}).get("torch_dtype") or "float32"
    return DTYPE_BYTES.get(str(wanted).removeprefix("torch."), 4)


def lora_params(shape: Shape, args: dict) -> int:
    """Parameters of the LoRA adapters on one decoder layer: r x (in + out) per targeted linear."""
    rank, names = int(args.get("lora_r") or 16), lora_targets(args)
    return sum(rank * (i + o) * n for name, (i, o, n) in shape.linear_shapes().items() if name in names)


def lora_targets(args: dict) -> list[str]:
    """The decoder layer's linears LoRA adapts: "all-linear", or those named; by default PEFT's own
    choice for these families (TRL passes no target_modules: peft/utils/constants.py's
    TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING names the queries and values)."""
    targets = args.get("lora_target_modules") or DEFAULT_LORA_TARGETS
    return list(LINEARS) if targets in ("all-linear", ["all-linear"]) else [
        name for name in LINEARS if name in (targets if isinstance(targets, list) else [targets])]


def per_core_available(hardware, nproc: int) -> tuple[int | None, str]:
    if hardware.backend == "neuron" and hardware.chip_memory_gib and hardware.chips and hardware.devices:
        per_chip = hardware.devices // hardware.chips
        return (hardware.chip_memory_gib * GIB // per_chip,
                f"{hardware.chip_memory_gib} GiB of HBM per chip shared by its {per_chip} logical cores at "
                f"LNC={hardware.lnc}")
    if hardware.backend == "cpu" and hardware.host_memory_gib:
        return (int(hardware.host_memory_gib * GIB / max(nproc, 1)),
                f"this machine's {hardware.host_memory_gib:g} GiB of memory shared by the run's {nproc} process(es)")
    return None, ""


def bank_limit(hardware, nproc: int) -> tuple[int | None, str]:
    """The most one core can use where it shares an HBM bank with other cores (Trainium at LNC=1):
    the whole bank, when they use none of it. (None, "") where a core has its memory to itself;
    (None, why) where the run's own ranks fill its banks."""
    if hardware.backend != "neuron" or not (hardware.chip_memory_gib and hardware.chips and hardware.devices
                                            and hardware.lnc):
        return None, ""
    physical_per_bank = hardware.devices // hardware.chips * hardware.lnc // HBM_BANKS_PER_CHIP
    if physical_per_bank <= hardware.lnc:  # a logical core has its bank (or more) to itself
        return None, ""
    bank, others = hardware.chip_memory_gib * GIB // HBM_BANKS_PER_CHIP, physical_per_bank // hardware.lnc - 1
    neighbours = "its neighbouring core" if others == 1 else f"{others} neighbouring cores"
    if nproc > 1:  # a run's cores are a block aligned to its size (layout.py): its ranks pair up in banks
        return None, (f"at LNC={hardware.lnc} the run's own ranks share each {gib(bank)} HBM bank, so none can use "
                      "more than its share")
    return bank, (f"the whole HBM bank a core shares with {neighbours} at LNC={hardware.lnc}, if "
                  f"{'it uses' if others == 1 else 'they use'} none of it (the share above is a fair share, the "
                  "figure the plan holds a run to)")


def runtime_costs(hardware, layout, activations_bytes: float) -> tuple[dict[str, int], dict[str, str]]:
    """The Neuron runtime's fixed costs on one logical core, and where each size comes from (the
    sources are above MICROCODE): microcode, the shared scratchpad, DMA rings and collectives.
    Their names begin with "runtime " (biggest() leaves them out)."""
    lnc = hardware.lnc or 1
    pages = -(-int(activations_bytes) // SCRATCHPAD_PAGE)
    processes = layout.nproc * max(layout.nodes, 1)
    rings = DMA_MARGIN + (COLLECTIVES_MARGIN if processes > 1 else 0)
    rings_name = "runtime DMA rings and collectives" if processes > 1 else "runtime DMA rings"
    parts = {"runtime microcode": lnc * MICROCODE, "runtime scratchpad": pages * SCRATCHPAD_PAGE, rings_name: rings}
    notes = {"runtime microcode": f"96 MiB per physical core, {lnc} per core at LNC={lnc}",
             "runtime scratchpad": (f"as large as the largest compiled graph's activations, here the longest "
                                    f"batch's, in {SCRATCHPAD_PAGE // 2**20} MiB pages"),
             rings_name: (f"a margin, no documented size: {gib(DMA_MARGIN)} for DMA rings"
                          + (f" and {gib(COLLECTIVES_MARGIN)} for the collectives of {processes} processes"
                             if processes > 1 else ""))}
    return parts, notes


def estimate(trainer: str, layout, args: dict, hardware, config: dict | None) -> Estimate:
    """The per-core estimate of a run: `args` are the TRL arguments the plan hands the worker."""
    available, source = per_core_available(hardware, layout.nproc)
    limit, limit_source = bank_limit(hardware, layout.nproc)
    shape, why = read_shape(config)
    if shape is None:
        return Estimate(available=available, available_source=source, not_counted=[why], limit=limit,
                        limit_source=limit_source)
    tp, fsdp = max(layout.tp_size, 1), max(layout.fsdp_size, 1)
    weight = dtype_bytes(args, config)
    layer_weights = shape.layer_params() * weight
    weights = (shape.layers * layer_weights / tp + shape.other_params() * weight) / fsdp
    parts = {"weights": weights}
    if fsdp > 1:
        parts["a layer gathered by FSDP"] = layer_weights / tp
    lora = bool(args.get("use_peft"))
    if lora:
        trained, trained_bytes = shape.layers * lora_params(shape, args) / tp / fsdp, 4  # PEFT keeps adapters in fp32
        parts["LoRA adapters"] = trained * trained_bytes
    else:
        trained, trained_bytes = weights / weight, weight
    parts["gradients"] = trained * trained_bytes
    optim = str(args.get("optim") or "adamw_torch")
    parts["optimizer state"] = trained * trained_bytes * (ADAM_STATES if "adam" in optim else 0)
    entry = trainers.get(trainer)
    if entry.reference_model and not lora and not args.get("precompute_ref_log_probs"):
        parts["reference model"] = weights
    kept = activations(shape, args, entry, tp)
    parts.update(kept)
    vision, vision_unknown = vision_parts(config, args, entry, weight, lora)
    parts.update(vision)
    if entry.generates:
        parts["generation cache"] = generation_cache(shape, args, tp, weight)
    notes = {}
    if hardware.backend == "neuron":  # the CPU and CUDA backends have no such runtime
        costs, notes = runtime_costs(hardware, layout, next(iter(kept.values())))  # the layers' activations
        parts.update(costs)
    not_counted = [vision_unknown] if vision_unknown else []
    if not entry.generates and "max_length" in args and not args["max_length"]:
        not_counted.append(f"samples longer than {DEFAULT_LENGTH} tokens (max_length is off: counted as "
                           f"{DEFAULT_LENGTH}, TRL's default)")
    if optim and "adam" not in optim and "sgd" not in optim:
        not_counted.append(f"the state of optimizer {optim!r} (counted as none)")
    return Estimate({k: int(v) for k, v in parts.items()}, available, source, not_counted, limit, limit_source, notes)


def activations(shape: Shape, args: dict, entry: trainers.Trainer, tp: int) -> dict[str, float]:
    """What the backward pass keeps of the layers (layer_kept per token: all of every layer without
    gradient checkpointing; with it, each layer's input plus one layer's worth while it is
    recomputed), of the final norm, and the LM head's tiles and gradients."""
    batch = int(args.get("per_device_train_batch_size") or 8) * entry.sequences_per_example
    if entry.generates:
        length = int(args.get("max_prompt_length") or 512) + int(args.get("max_completion_length") or 256)
    else:
        length = int(args.get("max_length") or DEFAULT_LENGTH)
    tokens = batch * length
    act = 2 if args.get("bf16") or args.get("fp16") else 4
    per_layer = layer_kept(shape, args, length, tp)
    checkpointing = args.get("gradient_checkpointing", True)  # TRL's trainers default it to True
    if checkpointing:  # the recomputed layer, and the gradients its backward holds at once: the layer's
        per_layer += 2 * shape.hidden + 3 * (shape.expert_intermediate or shape.intermediate) / tp  # output's and
        # input's, and at the MLP's widest the down projection's input's with the gate's and up projection's
    layers = shape.layers * shape.hidden + per_layer if checkpointing else shape.layers * per_layer
    # the final norm keeps its input and output (the head's input), and its normalised input where it trains
    kept = layers + (2 if args.get("use_peft") else 3) * shape.hidden
    name = "activations (gradient checkpointing)" if checkpointing else "activations"
    if not entry.chats:  # a reward model's head gives one score per token: nothing to count
        return {name: tokens * kept * act}
    tile = min(tokens, TOKEN_CHUNK) * min(shape.vocab, VOCAB_CHUNK) * TILE_COPIES * act
    if checkpointing:  # the head's backward frees its tiles before the last layer is recomputed: the
        tile = max(tile - tokens * per_layer * act, 0)  # two are never alive together, count the larger
    # float32 gradients of the hidden states, and of the head's weight unless it is frozen (LoRA)
    gradients = (tokens + (0 if args.get("use_peft") else shape.vocab)) * shape.hidden * 4
    return {name: tokens * kept * act, "LM head (logits in tiles)": tile + gradients}


def layer_kept(shape: Shape, args: dict, length: int, tp: int) -> float:
    """Elements one decoder layer keeps for its backward pass, per token: the tensors autograd
    saves in Transformers' Llama and Qwen3 layers, counted by tensor (torch's saved-tensor hooks:
    bench/memory.py's notes). A weight that trains needs its input kept, a frozen one does not;
    TP splits the attention heads and the MLP's width, not the hidden states."""
    h, q, kv = shape.hidden, shape.q_width / tp, shape.kv_width / tp
    width = (shape.expert_intermediate if shape.experts else shape.intermediate) / tp
    normed = 1 if shape.model_type in QK_NORM else 0  # Qwen3's norm on each head's queries and keys
    # trained or frozen: each norm's input (the layer's input, and the residual after attention); the
    # queries and keys as rotated, the values and attention's output (what attention reads and gives);
    # the query and key projections where a norm follows them; the MLP's gate, activation and up projection
    kept = 2 * h + (2 + normed) * (q + kv) + 3 * width
    if args.get("use_peft"):
        kept += lora_kept(shape, args, q, width)
    else:  # trained weights: the norms' normalised inputs and their outputs (the linears' inputs), the
        kept += 4 * h + normed * (q + kv) + width  # q and k norms' normalised inputs, the down projection's input
    if args.get("attn_implementation") == "eager":
        # the softmax's probabilities, (heads x length) per token, and the keys and values repeated
        # to every query head (repeat_kv) where heads share them; sdpa keeps neither
        kept += shape.heads / tp * length + (2 * (q - kv) if kv < q else 0)
    return kept


def lora_kept(shape: Shape, args: dict, q: float, width: float) -> float:
    """What LoRA's adapters add per token to a frozen layer: each adapted linear's adapter input
    (with dropout, its own dropped-out copy of the input and the dropout's mask, which torch makes
    a tensor of the input's dtype on the CPU; without, the linear's input, shared by the linears
    that read it) and its rank-r projection."""
    rank, dropout = int(args.get("lora_r") or 16), float(args.get("lora_dropout", 0.05) or 0)
    h, names = shape.hidden, lora_targets(args)
    inputs = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": q, "gate_proj": h, "up_proj": h, "down_proj": width}
    if dropout > 0:
        return sum(2 * inputs[name] + rank for name in names)
    shared = {"attention": h if {"q_proj", "k_proj", "v_proj"} & set(names) else 0,
              "mlp": h if {"gate_proj", "up_proj"} & set(names) else 0,
              "down": width if "down_proj" in names else 0}  # o_proj's input, attention's output, is kept anyway
    return sum(shared.values()) + rank * len(names)


def vision_parts(config: dict, args: dict, entry: trainers.Trainer, weight: int,
                 lora: bool) -> tuple[dict[str, float], str]:
    """A vision-language model's vision tower and projector (LLaVA's: a ViT of `vision_config`'s
    sizes, then two linears to the text model's width): their weights, their gradients and
    optimizer state where the whole model trains (LoRA: counted frozen), and what the tower's
    layers keep for the backward pass for one image of `image_size` per sample (layer_kept on the
    tower's sizes: its attention sees the image's patches, its MLP is counted as wide as a gated
    one, a little above a ViT's). -> (parts, what could not be counted or "")."""
    vision = config.get("vision_config") if isinstance(config, dict) else None
    if not isinstance(vision, dict):
        return {}, ""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    try:
        h, layers = config_size(vision, "hidden_size"), config_size(vision, "num_hidden_layers")
        heads, width = config_size(vision, "num_attention_heads"), config_size(vision, "intermediate_size")
        patch, image = config_size(vision, "patch_size"), config_size(vision, "image_size")
        text_hidden, channels = config_size(text, "hidden_size"), config_size(vision, "num_channels", 3)
    except (KeyError, ValueError) as error:
        return {}, f"the vision tower (its vision_config: {error})"
    per_image = (image // patch) ** 2
    tower = layers * (4 * h * h + 2 * h * width + 9 * h + width) + (channels * patch * patch + per_image + 3) * h
    params = tower + h * text_hidden + text_hidden * text_hidden + 2 * text_hidden  # the projector
    parts = {"vision tower and projector": params * weight}
    if not lora:
        parts["their gradients and optimizer state"] = params * weight * (1 + ADAM_STATES)
    shape = Shape("vision", h, layers, heads, heads, h // heads, width, 0, True)
    images = int(args.get("per_device_train_batch_size") or 8) * entry.sequences_per_example
    per_layer = layer_kept(shape, args, per_image, 1)
    checkpointing = args.get("gradient_checkpointing", True)
    kept = layers * h + per_layer if checkpointing else layers * per_layer
    act = 2 if args.get("bf16") or args.get("fp16") else 4
    parts["vision activations"] = images * per_image * kept * act
    return parts, ""


def generation_cache(shape: Shape, args: dict, tp: int, weight: int) -> float:
    """Keys and values of every layer for the sequences generated at once (prompt + completion)."""
    batch = int(args.get("per_device_train_batch_size") or 8) * int(
        args.get("steps_per_generation") or args.get("gradient_accumulation_steps") or 1)
    length = int(args.get("max_prompt_length") or 512) + int(args.get("max_completion_length") or 256)
    return 2 * shape.layers * shape.kv_width / tp * batch * length * weight


def problems(est: Estimate, trainer: str, layout, args: dict, hardware, config) -> tuple[list[str], list[str]]:
    """(errors, warnings): over the core's memory is refused with the smallest changes that fit;
    over 90% is a warning. Where a core shares its HBM bank (Trainium at LNC=1), over its fair share
    but within the bank is a warning (it fits only beside an idle or small neighbour), over the
    bank an error."""
    fraction = est.fraction
    if fraction is None or fraction <= WARN_FRACTION:  # fits; or not estimated, or no limit known (said)
        return [], []
    fitting = fixes(trainer, layout, args, hardware, config)
    change = ("It fits with any one of: " + "; ".join(fitting)) if fitting else (
        "No one change fits: combine LoRA (use_peft: true), more TP or FSDP cores, a smaller batch and a shorter "
        "max_length, or use a bigger instance")
    limit = est.limit or est.available
    if est.total > limit:
        when = " after compiling" if hardware.backend == "neuron" else ""
        whole = f", the whole HBM bank a core shares at LNC={hardware.lnc}" if est.limit else ""
        why = f"; {est.limit_source}" if est.limit_source and not est.limit else ""
        return [f"{MEMORY_ERROR}the run needs about {gib(est.total)} per core of {gib(limit)}{whole} "
                f"({est.total / limit:.0%}; {biggest(est)}): it would run out of memory{when}{why}. {change}"], []
    said = f"the run needs about {gib(est.total)} per core of {gib(est.available)} ({fraction:.0%}; {biggest(est)})"
    if fraction > 1:  # over the fair share, within the bank
        return [], [f"{MEMORY_ERROR}{said}, over a core's fair share at LNC={hardware.lnc}: it fits only if the "
                    f"neighbouring core of the same {gib(limit)} HBM bank is idle or uses less than "
                    f"{gib(limit - est.total)} (at LNC=2 each core has a bank to itself). {change}"]
    return [], [f"{MEMORY_ERROR}{said}: little is left for what the estimate does not count (allocator "
                f"fragmentation). {change}"]


def biggest(est: Estimate) -> str:
    """The largest part the run's settings size: the runtime's follow them (its scratchpad is the
    activations again), so naming them would point away from what to change."""
    name, size = max(((n, s) for n, s in est.parts.items() if not n.startswith("runtime ")), key=lambda item: item[1])
    return f"most of it {name}, {gib(size)}"


def fixes(trainer: str, layout, args: dict, hardware, config) -> list[str]:
    """Single changes that bring the run under 90% of a core's memory, each the smallest of its
    kind, with the share it would use."""
    shape, _ = read_shape(config)
    tries = []
    if not args.get("use_peft"):
        tries.append(["use_peft: true (LoRA)", (layout, {**args, "use_peft": True})])
    if args.get("gradient_checkpointing") is False:
        tries.append(["gradient_checkpointing: true", (layout, {**args, "gradient_checkpointing": True})])
    for key in ("tp_size", "fsdp_size"):
        size = getattr(layout, key)
        for more in (2, 4, 8, 16, 32, 64):
            bigger = replace(layout, **{key: size * more}, nproc=layout.nproc * more)
            if bigger.nproc > hardware.cores or (key == "tp_size" and shape and shape.kv_heads % bigger.tp_size):
                break
            tries.append([f"studio.{key}: {size * more} with studio.nproc: {bigger.nproc}", (bigger, args)])
    batch, accumulate = int(args.get("per_device_train_batch_size") or 8), int(
        args.get("gradient_accumulation_steps") or 1)
    while batch > 1:
        batch //= 2
        tries.append([f"per_device_train_batch_size: {batch} (gradient_accumulation_steps: "
                      f"{accumulate * int(args.get('per_device_train_batch_size') or 8) // batch} keeps the batch)",
                      (layout, {**args, "per_device_train_batch_size": batch})])
    length = int(args.get("max_length") or DEFAULT_LENGTH)
    while length > 128 and not trainers.get(trainer).generates:  # generating runs' lengths are their own
        length //= 2
        tries.append([f"max_length: {length}", (layout, {**args, "max_length": length})])
    found, kinds = [], set()
    for said, (new_layout, new_args) in tries:
        kind = said.split(":")[0]
        if kind in kinds:
            continue  # the smallest change of this kind already fits
        fraction = estimate(trainer, new_layout, new_args, hardware, config).fraction
        if fraction is not None and fraction <= WARN_FRACTION:
            found.append(f"{said} ({fraction:.0%})")
            kinds.add(kind)
    return found
