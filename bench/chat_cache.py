"""Chat generation on this CPU: static KV cache (as the chat process does it) vs Transformers' dynamic cache.

Run from the repository root (under half a minute for the tiny model, about 2 minutes for --small, on an
idle CPU core; up to a minute more when other processes load the machine, as disturbed calls are redone):

    .venv/bin/python bench/chat_cache.py                    # the built-in tiny model (~0.1M parameters)
    .venv/bin/python bench/chat_cache.py --small            # a random 8-layer, 512-wide Qwen3 (~26M), built offline
    .venv/bin/python bench/chat_cache.py --model PATH_OR_ID --rounds 2

It prints two tables and writes every figure to bench/results/chat_cache-<time>.json.

The prompts: twelve conversations in the model's chat template, about 20 to 500 tokens long (so they land
in the 64, 128, 256 and 512 buckets): small talk from builtin:chat as earlier turns, then one of the
builtin:qa questions. Each goes through `model.generate` in two ways, greedy, exactly --max-new-tokens
new tokens (min_new_tokens = max_new_tokens, so an early end-of-sequence cannot shorten a run):

    static   as studio_core/serve/generation.py does it: the prompt left-padded to its bucket (BUCKETS and
             buckets_for imported from there), cache_implementation="static", max_cache_len fixed (1024)
    dynamic  Transformers' default DynamicCache, the prompt unpadded

The calls run in a thread and a TextIteratorStreamer is read in the main thread, as in the chat. The
streamer also stamps the time of every token generate hands it, so:
- TTFT: from just before the generate thread starts to the first new token (prefill, one sampling step);
  `text`: to the first non-empty text piece, what the chat reports as ttft_s (the streamer holds text
  back until a word ends, so this can be a few tokens later).
- decode tok/s: (new tokens - 1) / (time of the last token - time of the first).
Figures are medians over prompts and rounds; the per-prompt table gives medians over rounds. One
uncounted warm-up call per mode comes first; then each round runs every prompt in both modes, the order
of the modes alternating between rounds.

Shapes: a forward pre-hook on the model (like chat_worker's `_record_shape`) records, per mode, the
distinct input_ids shapes (the figure the chat shows) and the distinct signatures: the shapes of every
tensor argument (input_ids, position ids, the 4-D attention masks) plus the KV cache's length. A graph
compiled with dynamic=False (generate's CompileConfig on Neuron) is traced once per signature; with the
dynamic cache the cache grows by one every token, so nearly every decode step is a new signature.

What these CPU figures are not: Neuron figures. In transformers 5.24, generate compiles the forward only
when `_valid_auto_compile_criteria` holds, which needs the model on cuda, xpu, neuron or tpu (or a
CompileConfig that asks for every device), and then only for the decode steps (the prefill calls the
model directly, generation/utils.py `_prefill`); on this CPU it does not hold, so both modes run the
same eager forward. The bench records generate's decision and Dynamo's frame counters and prints them;
in our runs the decision was False in every call and Dynamo compiled nothing. So the static mode here
shows the cost of padding and of attending over the whole fixed cache in eager mode, without the
compiled graph that pays for it on Neuron; and it shows nothing of compile time, which on Neuron every
new signature costs. The tiny and --small models run in float32 (the table shows the dtype; the chat
loads a model on a CPU the same way, with no dtype given); on Neuron the chat uses bfloat16.

Threads: one (--threads), as the chat process on a CPU runs: one core taken through the leases,
torch.set_num_threads(1).

Noise: on 2 cores, other processes that take the bench's core slow a call several times over, so for
each call the bench measures the cores other processes used and the share of the time its own threads
ran. A call is disturbed when others used over 0.3 cores and the bench's threads ran under 90% of the
time (others busy on the other core only are not counted, though sharing the machine still costs some
speed: column `others`, the median cores other processes used during the counted calls, says how
busy it was). A disturbed call is redone after waiting (up to 20 s) for 2 s under 0.3, at most 3 times,
while the bench's redo budget (60 s of waiting and redoing in all) lasts (column `redone`; column
`quiet` counts the calls not disturbed). When at least half of each mode's calls were quiet, the
medians leave the disturbed ones out (per prompt: unless none was quiet, marked *); else they take
every call, and a warning says so. Every try's figures are in the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from common import BenchError, Noise, own_cpu_s, run_bench, wait_quiet  # sets sys.path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

from studio_core.data.builtin import BUILTIN_DATASETS, ensure_tiny_model
from studio_core.serve.generation import buckets_for

MODES = ("static", "dynamic")
# Prompt lengths to aim at (tokens): each prompt is the longest conversation under its target.
TARGETS = (20, 45, 70, 100, 135, 180, 230, 270, 330, 400, 460, 510)
QUIET_WAIT_S, QUIET_CORES, RETRIES, REDO_BUDGET_S = 20, 0.3, 3, 60
FULL_SHARE = 0.9  # a call whose threads had their cores at least this share of the time was not starved


# --- the model and the prompts ------------------------------------------------------------------
def small_model(tokenizer):
    """A random Qwen3 of 8 layers, 512 wide, on the tiny model's tokenizer: no download, no training."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                         tie_word_embeddings=True, max_position_embeddings=4096,
                         bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, dtype="float32")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen3ForCausalLM(config).to(torch.float32)


