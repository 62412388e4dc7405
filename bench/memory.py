"""The plan's memory estimate (studio_core/training/memory.py) against the memory real runs used.

Run from the repository root (about 30 minutes on 2 busy CPU cores):

    .venv/bin/python bench/memory.py             # every case
    .venv/bin/python bench/memory.py --quick     # three cases
    .venv/bin/python bench/memory.py --cases 11,12 --glibc-default

Each case is a real run of the studio on this machine's CPU (RunManager.start: the plan, its
estimate in launch.json, the supervisor, torchrun, TRL's trainer), 3 steps. Its worker measures
rank 0's peak (the `peak_memory` event: on the CPU the model's tensors plus the resident-memory
high-water mark above its level when training began, studio_core/training/peak_memory.py; the
bench sets MALLOC_MMAP_THRESHOLD_ so that freed tensors leave the resident memory, as a device's
allocator would count them: --glibc-default leaves glibc as a plain run has it, whose heap keeps
freed blocks, so the resident peak is up to twice the tensors'). The bench prints each case's
estimate, measurement and their ratio, and writes every figure to
bench/results/memory-<time>.json. The goal: within 20% (ratio 0.8 to 1.2) for each case.

Models: the built-in tiny model, and models made here from small Qwen3 and Llama configs (random
weights, the built-in tokenizer; the config's vocabulary may be larger than the tokenizer's, as a
model's may be), MODELS below: q40m and q90m (the first cases, on which the LM head's tile count
was measured), and others of 12M to 45M parameters with vocabularies of 1,002 to 151,936 entries,
tied and untied. Data: conversations whose answer is long enough that every sample is cut at
max_length, so the batches are as long as the estimate assumes (it counts the longest a batch can
be), and builtin:wide (lengths of 20 to 2,000 tokens) for one case. Full and LoRA, SFT and DPO,
batch x length from 1 x 128 to 8 x 512, gradient checkpointing on and off, sdpa and eager
attention, one SFT run compiled (torch_compile: Inductor on the CPU; on Neuron the compiler is
another). The per-layer activations are derived from autograd's saved tensors
(tests/test_memory.py checks them on a real layer), not fitted to these runs.
Memory is not time: the machine being busy does not change the figures, so there is no quiet gate.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import BenchError, run_bench, run_until_final  # noqa: E402
from studio_core.data.builtin import ensure_tiny_model  # noqa: E402
from studio_core.machine.hardware import cpu_hardware  # noqa: E402
from studio_core.recipe.spec import RunSpec  # noqa: E402
from studio_core.runs.manager import RunManager  # noqa: E402
from studio_core.training.memory import gib  # noqa: E402



def sizes(hidden: int, width: int, layers: int, heads: int, kv_heads: int, vocab: int) -> dict:
    return {"hidden_size": hidden, "intermediate_size": width, "num_hidden_layers": layers, "head_dim": 64,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab}


# name: (family, sizes, tied embeddings). q40m and q90m: the bench's first cases, those the LM head's
# tile count was measured on. The others only check the estimate (nothing is fitted to them): both
# families, vocabularies of 1,002 to 151,936 entries, tied and untied, narrow to wide, 2 to 12 layers.
MODELS = {"q40m": ("qwen3", sizes(512, 1536, 8, 8, 4, 32000), True),
          "q90m": ("qwen3", sizes(768, 2048, 10, 12, 4, 64000), True),
          "q26m-v1k": ("qwen3", sizes(512, 1536, 8, 8, 4, 1002), False),
          "l26m-v1k": ("llama", sizes(512, 1536, 8, 8, 4, 1002), False),
          "l45m-v8k": ("llama", sizes(768, 2048, 6, 12, 12, 8000), False),
          "q12m-v2k": ("qwen3", sizes(256, 768, 12, 4, 2, 2048), False),
          "q45m-v152k": ("qwen3", sizes(256, 768, 4, 4, 2, 151936), True)}
# (model, trainer, LoRA, batch, max_length, torch_compile, other settings): the first 10 are the
# bench's first cases, the rest check the activation model on shapes it was not derived from
VLM = {"dataset": "builtin:shapes", "assistant_only_loss": True}
CASES = [("builtin", "sft", False, 4, 512, False, {}), ("q40m", "sft", False, 1, 256, False, {}),
         ("q40m", "sft", False, 4, 512, False, {}), ("q40m", "sft", True, 4, 512, False, {}),
         ("q40m", "dpo", False, 1, 256, False, {}), ("q40m", "dpo", True, 4, 256, False, {}),
         ("q90m", "sft", False, 4, 256, False, {}), ("q90m", "sft", True, 1, 512, False, {}),
         ("q90m", "dpo", False, 4, 256, False, {}), ("q40m", "sft", False, 4, 512, True, {}),
         ("q26m-v1k", "sft", False, 8, 512, False, {}), ("l26m-v1k", "sft", True, 4, 256, False, {}),
         ("q26m-v1k", "sft", False, 2, 512, False, {"gradient_checkpointing": False}),
         ("l26m-v1k", "sft", True, 4, 512, False, {"gradient_checkpointing": False}),
         ("l45m-v8k", "sft", False, 8, 256, False, {"attn_implementation": "eager"}),
         ("q12m-v2k", "sft", True, 8, 512, False, {"gradient_checkpointing": False}),
         ("q45m-v152k", "sft", True, 1, 128, False, {}), ("q45m-v152k", "sft", True, 4, 512, False, {}),
         ("l26m-v1k", "sft", False, 8, 512, False, {"dataset": "builtin:wide"}),
         ("builtin", "sft", False, 8, 512, False, {"gradient_checkpointing": False}),
         ("builtin", "sft", True, 2, 128, False, {}),
         # the built-in VLM on its images (a sample is 91-93 tokens, 64 of them the image's): issue 49
         ("vlm", "sft", False, 16, 96, False, VLM), ("vlm", "sft", False, 32, 96, False,
                                                     {**VLM, "gradient_checkpointing": False}),
         ("vlm", "sft", True, 16, 96, False, VLM)]
QUICK = [CASES[2], CASES[3], CASES[4]]
WORDS = "the of and to in is was for on that with as by at from his an were are which this be".split()


def build_model(name: str, folder: Path) -> str:
    """A Qwen3 or Llama model of the given sizes, random weights, the built-in tokenizer beside it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    family, sizes, tied = MODELS[name]
    classes = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
    config_class, model_class = classes[family]
    tiny = ensure_tiny_model()
    torch.manual_seed(0)
    config = config_class(**sizes, tie_word_embeddings=tied, max_position_embeddings=2048, dtype="float32")
    model_class(config).save_pretrained(folder)
    for path in tiny.iterdir():
        if "token" in path.name or path.name in ("special_tokens_map.json", "chat_template.jinja", "vocab.json",
                                                 "merges.txt", "generation_config.json"):
            shutil.copy(path, folder / path.name)
    return str(folder)


