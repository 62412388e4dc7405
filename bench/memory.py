"""The plan's memory estimate (studio_core/training/memory.py) against the memory real runs used.

Run from the repository root (about 9 minutes on 2 CPU cores):

    .venv/bin/python bench/memory.py             # every case
    .venv/bin/python bench/memory.py --quick     # three cases

Each case is a real run of the studio on this machine's CPU (RunManager.start: the plan, its
estimate in launch.json, the supervisor, torchrun, TRL's trainer), 3 steps. Its worker measures
rank 0's peak (the `peak_memory` event: on the CPU the model's tensors plus the resident-memory
high-water mark above its level when training began, studio_core/training/peak_memory.py; the
bench sets MALLOC_MMAP_THRESHOLD_ so that freed tensors leave the resident memory). The bench prints each
case's estimate, measurement and their ratio, and writes every figure to
bench/results/memory-<time>.json. The goal: within 20% (ratio 0.8 to 1.2) for each case.

Models: the built-in tiny model, and two made here from small Qwen3 configs (random weights, the
built-in tokenizer; the config's vocabulary is larger than the tokenizer's, as a model's may
be): "q40m" (hidden 512, 8 layers, vocabulary 32,000: 41M parameters) and "q90m" (hidden 768,
10 layers, vocabulary 64,000: 112M). Data: conversations whose answer is long enough that every
sample is cut at max_length, so the batches are as long as the estimate assumes (it counts the
longest a batch can be). Full and LoRA, batch 1 and 4, lengths 256 and 512, SFT and DPO, and one
SFT run compiled (torch_compile: Inductor on the CPU; on Neuron the compiler is another).
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

MODELS = {"q40m": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
                   "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32000},
          "q90m": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 10, "num_attention_heads": 12,
                   "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 64000}}
# (model, trainer, LoRA, batch, max_length, torch_compile)
CASES = [("builtin", "sft", False, 4, 512, False), ("q40m", "sft", False, 1, 256, False),
         ("q40m", "sft", False, 4, 512, False), ("q40m", "sft", True, 4, 512, False),
         ("q40m", "dpo", False, 1, 256, False), ("q40m", "dpo", True, 4, 256, False),
         ("q90m", "sft", False, 4, 256, False), ("q90m", "sft", True, 1, 512, False),
         ("q90m", "dpo", False, 4, 256, False), ("q40m", "sft", False, 4, 512, True)]
QUICK = [CASES[2], CASES[3], CASES[4]]
WORDS = "the of and to in is was for on that with as by at from his an were are which this be".split()


def build_model(name: str, folder: Path) -> str:
    """A Qwen3 model of the given sizes, random weights, the built-in tokenizer beside it."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tiny = ensure_tiny_model()
    torch.manual_seed(0)
    config = Qwen3Config(**MODELS[name], tie_word_embeddings=True, max_position_embeddings=2048, dtype="float32")
    Qwen3ForCausalLM(config).save_pretrained(folder)
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
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    data = write_data(work)
    models = {"builtin": "builtin:tiny-qwen3"}
    manager, hardware = RunManager(work / "runs"), cpu_hardware()
    report["cases"] = []
    for model, trainer, lora, batch, length, compiled in (QUICK if args.quick else CASES):
        if model not in models:
            models[model] = build_model(model, work / model)
        spec = RunSpec.from_dict({
            "model_name_or_path": models[model], "dataset_name": data[trainer], "max_steps": 3,
            "per_device_train_batch_size": batch, "max_length": length, "use_peft": lora, "save_strategy": "no",
            "logging_steps": 1, "torch_compile": compiled, "studio": {"trainer": trainer}})
        view, state, _ = run_until_final(manager, spec, hardware, timeout_s=600)
        if state != "finished":
            raise BenchError(f"{model} {trainer} run {view.id} ended {state}: {view.error_text}")
        estimate = view.launch()["memory"]["bytes"]
        peak = (view.peak_memory or {}).get("bytes")
        if not estimate or not peak:
            raise BenchError(f"run {view.id}: no estimate ({estimate}) or no measured peak ({view.peak_memory})")
        report["cases"].append({"model": model, "trainer": trainer, "lora": lora, "batch": batch, "length": length,
                                "compiled": compiled, "estimate": estimate, "parts": view.launch()["memory"]["parts"],
                                "measured": peak,
                                "ratio": estimate / peak, "run": view.id})
        print_case(report["cases"][-1])


def print_case(case: dict) -> None:
    kind = "LoRA" if case["lora"] else "full"
    what = f"{case['model']:8} {case['trainer']:4} {kind:4} b{case['batch']} L{case['length']}" + \
        (" compiled" if case.get("compiled") else "")
    within = "ok" if 0.8 <= case["ratio"] <= 1.2 else "OUTSIDE 20%"
    print(f"{what:35} estimate {gib(case['estimate']):>9}  measured {gib(case['measured']):>9}  "
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
    parser.add_argument("--keep", action="store_true", help="keep the runs folder and the models made")
    return run_bench("memory", parser.parse_args(), measure, print_report)


if __name__ == "__main__":
    sys.exit(main())
