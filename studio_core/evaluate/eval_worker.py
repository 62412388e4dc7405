"""The evaluation process: the tuned model (and its base) answer an evaluation set's prompts.

    python -m studio_core.evaluate.eval_worker      (started by studio_core.evaluate.evaluation.EvalProcess)

The first stdin line is its setup (JSON: the target, as studio_core.serve.chat.ChatTarget, the
request, the data source, the results folder, runs folder, backend, cores). It takes its core
through the same leases as chat (kind "eval"), reads the evaluation set and checks it, and
measures its prompts with the tokenizer before loading the model: a prompt longer than the
largest bucket of the request's cache is skipped (`too_long`; none left: an error, and no model
is loaded). Then it answers every prompt with each model through the chat's generation path
(studio_core.serve.generation: static cache, prompt buckets, greedy) and scores the answers
(studio_core.evaluate.evaluation). A stdin line {"op": "stop"}, or the end of stdin (the parent is
gone), stops it after the answer in progress; what is done is saved either way. Each stdout
line is a JSON event: loaded {rows, sides, skipped}, progress {done, total, side}, done
{summary, dir}, error {message}.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from studio_core.evaluate import evaluation
from studio_core.machine import leases
from studio_core.machine.children import set_up
from studio_core.serve.chat import MAX_CACHE_LEN, shown, split_reasoning, template_kwargs
from studio_core.recipe.data_check import apply_column_map
from studio_core.serve.generation import (BUCKETS, Generator, buckets_for, cache_for, encode_vision, load_processor,
                                         load_tokenizer, on_leased_cores, render)
from studio_core.serve.images import without_images
from studio_core.training.train_data import held_out, load_split


def emit(kind: str, **fields) -> None:
    print(json.dumps({"type": kind, **fields}), flush=True)


def eval_items(source: dict, request: dict) -> tuple[list[dict], tuple]:
    """The evaluation set's items (evaluation.item) and the metrics for them, checked; ValueError
    saying what is wrong. A run's held-out rows are the ones its training left out (the same
    split of the same data with the same seed: train_data.held_out)."""
    try:
        dataset = load_split(source["name"], source.get("config"), source["split"])
    except Exception as error:  # datasets' own errors: no such split, config or dataset
        raise ValueError(f"cannot read {source['name']} (split {source['split']}): {type(error).__name__}: "
                         f"{error}") from error
    if source.get("holdout"):
        dataset = held_out(dataset, source["holdout"]["fraction"], source["holdout"]["seed"])[1]
    if request["limit"]:
        dataset = dataset.select(range(min(request["limit"], len(dataset))))
    rows = apply_column_map(dataset.to_list(), source.get("column_map"), None)
    items, metrics, problems = evaluation.items_and_problems(rows, request["metrics"], source.get("rewards"))
    if problems:
        raise ValueError("\n".join(problems))
    return items, metrics


def with_images(items: list[dict]) -> list[dict]:
    """A vision-language evaluation's items, each prompt's image placeholders filled with its row's
    images (`images`, or `image`) by TRL's own rule, as its trainer fills them in training
    (trl.data_utils.prepare_multimodal_messages: in order, or before the first user text). A row's
    images come as `datasets` stores them ({bytes, path}) and are decoded by its Image feature."""
    from datasets import Image
    from trl.data_utils import prepare_multimodal_messages

    decode = Image().decode_example
    for one in items:
        row = one["row"]
        images = row.get("images") or ([row["image"]] if row.get("image") is not None else [])
        if images:
            one["prompt"] = prepare_multimodal_messages(
                one["prompt"], images=[decode(i) if isinstance(i, dict) else i for i in images])
    return items


def prompt_lengths(target: dict, tokenizer):
    """How to count a prompt's tokens before the model loads: by the tokenizer, or a
    vision-language model's processor, which puts each image's tokens in."""
    if target.get("vision"):
        processor = load_processor(target)
        kwargs = template_kwargs(processor.tokenizer)
        return lambda prompt: len(encode_vision(processor, kwargs, prompt, image_size=target.get("image_size"))[0])
    kwargs = template_kwargs(tokenizer)
    return lambda prompt: len(render(tokenizer, kwargs, prompt))


def too_long(items: list[dict], length_of, max_cache_len: int, max_new: int) -> tuple[list[dict], dict | None]:
    """(the items whose prompt fits the cache whole, what was skipped: None if nothing). Skipped:
    {count, of, prompts: [{index, prompt_tokens}], largest_bucket, max_cache_len, message}, the
    message saying how long they are against the largest bucket and the setting that lets them in.
    `length_of`: a prompt's tokens (prompt_lengths)."""
    room = buckets_for(max_cache_len, max_new)[-1]
    lengths = [length_of(i["prompt"]) for i in items]
    over = [(index, n) for index, n in enumerate(lengths) if n > room]
    if not over:
        return items, None
    sizes = sorted({n for _, n in over})
    cache = cache_for(sizes[-1], max_new)
    fix = (f"raise the cache length to {cache} or more (--max-cache-len; the Evaluate tab's Cache length), or "
           "shorten them" if cache is not None else
           f"shorten them: a prompt over {BUCKETS[-1]} tokens (the largest bucket there is) cannot be evaluated")
    which = ", ".join(f"#{index + 1}" for index, _ in over[:8]) + (", ..." if len(over) > 8 else "")
    long = " and ".join(map(str, sizes)) if len(sizes) <= 2 else f"{sizes[0]} to {sizes[-1]}"
    reason = (f"they are {long} tokens long, over the largest prompt bucket, {room} tokens (a cache of "
              f"{max_cache_len} tokens less {max_new} for the answer); {fix}")
    message = (f"every prompt ({which}) is too long: {reason}" if len(over) == len(items) else
               f"{len(over)} of {len(items)} prompts ({which}) were not scored: {reason}")
    skipped = {"count": len(over), "of": len(items), "prompts": [{"index": i, "prompt_tokens": n} for i, n in over],
               "largest_bucket": room, "max_cache_len": max_cache_len, "message": message}
    keep = {index for index, n in enumerate(lengths) if n <= room}
    return [i for index, i in enumerate(items) if index in keep], skipped


