"""Device memory per core, estimated before launch from a model's config alone (no weights):
published Trainium layouts are accepted, one clearly too small is refused with changes that fit,
and a config the estimate cannot count says so without blocking the launch. Pure planning, fed
with real instance descriptions (bench/memory.py compares the estimate with measured peaks)."""

from __future__ import annotations

import pytest

from studio_core.machine.hardware import Hardware, instance_hardware
from studio_core.recipe.spec import Layout, RunSpec
from studio_core.training.memory import estimate, read_shape
from studio_core.training.plan import plan

pytestmark = pytest.mark.fast

# Qwen3's config.json values (huggingface.co/Qwen/Qwen3-0.6B and Qwen3-8B), the sizes the estimate reads
QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
             "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True}
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False}


HEAD = "LM head (logits in tiles)"
GIB, MIB = 2**30, 2**20


def planned(config, instance="trn2.3xlarge", trainer="sft", studio=None, lnc=2, **args):
    spec = RunSpec.from_dict({"model_name_or_path": "Qwen/Qwen3-0.6B", "dataset_name": "builtin:qa",
                              **args, "studio": {"trainer": trainer, **(studio or {})}})
    return plan(spec, instance_hardware(instance, lnc=lnc), model_config=config)


def whole_head(config, batch) -> int:
    return planned(config, per_device_train_batch_size=batch, gradient_checkpointing=False).memory.parts[HEAD]


def memory_errors(launch) -> list[str]:
    return [e for e in launch.errors if e.startswith("device memory")]


def memory_warnings(launch) -> list[str]:
    return [w for w in launch.warnings if w.startswith("device memory")]


def test_the_parameters_counted_from_the_config_are_the_models():
    assert read_shape(QWEN3_06B)[0].params() == pytest.approx(596e6, rel=0.01)  # Qwen3-0.6B: 0.6B with embeddings
    assert read_shape(QWEN3_8B)[0].params() == pytest.approx(8.19e9, rel=0.01)  # Qwen3-8B: 8.2B


def test_trls_qwen3_06b_on_one_core_is_accepted():
    """TRL's Trainium guide: Qwen3-0.6B SFT, batch 4, one NeuronCore of a trn2.3xlarge (24 GiB at LNC=2)."""
    launch = planned(QWEN3_06B, per_device_train_batch_size=4)
    assert memory_errors(launch) == [] and launch.memory.available == 24 * 2**30
    assert 0.3 < launch.memory.fraction < 0.9, launch.memory.describe()
    assert "96 GiB of HBM per chip shared by its 4 logical cores at LNC=2" in launch.describe()


def test_the_qwen3_8b_tp4_fsdp8_layout_is_accepted_and_sharded():
    """The Neuron guide's recipe: Qwen3-8B, TP 4 x FSDP 8 = 32 processes, bf16, max_length 2048, batch 4."""
    launch = planned(QWEN3_8B, "trn2.48xlarge", per_device_train_batch_size=4, max_length=2048, dtype="bfloat16",
                     studio={"nproc": 32, "tp_size": 4, "fsdp_size": 8})
    assert memory_errors(launch) == [], launch.errors
    parts = launch.memory.parts
    # TP splits the layers (not the embeddings, counted whole: the conservative side), FSDP everything
    assert 8.19e9 * 2 / 32 < parts["weights"] < 8.19e9 * 2 / 8
    assert "a layer gathered by FSDP" in parts


def test_qwen3_8b_on_one_core_is_refused_saying_what_would_fit():
    launch = planned(QWEN3_8B, per_device_train_batch_size=4)
    [error] = memory_errors(launch)
    assert error.startswith("device memory: the run needs about ") and "of 24.0 GiB" in error
    assert "it would run out of memory after compiling" in error
    # 32 GB of float32 weights alone: no single change fits on one trn2.3xlarge core
    assert "No one change fits" in error
    smaller = planned(QWEN3_06B, per_device_train_batch_size=32, max_length=4096)
    [error] = memory_errors(smaller)
    assert "It fits with any one of: " in error and "per_device_train_batch_size: " in error
    fits = error.split("It fits with any one of: ")[1].split("; ")
    assert all(idea.endswith("%)") for idea in fits), fits