def load(args):
    """(model, tokenizer, a name for the table)."""
    if args.small:
        tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
        return small_model(tokenizer), tokenizer, "small random Qwen3 (8 layers, 512 wide)"
    path = args.model or str(ensure_tiny_model())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)  # no dtype given, as the chat process loads it on a CPU
    return model, tokenizer, args.model or "built-in tiny model"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def encode(tokenizer, messages: list[dict]) -> list[int]:
    if not tokenizer.chat_template:
        raise BenchError("the tokenizer has no chat template; the chat needs one (pick a chat or instruct model)")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def build_prompts(tokenizer, longest: int) -> list[list[int]]:
    """Twelve prompts: earlier small-talk turns, as many as fit under each target, then a question."""
    chats = read_jsonl(BUILTIN_DATASETS["builtin:chat"])
    turns = [[m for m in row["messages"] if m["role"] != "system"] for row in chats]
    exchanges = [t[i:i + 2] for t in turns for i in range(0, len(t) - 1, 2)]  # (user, assistant) pairs
    questions = [row["messages"][0] for row in read_jsonl(BUILTIN_DATASETS["builtin:qa"])]
    prompts = []
    for n, target in enumerate(TARGETS):
        target = min(target, longest)
        history, ids = [], encode(tokenizer, [questions[n % len(questions)]])
        for k in range(len(exchanges)):
            longer = history + exchanges[(5 * n + k) % len(exchanges)]
            longer_ids = encode(tokenizer, longer + [questions[n % len(questions)]])
            if len(longer_ids) > target:
                break
            history, ids = longer, longer_ids
        prompts.append(ids[-longest:])  # a question alone over the target keeps its end, as the chat does
    return prompts


# --- what reaches the model -----------------------------------------------------------------------
def shapes_of(value, name: str, out: list) -> None:
    if torch.is_tensor(value):
        out.append((name, tuple(value.shape)))
    elif isinstance(value, dict):  # Transformers 5 passes the attention masks as {"full_attention": ...}
        for key, item in value.items():
            shapes_of(item, f"{name}.{key}", out)


class ShapeRecorder:
    """Forward pre-hook: input_ids shapes and full signatures (every tensor argument + cache length)."""

    def __init__(self) -> None:
        self.mode = None
        self.input_ids = {m: set() for m in MODES}
        self.signatures = {m: set() for m in MODES}

    def __call__(self, module, args, kwargs) -> None:
        if self.mode is None:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.input_ids[self.mode].add(tuple(ids.shape))
        shapes: list = []
        for name, value in kwargs.items():
            shapes_of(value, name, shapes)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        layers = getattr(cache, "layers", None) or [None]
        keys = getattr(layers[0], "keys", None)
        shapes.append(("cache_len", None if keys is None else keys.shape[-2]))
        self.signatures[self.mode].add(tuple(shapes))


class CompileWatch:
    """generate's auto-compile decision, observed by wrapping the model's own method (behaviour unchanged)."""

    def __init__(self, model) -> None:
        self.mode, self.decisions = None, {m: [] for m in MODES}
        original = model._valid_auto_compile_criteria

        def watched(*args, **kwargs):
            decision = original(*args, **kwargs)
            if self.mode is not None:
                self.decisions[self.mode].append(bool(decision))
            return decision

        model._valid_auto_compile_criteria = watched


def dynamo_counts() -> dict:
    """Dynamo's own counters: frames it compiled and distinct graphs it made (0 when nothing compiled)."""
    from torch._dynamo.utils import counters

    return {"frames_ok": counters["frames"]["ok"], "unique_graphs": counters["stats"]["unique_graphs"]}