def evaluate(model: Generator, items: list[dict], metrics, max_new: int, stop: threading.Event) -> tuple[list, list]:
    """Each model's answer and scores per item, in item order; (rows, sides)."""
    sides = ["tuned", "base"] if model.has_base else ["tuned"]
    rows = [{"prompt": without_images(i["prompt"]), "reference": i["reference"]} for i in items]
    done, total = 0, len(items) * len(sides)
    for side in sides:
        for row, one in zip(rows, items):
            if stop.is_set():
                return [r for r in rows if sides[0] in r], sides
            answer = model.generate(one["prompt"], which=side, max_new_tokens=max_new, whole=True)
            entry = {"answer": shown(split_reasoning(answer["text"], model.thinking)[1]),
                     "answer_tokens": answer["new_tokens"], "bucket": answer["bucket"]}
            if "eval_loss" in metrics and row["reference"] is not None:
                entry["reference_loss"], entry["reference_tokens"] = model.score(one["prompt"], row["reference"], side)
            if "preference_accuracy" in metrics and one.get("chosen") is not None and one.get("rejected") is not None:
                entry["chosen_loss"] = model.score(one["prompt"], one["chosen"], side)[0]
                entry["rejected_loss"] = model.score(one["prompt"], one["rejected"], side)[0]
            entry["scores"] = evaluation.scores(entry, metrics, row["reference"])
            row[side] = entry
            done += 1
            emit("progress", done=done, total=total, side=side)
    return rows, sides


def score_rewards(rewards: list, items: list[dict], rows: list[dict], sides: list[str], tokenizer) -> None:
    """The run's reward functions on each side's answers, called as its trainer calls them (a batch
    of prompts, completions in the data's format, the other columns): each one's value as
    `reward/NAME` and their weighted sum as mean_reward (None where no function applies)."""
    from transformers import TrainerState

    from studio_core.recipe.rewards import reward_functions

    funcs, weights = reward_functions(rewards)
    raw = [i["row"] for i in items[:len(rows)]]
    columns = {key: [row.get(key) for row in raw] for key in raw[0] if key != "prompt"}
    for side in (s for s in sides if all(s in r for r in rows)):
        answers = [r[side]["answer"] for r in rows]
        completions = [[{"role": "assistant", "content": a}] if isinstance(row.get("prompt"), list) else a
                       for a, row in zip(answers, raw)]
        total: list[float | None] = [None] * len(rows)
        for func, weight in zip(funcs, weights):
            values = func(prompts=[row.get("prompt") for row in raw], completions=completions,
                          completion_ids=[tokenizer(a, add_special_tokens=False)["input_ids"] for a in answers],
                          **columns, trainer_state=TrainerState(), log_extra=lambda column, values: None,
                          log_metric=lambda name, value: None)
            for index, value in enumerate(values):
                rows[index][side]["scores"][f"reward/{getattr(func, '__name__', type(func).__name__)}"] = value
                if value is not None:
                    total[index] = (total[index] or 0.0) + weight * float(value)
        for row, value in zip(rows, total):
            row[side]["scores"]["mean_reward"] = value