def test_each_part_moves_the_way_it_should():
    base = planned(QWEN3_06B, per_device_train_batch_size=2).memory
    lora = planned(QWEN3_06B, per_device_train_batch_size=2, use_peft=True).memory
    assert lora.parts["gradients"] < base.parts["gradients"] / 50 and "LoRA adapters" in lora.parts
    # the frozen head gets no float32 gradient of its 151936 x 1024 weight (without checkpointing its
    # tiles are counted whole beside every layer's activations, the same for both)
    whole = {"per_device_train_batch_size": 2, "gradient_checkpointing": False}
    full_head = planned(QWEN3_06B, **whole).memory.parts[HEAD]
    assert full_head - planned(QWEN3_06B, **whole, use_peft=True).memory.parts[HEAD] == 151936 * 1024 * 4
    # with checkpointing the head's tiles and the recomputed layer are never alive together
    assert base.parts[HEAD] <= whole_head(QWEN3_06B, 2)
    eager = planned(QWEN3_06B, per_device_train_batch_size=2, gradient_checkpointing=False).memory
    assert eager.parts["activations"] > 5 * base.parts["activations (gradient checkpointing)"]
    dpo = planned(QWEN3_06B, trainer="dpo", per_device_train_batch_size=2).memory
    assert dpo.parts["reference model"] == dpo.parts["weights"]
    assert dpo.parts[HEAD] > base.parts[HEAD]  # the chosen and the rejected answers: twice the rows of logits
    assert "reference model" not in planned(QWEN3_06B, trainer="dpo", use_peft=True).memory.parts
    grpo = planned(QWEN3_06B, trainer="grpo", per_device_train_batch_size=4, max_completion_length=128,
                   model_init_kwargs={"dtype": "bfloat16"}, rewards=None).memory
    assert grpo.parts["generation cache"] > 0 and grpo.parts["weights"] == pytest.approx(596e6 * 2, rel=0.01)
    tp = planned(QWEN3_06B, per_device_train_batch_size=2, studio={"nproc": 2, "tp_size": 2}).memory
    assert tp.parts["weights"] < base.parts["weights"]


@pytest.mark.parametrize("config, said", [
    (None, "the model's config.json could not be read"),
    ({"architectures": ["MambaForCausalLM"], "model_type": "mamba", "hidden_size": 768},
     "its architecture (mamba) is not one the estimate knows how to count"),
    ({"model_type": "llama", "hidden_size": 64}, "its config.json lacks a size the estimate needs"),
])
def test_a_config_it_cannot_count_is_said_and_blocks_nothing(config, said):
    launch = planned(config)
    assert memory_errors(launch) == [] and launch.memory.parts == {}
    assert said in launch.describe()


def test_a_reward_model_scores_instead_of_predicting_the_vocabulary():
    sft = planned(QWEN3_06B, per_device_train_batch_size=2).memory
    reward = planned(QWEN3_06B, trainer="reward", per_device_train_batch_size=2).memory
    assert HEAD in sft.parts and HEAD not in reward.parts


def test_a_run_without_max_length_is_counted_at_trls_default_and_says_so():
    off = planned(QWEN3_06B, per_device_train_batch_size=1, max_length=None).memory
    default = planned(QWEN3_06B, per_device_train_batch_size=1).memory
    assert off.parts == default.parts  # both counted at 1024 tokens
    assert any("max_length is off: counted as 1024" in item for item in off.not_counted)
    assert default.not_counted == []


def test_the_lm_heads_tiles_are_trls():
    """The estimate counts TRL's fused LM head by its tile sizes, copied from TRL's source."""
    from trl.kernels import chunked_logprob
    from trl.trainer import utils

    from studio_core.training.memory import TOKEN_CHUNK, VOCAB_CHUNK

    assert (TOKEN_CHUNK, VOCAB_CHUNK) == (chunked_logprob.TOKEN_CHUNK_SIZE, utils._CHUNKED_LOGPROB_CHUNK_SIZE)