def long_text(rng: random.Random, words: int = 700) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def write_data(folder: Path) -> dict[str, str]:
    """SFT conversations and DPO preference pairs, every answer long enough to be cut."""
    rng = random.Random(0)
    sft, dpo = folder / "sft.jsonl", folder / "dpo.jsonl"
    with sft.open("w") as out:
        for _ in range(32):
            out.write(json.dumps({"messages": [{"role": "user", "content": "Tell me a story."},
                                               {"role": "assistant", "content": long_text(rng)}]}) + "\n")
    with dpo.open("w") as out:
        for _ in range(32):
            prompt = [{"role": "user", "content": "Tell me a story."}]
            out.write(json.dumps({"prompt": prompt, "chosen": [{"role": "assistant", "content": long_text(rng)}],
                                  "rejected": [{"role": "assistant", "content": long_text(rng)}]}) + "\n")
    return {"sft": str(sft), "dpo": str(dpo)}


def measure(work: Path, args, report: dict) -> None:
    # The runs inherit it: glibc hands every allocation over 128 KiB straight back to the system when
    # it is freed, instead of raising that threshold as blocks are freed (up to 32 MiB) and keeping
    # them in its heap, so the resident high-water mark follows the tensors alive, not the heap's history
    if not args.glibc_default:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    report["malloc_mmap_threshold"] = os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc's default")
    data = write_data(work)
    models = {"builtin": "builtin:tiny-qwen3", "vlm": "builtin:tiny-vlm"}
    manager, hardware = RunManager(work / "runs"), cpu_hardware()
    report["cases"] = []
    for model, trainer, lora, batch, length, compiled, other in chosen(args):
        if model not in models:
            models[model] = build_model(model, work / model)
        settings = {key: value for key, value in other.items() if key != "dataset"}
        spec = RunSpec.from_dict({
            "model_name_or_path": models[model], "dataset_name": other.get("dataset", data[trainer]),
            "max_steps": 3,
            "per_device_train_batch_size": batch, "max_length": length, "use_peft": lora, "save_strategy": "no",
            "logging_steps": 1, "torch_compile": compiled, **settings, "studio": {"trainer": trainer}})
        view, state, _ = run_until_final(manager, spec, hardware, timeout_s=600)
        if state != "finished":
            raise BenchError(f"{model} {trainer} run {view.id} ended {state}: {view.error_text}")
        estimate = view.launch()["memory"]["bytes"]
        peak = (view.peak_memory or {}).get("bytes")
        if not estimate or not peak:
            raise BenchError(f"run {view.id}: no estimate ({estimate}) or no measured peak ({view.peak_memory})")
        report["cases"].append({"model": model, "trainer": trainer, "lora": lora, "batch": batch, "length": length,
                                "compiled": compiled, "other": other, "estimate": estimate,
                                "parts": view.launch()["memory"]["parts"],
                                "measured": peak,
                                "ratio": estimate / peak, "run": view.id})
        print_case(report["cases"][-1])