# --- one call ---------------------------------------------------------------------------------------
class StampingStreamer(TextIteratorStreamer):
    """A TextIteratorStreamer that also notes when generate hands it each new token."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.token_times: list[float] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if self.prompt_seen:
            self.token_times.extend([time.perf_counter()] * value.numel())
        self.prompt_seen = True
        super().put(value)


def generate_once(model, tokenizer, ids: list[int], mode: str, args) -> dict:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if mode == "static":
        bucket = next(b for b in buckets_for(args.max_cache_len, args.max_new_tokens) if b >= len(ids))
        input_ids = torch.tensor([[pad] * (bucket - len(ids)) + ids])
        attention_mask = torch.tensor([[0] * (bucket - len(ids)) + [1] * len(ids)])
        cache = {"cache_implementation": "static", "max_cache_len": args.max_cache_len}
    else:
        input_ids, attention_mask, cache = torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), {}
    streamer = StampingStreamer(tokenizer)
    failure: list[BaseException] = []

    def run():
        try:
            with torch.inference_mode():
                model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                               max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
                               pad_token_id=pad, streamer=streamer, **cache)
        except BaseException as error:  # re-raised below, once the streamer is released
            failure.append(error)
            streamer.end()

    worker = threading.Thread(target=run, name=f"generate-{mode}", daemon=True)
    start, first_text = time.perf_counter(), None
    worker.start()
    for piece in streamer:
        if piece and first_text is None:
            first_text = time.perf_counter()
    worker.join()
    end = time.perf_counter()
    if failure:
        raise BenchError(f"{mode} generate failed: {type(failure[0]).__name__}: {failure[0]}") from failure[0]
    times = streamer.token_times
    if len(times) != args.max_new_tokens:
        raise BenchError(f"{mode}: {len(times)} new tokens instead of {args.max_new_tokens}")
    return {"fed_tokens": input_ids.shape[1], "ttft_s": times[0] - start,
            "first_text_s": None if first_text is None else first_text - start,
            "decode_tokens_per_s": (len(times) - 1) / (times[-1] - times[0]), "seconds": end - start}


def quiet_call(model, tokenizer, ids: list[int], mode: str, args, budget: dict) -> dict:
    """One call, redone (after waiting for quiet) while it was disturbed, at most RETRIES times and while
    budget["left_s"] (seconds of waiting and redoing) lasts. Disturbed: other processes used over
    QUIET_CORES cores and the bench got its cores less than FULL_SHARE of the time."""
    tries, redo_started = 1, None
    while True:
        noise = Noise()
        result = generate_once(model, tokenizer, ids, mode, args)
        others = noise.others_cores()
        own_share = (own_cpu_s() - noise.own) / max(time.monotonic() - noise.t, 1e-6) / args.threads
        disturbed = others > QUIET_CORES and own_share < FULL_SHARE
        if redo_started is not None:
            budget["left_s"] -= time.monotonic() - redo_started
        if not disturbed or tries > RETRIES or budget["left_s"] <= 0:
            return result | {"others_cores": others, "own_share": own_share, "disturbed": disturbed, "tries": tries}
        redo_started, tries = time.monotonic(), tries + 1
        wait_quiet(min(QUIET_WAIT_S, budget["left_s"]), QUIET_CORES)


# --- the bench --------------------------------------------------------------------------------------
def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def counted(calls: list[dict], quiet_only: bool) -> list[dict]:
    """The calls a median is taken over: the quiet ones when quiet_only and there are any, else all."""
    quiet = [c for c in calls if not c["disturbed"]]
    return quiet if quiet_only and quiet else calls


def measure(work: Path, args, report: dict) -> None:
    model, tokenizer, name = load(args)
    model.eval()
    torch.set_num_threads(args.threads)
    longest = buckets_for(args.max_cache_len, args.max_new_tokens)[-1]
    prompts = build_prompts(tokenizer, longest)
    buckets = [next(b for b in buckets_for(args.max_cache_len, args.max_new_tokens) if b >= len(p)) for p in prompts]
    report["settings"] = {"model": name, "parameters": sum(p.numel() for p in model.parameters()),
                          "dtype": str(model.dtype), "device": str(model.device), "threads": torch.get_num_threads(),
                          "max_cache_len": args.max_cache_len, "max_new_tokens": args.max_new_tokens,
                          "rounds": args.rounds, "buckets": buckets_for(args.max_cache_len, args.max_new_tokens),
                          "torch": torch.__version__, "transformers": __import__("transformers").__version__}
    report["prompts"] = [{"tokens": len(p), "bucket": b} for p, b in zip(prompts, buckets)]
    print(f"[bench] {name}: {report['settings']['parameters']:,} parameters; prompts of "
          f"{', '.join(str(len(p)) for p in prompts)} tokens", flush=True)

    recorder, watch = ShapeRecorder(), CompileWatch(model)
    model.register_forward_pre_hook(recorder, with_kwargs=True)
    dynamo_before = dynamo_counts()
    calls: list[dict] = []
    report["calls"] = calls  # filled as calls end: a failed bench still reports those it made
    report["warmup_s"], budget = {}, {"left_s": REDO_BUDGET_S}
    for mode in MODES:  # uncounted, but its shapes count: they reached the model
        recorder.mode = watch.mode = mode
        report["warmup_s"][mode] = generate_once(model, tokenizer, prompts[0], mode, args)["seconds"]
    for round_no in range(args.rounds):
        for mode in (MODES if round_no % 2 == 0 else MODES[::-1]):
            recorder.mode = watch.mode = mode
            for n, ids in enumerate(prompts):
                calls.append(quiet_call(model, tokenizer, ids, mode, args, budget) | {
                    "mode": mode, "round": round_no + 1, "prompt": n, "prompt_tokens": len(ids)})
            done = [c for c in calls if c["mode"] == mode and c["round"] == round_no + 1]
            print(f"[bench] round {round_no + 1} {mode:7}: TTFT {1000 * median(c['ttft_s'] for c in done):.1f} ms, "
                  f"{median(c['decode_tokens_per_s'] for c in done):.1f} tok/s, "
                  f"{sum(c['tries'] - 1 for c in done)} redone and {sum(c['disturbed'] for c in done)} still "
                  f"disturbed by other processes' load", flush=True)
    recorder.mode = watch.mode = None
    dynamo_after = dynamo_counts()

    # Medians over quiet calls only when at least half of each mode's calls were quiet: else both modes'
    # medians take every call, rather than one mode a few lucky calls and the other all of its own.
    quiet_only = report["quiet_only"] = all(
        2 * sum(not c["disturbed"] for c in calls if c["mode"] == mode) >= args.rounds * len(prompts) for mode in MODES)
    report["modes"] = {}
    for mode in MODES:
        mine = [c for c in calls if c["mode"] == mode]
        quiet = counted(mine, quiet_only)
        report["modes"][mode] = {
            "ttft_s": median(c["ttft_s"] for c in quiet), "first_text_s": median(c["first_text_s"] for c in quiet),
            "decode_tokens_per_s": median(c["decode_tokens_per_s"] for c in quiet),
            "seconds": median(c["seconds"] for c in quiet), "quiet": sum(not c["disturbed"] for c in mine),
            "others_cores": median(c["others_cores"] for c in quiet),
            "calls": len(mine), "fed_tokens": sum(c["fed_tokens"] for c in mine),
            "input_ids_shapes": sorted(recorder.input_ids[mode]), "signatures": len(recorder.signatures[mode]),
            "redone": sum(c["tries"] - 1 for c in mine),
            "auto_compile": sorted(set(watch.decisions[mode])), "auto_compile_calls": len(watch.decisions[mode])}
    report["per_prompt"] = []
    for n, (ids, bucket) in enumerate(zip(prompts, buckets)):
        row = {"prompt": n, "tokens": len(ids), "bucket": bucket}
        for mode in MODES:
            mine = [c for c in calls if c["mode"] == mode and c["prompt"] == n]
            row[f"{mode}_all_disturbed"] = quiet_only and all(c["disturbed"] for c in mine)
            for key in ("ttft_s", "decode_tokens_per_s"):
                row[f"{mode}_{key}"] = median(c[key] for c in counted(mine, quiet_only))
        report["per_prompt"].append(row)
    report["compile"] = {"dynamo_before": dynamo_before, "dynamo_after": dynamo_after,
                         "compiled_call_made": hasattr(model, "_compiled_call")}


def ms(seconds) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f}"


def print_report(report: dict) -> None:
    modes = report.get("modes")
    if not modes:
        return
    s = report["settings"]
    threads = f"{s['threads']} thread{'s' if s['threads'] != 1 else ''}"
    print(f"\n{s['model']}: {s['parameters']:,} parameters, {s['dtype'].replace('torch.', '')} on {s['device']} "
          f"({threads}); {len(report['prompts'])} prompts x {s['rounds']} rounds, {s['max_new_tokens']} new tokens, "
          f"greedy; static max_cache_len {s['max_cache_len']}")
    print(f"{'mode':8} {'TTFT ms':>8} {'text ms':>8} {'decode tok/s':>12} {'call s':>7} {'tokens fed':>10} "
          f"{'input_ids shapes':>16} {'signatures':>10} {'auto-compile':>12} {'quiet':>7} "
          f"{'redone':>6} {'others':>6}")
    for mode, m in modes.items():
        decided = "/".join(str(d) for d in m["auto_compile"]) or "not called"
        print(f"{mode:8} {ms(m['ttft_s']):>8} {ms(m['first_text_s']):>8} {m['decode_tokens_per_s']:12.1f} "
              f"{m['seconds']:7.3f} {m['fed_tokens']:10} {len(m['input_ids_shapes']):16} {m['signatures']:10} "
              f"{decided:>12} {m['quiet']:3}/{m['calls']:<3} {m['redone']:6} "
              f"{m['others_cores']:6.2f}")
    st, dy = modes["static"], modes["dynamic"]
    print(f"static / dynamic: TTFT x{st['ttft_s'] / dy['ttft_s']:.2f}, decode tok/s "
          f"x{st['decode_tokens_per_s'] / dy['decode_tokens_per_s']:.2f}")
    print(f"\n{'prompt':>6} {'tokens':>6} {'bucket':>6} {'TTFT ms static':>14} {'dynamic':>8} "
          f"{'tok/s static':>12} {'dynamic':>8}")
    for p in report["per_prompt"]:
        mark = {mode: "*" if p[f"{mode}_all_disturbed"] else " " for mode in MODES}
        print(f"{p['prompt']:6} {p['tokens']:6} {p['bucket']:6} {ms(p['static_ttft_s']):>13}{mark['static']} "
              f"{ms(p['dynamic_ttft_s']):>7}{mark['dynamic']} {p['static_decode_tokens_per_s']:11.1f}{mark['static']} "
              f"{p['dynamic_decode_tokens_per_s']:7.1f}{mark['dynamic']}")
    c = report["compile"]
    print("\nTTFT: to the first new token; text: to the first text piece (the chat's ttft_s); medians over prompts "
          "and rounds.\ndecode tok/s: tokens after the first / time after the first; call s: one whole generate; "
          "tokens fed: prompt\ntokens through the model (static: padded to its bucket). input_ids shapes: distinct, "
          "what the chat counts;\nsignatures: distinct (every tensor argument's shape + cache length), what a "
          "dynamic=False compile keys on.\nauto-compile: generate's decision; quiet: calls not slowed by other "
          "processes (* per prompt: none was, all\ncounted); redone: tries redone for that load; others: median "
          "cores other processes used.")
    print(f"Static input_ids shapes: {modes['static']['input_ids_shapes']}")
    if not report["quiet_only"]:
        print("WARNING: other processes slowed over half of a mode's calls, so the medians take every call, "
              "disturbed ones\nincluded: rerun on a quieter machine before trusting them.")
    frames = c["dynamo_after"]["frames_ok"] - c["dynamo_before"]["frames_ok"]
    compiled = frames > 0 or c["compiled_call_made"] or any(True in m["auto_compile"] for m in modes.values())
    print(f"Compilation on {s['device']}: generate's auto-compile decision static {st['auto_compile'] or '-'}, "
          f"dynamic {dy['auto_compile'] or '-'}; compiled call made: {c['compiled_call_made']}; Dynamo frames "
          f"compiled: {frames}.")
    print("Some forward WAS compiled: see the JSON before comparing the modes." if compiled
          else "Both modes ran the eager forward: these are not Neuron figures.")


def main() -> int:
    parser = argparse.ArgumentParser(description="Time to first token and decode tokens/s, static KV cache "
                                     "(as the chat does it) vs the dynamic cache, on this CPU.")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", help="a local model folder or a Hub id in the local cache (default: the built-in "
                       "tiny model)")
    which.add_argument("--small", action="store_true", help="a random Qwen3, 8 layers 512 wide (~26M parameters), "
                       "built offline on the tiny model's tokenizer")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the twelve prompts (default 3)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per call, forced (default 64)")
    parser.add_argument("--max-cache-len", type=int, default=1024, help="the static cache's length (default 1024, "
                        "the chat's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the chat process "
                        "on a CPU takes one core)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (unused; run_bench's option)")
    args = parser.parse_args()
    if min(args.rounds, args.threads) < 1 or args.max_new_tokens < 2 or args.max_cache_len <= args.max_new_tokens:
        parser.error("need --rounds >= 1, --threads >= 1, --max-new-tokens >= 2, --max-cache-len > --max-new-tokens")
    return run_bench("chat_cache", args, measure, print_report)


if __name__ == "__main__":
    sys.exit(main())