def test_at_lnc_1_a_cores_12_gib_are_a_fair_share_of_its_bank_and_the_bank_is_the_limit():
    """A trn2 chip's 96 GiB are four 24 GiB HBM banks, each shared by two physical cores. At LNC=1 a
    core's 12 GiB is a fair share: a run over it fits only beside an idle or small neighbour (a
    warning), over the bank it cannot fit (an error). At LNC=2 a core is two physical cores, a bank."""
    lnc1 = planned(QWEN3_06B, lnc=1, per_device_train_batch_size=16)
    assert memory_errors(lnc1) == [], lnc1.errors
    assert 14 * GIB < lnc1.memory.total < 18 * GIB, lnc1.memory.describe()
    assert (lnc1.memory.available, lnc1.memory.limit) == (12 * GIB, 24 * GIB)
    [warning] = memory_warnings(lnc1)
    assert "over a core's fair share at LNC=1" in warning
    assert "it fits only if the neighbouring core of the same 24.0 GiB HBM bank is idle or uses less than" in warning
    assert "up to 24.0 GiB: the whole HBM bank a core shares with its neighbouring core at LNC=1" in lnc1.describe()

    from app.core_map import memory_html  # the Train tab's bar: a warning's colour, not an error's

    bar = memory_html(lnc1.memory, 1)
    assert "#cb4b16" in bar and "#dc322f'>" not in bar and "fits only while the core sharing its memory bank" in bar

    too_big = planned(QWEN3_06B, lnc=1, per_device_train_batch_size=8, gradient_checkpointing=False)
    assert 34 * GIB < too_big.memory.total < 42 * GIB, too_big.memory.describe()  # over the 24 GiB bank
    [error] = memory_errors(too_big)
    assert "of 24.0 GiB, the whole HBM bank a core shares at LNC=1" in error and "run out of memory" in error
    assert "color:#dc322f'>" in memory_html(too_big.memory, 1)

    lnc2 = planned(QWEN3_06B, per_device_train_batch_size=16)
    assert 14 * GIB < lnc2.memory.total < 18 * GIB
    assert (lnc2.memory.available, lnc2.memory.limit) == (24 * GIB, None)  # a bank to itself
    assert memory_errors(lnc2) == [] and memory_warnings(lnc2) == []


def test_at_lnc_1_a_runs_own_ranks_fill_its_banks_so_its_fair_share_is_its_limit():
    """Two ranks at LNC=1 take an aligned pair of cores, the two of one bank: neither is idle."""
    pair = planned(QWEN3_06B, lnc=1, per_device_train_batch_size=16, studio={"nproc": 2})
    [error] = memory_errors(pair)
    assert "at LNC=1 the run's own ranks share each 24.0 GiB HBM bank" in error
    assert pair.memory.limit is None and pair.memory.total > 12 * GIB


RUNTIME = ("runtime microcode", "runtime scratchpad", "runtime DMA rings")


def test_the_neuron_runtimes_fixed_costs_are_counted_on_neuron_alone_and_said_with_their_source():
    args = {"per_device_train_batch_size": 4, "bf16": True}
    trn2 = instance_hardware("trn2.3xlarge")
    cpu = Hardware("cpu", 4, cpu_count=4, host_memory_gib=64.0)
    one = estimate("sft", Layout(), args, trn2, QWEN3_06B)
    kept = one.parts["activations (gradient checkpointing)"]
    # 96 MiB of microcode per physical core: two per logical core at LNC=2, one at LNC=1
    assert one.parts["runtime microcode"] == 2 * 96 * MIB
    assert estimate("sft", Layout(), args, instance_hardware("trn2.3xlarge", lnc=1), QWEN3_06B).parts[
        "runtime microcode"] == 96 * MIB
    # the scratchpad: the largest graph's activations, in whole 512 MiB pages
    assert one.parts["runtime scratchpad"] % (512 * MIB) == 0
    assert kept <= one.parts["runtime scratchpad"] < kept + 512 * MIB
    # DMA rings: a margin; collectives buffers only where the run has more than one process
    assert one.parts["runtime DMA rings"] == 64 * MIB and "runtime DMA rings and collectives" not in one.parts
    two = estimate("sft", Layout(nproc=2, fsdp_size=2), args, trn2, QWEN3_06B)
    assert two.parts["runtime DMA rings and collectives"] == (64 + 256) * MIB
    assert one.total == sum(one.parts.values())
    # on the CPU none of them, and every other part as on Neuron (bench/memory.py's ratios hold)
    on_cpu = estimate("sft", Layout(), args, cpu, QWEN3_06B)
    assert not any(name.startswith("runtime") for name in on_cpu.parts)
    assert on_cpu.parts == {name: size for name, size in one.parts.items() if not name.startswith(RUNTIME)}
    assert one.total - on_cpu.total == sum(one.parts[name] for name in RUNTIME)
    # the plan's memory section says each term and where its size comes from
    text = planned(QWEN3_06B, per_device_train_batch_size=4).describe()
    assert "runtime microcode: 192 MiB (96 MiB per physical core, 2 per core at LNC=2)" in text
    assert "runtime scratchpad: 1.00 GiB (as large as the largest compiled graph's activations" in text
    assert "runtime DMA rings: 64 MiB (a margin, no documented size" in text