def main() -> int:
    setup = json.loads(sys.stdin.readline())
    target, request, source, out = setup["target"], setup["request"], setup["source"], Path(setup["out"])
    stop = threading.Event()

    def listen():  # a stop request, or the parent gone
        for line in sys.stdin:
            if json.loads(line).get("op") == "stop":
                break
        stop.set()

    threading.Thread(target=listen, name="listen", daemon=True).start()
    try:
        with on_leased_cores(setup):
            max_cache_len = request.get("max_cache_len") or MAX_CACHE_LEN
            try:
                items, metrics = eval_items(source, request)
                if target.get("vision"):
                    items = with_images(items)
            except ValueError as error:
                emit("error", message=str(error))
                return 2
            try:
                tokenizer = load_tokenizer(target)
                length_of = prompt_lengths(target, tokenizer)
            except Exception as error:
                emit("error", message=f"cannot load {target['label']}'s tokenizer: {type(error).__name__}: {error}")
                return 1
            items, skipped = too_long(items, length_of, max_cache_len, request["max_new_tokens"])
            if not items:  # said before the model is loaded: nothing would be scored
                emit("error", message=f"nothing to evaluate: {skipped['message']}")
                return 2
            try:
                model = Generator(target, setup["backend"], max_cache_len, tokenizer=tokenizer)
            except Exception as error:
                emit("error", message=f"cannot load {target['label']}: {type(error).__name__}: {error}")
                return 1
            set_up()  # imported and loaded: the collector on again (children.py)
            emit("loaded", rows=len(items), sides=["tuned", "base"] if model.has_base else ["tuned"],
                 skipped=skipped and skipped["count"])
            started = time.time()
            rows, sides = evaluate(model, items, metrics, request["max_new_tokens"], stop)
            if "mean_reward" in metrics and rows:
                try:
                    score_rewards(source["rewards"], items, rows, sides, model.tokenizer)
                except Exception as error:  # the user's reward code: said, with what else was scored
                    emit("error", message=f"a reward function failed on the answers: {type(error).__name__}: "
                         f"{error}")
                    return 1
    except leases.CoresBusy as error:
        emit("error", message=str(error))
        return 2
    summary = {"target": target["label"], "data": source["name"], "split": source["split"],
               "note": source.get("note", ""), "rows": len(rows), "of_rows": len(items),
               "stopped": len(rows) < len(items) or any(s not in r for r in rows for s in sides),
               "skipped": skipped, "metrics": list(metrics), "max_new_tokens": request["max_new_tokens"],
               "max_cache_len": max_cache_len, "greedy": True,
               "exact_match_compares": evaluation.NORMALISE,
               "buckets": sorted({r[s]["bucket"] for r in rows for s in sides if s in r}),
               "shapes": sorted(list(s) for s in model.shapes), "seconds": round(time.time() - started, 2),
               "time": started, "results": evaluation.summarise(rows, sides)}
    if request.get("tasks") and not stop.is_set():
        from studio_core.evaluate import harness

        emit("progress", done=len(items) * len(sides), total=len(items) * len(sides), side="lm-eval")
        try:  # the tuned model as loaded here (on Neuron: on its core), never loaded again by lm-eval
            summary["harness"] = harness.run_tasks(model.model, model.tokenizer, list(request["tasks"]),
                                                   include_path=request.get("task_include"), limit=request["limit"])
        except Exception as error:  # lm-eval's own failure on the user's task: said, the rest kept
            summary["harness_error"] = f"{type(error).__name__}: {error}"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / evaluation.ROWS, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    (out / evaluation.SUMMARY).write_text(json.dumps(summary, indent=2))
    emit("done", summary=summary, dir=str(out))
    return 0


if __name__ == "__main__":
    from studio_core.machine.children import collection_off, skip_final_collection

    skip_final_collection()
    collection_off()
    sys.exit(main())