def chosen(args) -> list[tuple]:
    """The cases to run: --quick's three, --cases' numbers (1-based, as printed), else all."""
    if args.quick:
        return QUICK
    return [CASES[int(n) - 1] for n in args.cases.split(",")] if args.cases else CASES


def print_case(case: dict) -> None:
    kind = "LoRA" if case["lora"] else "full"
    other = case.get("other") or {}
    what = f"{case['model']:10} {case['trainer']:4} {kind:4} b{case['batch']} L{case['length']}" + \
        (" compiled" if case.get("compiled") else "") + \
        (" no-ckpt" if other.get("gradient_checkpointing") is False else "") + \
        (f" {other['attn_implementation']}" if "attn_implementation" in other else "") + \
        (f" {other['dataset']}" if "dataset" in other else "")
    within = "ok" if 0.8 <= case["ratio"] <= 1.2 else "OUTSIDE 20%"
    print(f"{what:50} estimate {gib(case['estimate']):>9}  measured {gib(case['measured']):>9}  "
          f"ratio {case['ratio']:.2f}  {within}", flush=True)


def print_report(report: dict) -> None:
    cases = report.get("cases") or []
    if not cases:
        return
    print("\nEstimate / measured peak (goal 0.8 to 1.2):")
    for case in cases:
        print_case(case)
    ratios = sorted(case["ratio"] for case in cases)
    inside = sum(0.8 <= r <= 1.2 for r in ratios)
    print(f"{inside} of {len(ratios)} within 20%; ratios {ratios[0]:.2f} to {ratios[-1]:.2f}, "
          f"median {ratios[len(ratios) // 2]:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three cases instead of all")
    parser.add_argument("--mmap-threshold", type=int, default=131072, metavar="BYTES",
                        help="MALLOC_MMAP_THRESHOLD_ for the runs (default 131072: glibc's own starting value, "
                             "fixed); a tiny model's tensors all fall under it")
    parser.add_argument("--glibc-default", action="store_true",
                        help="leave glibc's allocator as a plain run has it (freed blocks kept in its heap)")
    parser.add_argument("--cases", help="only these cases, by number (1-based): e.g. 11,12")
    parser.add_argument("--keep", action="store_true", help="keep the runs folder and the models made")
    return run_bench("memory", parser.parse_args(), measure, print_report)


if __name__ == "__main__":
    sys.exit(main())