def saved_per_token(config: dict, tokens: tuple[int, int], lora: dict | None = None) -> float:
    """Elements autograd saves for the backward pass per token in one decoder layer of a real
    Transformers model: the saved tensors of a two-layer model's forward less a one-layer model's,
    each storage once, the weights left out."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    def saved(layers: int) -> int:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config, num_hidden_layers=layers))
        if lora is not None:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(**lora))
        model.train()
        storages: dict[int, int] = {}

        def pack(tensor):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        ids = torch.randint(0, config["vocab_size"], tokens)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(input_ids=ids)
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return sum(size for pointer, size in storages.items() if pointer not in weights)

    return (saved(2) - saved(1)) / (tokens[0] * tokens[1]) / 4  # float32 elements


# Shapes used nowhere else (bench/memory.py's models are others): a Llama with one key-value head per
# query head, a Qwen3 whose heads are wider than its hidden size (as the built-in tiny model's are)
LLAMA_96 = {"model_type": "llama", "hidden_size": 96, "intermediate_size": 320, "num_attention_heads": 3,
            "num_key_value_heads": 3, "head_dim": 32, "vocab_size": 500}
QWEN3_48 = {"model_type": "qwen3", "hidden_size": 48, "intermediate_size": 112, "num_attention_heads": 4,
            "num_key_value_heads": 1, "head_dim": 24, "vocab_size": 300}


@pytest.mark.parametrize("config", [LLAMA_96, QWEN3_48], ids=["llama", "qwen3"])
@pytest.mark.parametrize("settings, lora", [
    ({}, None), ({"attn_implementation": "eager"}, None),
    ({"use_peft": True, "lora_r": 8, "lora_dropout": 0.1, "lora_target_modules": "all-linear"},
     {"r": 8, "lora_dropout": 0.1, "target_modules": "all-linear"}),
    ({"use_peft": True, "lora_r": 4, "lora_dropout": 0.0, "lora_target_modules": "all-linear"},
     {"r": 4, "lora_dropout": 0.0, "target_modules": "all-linear"}),
    ({"use_peft": True}, {"r": 16, "lora_dropout": 0.05})],  # TRL's defaults: PEFT picks the targets
    ids=["full-sdpa", "full-eager", "lora-dropout", "lora-no-dropout", "lora-defaults"])
def test_what_a_layer_keeps_is_what_autograd_saves(config, settings, lora):
    """The estimate's per-layer activations against the tensors a real layer saves for backward,
    within 2% (what it leaves out: a few numbers per head, such as the norms' reciprocal roots)."""
    from studio_core.training.memory import layer_kept

    batch, length = 2, 40
    model_config = {**config, "attn_implementation": settings.get("attn_implementation", "sdpa")}
    measured = saved_per_token(model_config, (batch, length), lora)
    counted = layer_kept(read_shape({**config, "num_hidden_layers": 2})[0], settings, length, tp=1)
    assert counted == pytest.approx(measured, rel=0.02), (counted, measured)


def test_loras_default_targets_are_pefts():
    """TRL hands PEFT no target_modules unless lora_target_modules is set: PEFT then adapts its own
    choice for the family, which the estimate counts (parameters and what the adapters keep)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_TARGETS

    from studio_core.training.memory import DEFAULT_LORA_TARGETS, lora_targets

    for family in ("llama", "qwen2", "qwen3", "mistral", "gemma"):
        assert sorted(PEFT_TARGETS[family]) == sorted(DEFAULT_LORA_TARGETS), family
    assert lora_targets({}) == DEFAULT_LORA_TARGETS and len(lora_targets({"lora_target_modules": "all-linear"})) == 7
