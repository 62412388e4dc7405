"""Does the tiny VLM learn builtin:shapes with TRL's SFTTrainer on the CPU?

Run from the repository root (about 2 minutes on 2 idle cores; 600 steps):

    .venv/bin/python bench/vlm_learns.py                 # full fine-tuning
    .venv/bin/python bench/vlm_learns.py --lora          # LoRA adapters (peft) instead
    .venv/bin/python bench/vlm_learns.py --steps 50      # a quick look

It builds builtin:tiny-vlm and builtin:shapes into the studio's cache (STUDIO_CACHE_DIR), then
prints: the held-out loss (test.jsonl, assistant tokens only) and the held-out exact match
(greedy generation, answers lower-cased with the final full stop dropped) before and after
training, the training loss of the first and last logged steps, and steps/s. Guessing scores
1 in 9 (3 shapes x 3 colours).

Measured on 2 shared CPU cores (torch 2.13, transformers 5.24, trl 1.16): full fine-tuning, 600 steps
at 6.6 steps/s: train loss 6.70 -> 0.015, held-out exact match 0% -> 98.9%. LoRA (r=16), 600 steps:
loss 6.71 -> 3.82, exact match 0% -> 67.8% (colour always right, shape often wrong).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub is imported
sys.path.insert(0, str(REPO))

from studio_core.data.builtin_images import ensure_shapes_dataset, load_shapes_split  # noqa: E402
from studio_core.data.builtin_vlm import ensure_tiny_vlm  # noqa: E402


def normalize(text: str) -> str:
    return " ".join(text.lower().strip().rstrip(".").split())


def exact_match(model, processor, dataset, batch_size: int = 60) -> float:
    """Share of rows whose greedy answer equals the reference answer, after normalize()."""
    import torch

    from trl.data_utils import prepare_multimodal_messages

    model.eval()
    processor.tokenizer.padding_side = "left"  # generation continues from the end of each row
    hits = 0
    for start in range(0, len(dataset), batch_size):
        rows = dataset[start:start + batch_size]
        prompts = [prepare_multimodal_messages(messages[:-1], images=images)
                   for messages, images in zip(rows["messages"], rows["images"])]
        inputs = processor.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True,
                                               return_dict=True, return_tensors="pt",
                                               processor_kwargs={"padding": True})
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        answers = processor.tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1]:],
                                                   skip_special_tokens=True)
        references = [messages[-1]["content"][0]["text"] for messages in rows["messages"]]
        hits += sum(normalize(a) == normalize(r) for a, r in zip(answers, references))
    processor.tokenizer.padding_side = "right"
    model.train()
    return hits / len(dataset)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=None, help="default 1e-3 (full), 5e-3 (LoRA)")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters instead of every weight")
    options = parser.parse_args()

    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import SFTConfig, SFTTrainer

    start = time.perf_counter()
    model_folder, data_folder = ensure_tiny_vlm(), ensure_shapes_dataset()
    print(f"built (or found) in {time.perf_counter() - start:.1f}s: {model_folder}, {data_folder}")
    train, test = load_shapes_split("train"), load_shapes_split("test")
    processor = AutoProcessor.from_pretrained(model_folder)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(model_folder)
    print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()):,} parameters; "
          f"train {len(train)} rows, test {len(test)} rows")

    peft_config = None
    if options.lora:
        from peft import LoraConfig

        # The base weights are random: the projector (new in every VLM fine-tune anyway) trains in
        # full, and so does the final norm, else the frozen random embeddings (the tied output layer)
        # keep every logit near zero and the loss near log(vocab) whatever the adapters learn.
        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                 modules_to_save=["multi_modal_projector", "language_model.norm"], task_type="CAUSAL_LM")
    learning_rate = options.lr or (5e-3 if options.lora else 1e-3)
    with tempfile.TemporaryDirectory(prefix="vlm_learns-") as output_dir:
        config = SFTConfig(
            output_dir=output_dir,
            max_steps=options.steps,
            per_device_train_batch_size=options.batch_size,
            per_device_eval_batch_size=60,
            learning_rate=learning_rate,
            lr_scheduler_type="cosine",
            warmup_steps=min(20, options.steps // 10),
            logging_steps=10,
            assistant_only_loss=True,  # the loss on the answer only, not on the prompt or image tokens
            max_length=None,  # never truncate: cutting image tokens breaks the forward pass
            gradient_checkpointing=False,  # TRL turns it on by default; pointless at this size
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        trainer = SFTTrainer(model=model, args=config, train_dataset=train, eval_dataset=test,
                             processing_class=processor, peft_config=peft_config)
        if options.lora:
            trainer.model.print_trainable_parameters()
        before_loss = trainer.evaluate()["eval_loss"]
        before_match = exact_match(trainer.model, processor, test)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        after_loss = trainer.evaluate()["eval_loss"]
        after_match = exact_match(trainer.model, processor, test)

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"\n{'LoRA' if options.lora else 'full'} fine-tuning, lr {learning_rate}, batch {options.batch_size}")
    print(f"train loss (mean of 10 steps): first {losses[0]:.3f}, last {losses[-1]:.3f}")
    print(f"held-out loss:        before {before_loss:.3f}, after {after_loss:.3f}")
    print(f"held-out exact match: before {before_match:.1%}, after {after_match:.1%} (chance 11.1%)")
    print(f"{options.steps} steps in {seconds:.0f}s: {options.steps / seconds:.2f} steps/s")


if __name__ == "__main__":
    main()
