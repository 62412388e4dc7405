"""Evaluation generation on this CPU: prompts padded to buckets (the studio's path) vs each prompt at its own length.

Run from the repository root (about 5 minutes with the defaults for the built-in tiny model, on one CPU
core with the machine's other core in use by others part of the time; longer on a busier machine):

    .venv/bin/python bench/eval_buckets.py                      # the built-in tiny model, 200 prompts, 5 rounds
    .venv/bin/python bench/eval_buckets.py --prompts 60 --rounds 3 --sides bucketed unbucketed
    .venv/bin/python bench/eval_buckets.py --model PATH         # a local model folder (tokenizer in it too)

It prints a table and writes every figure to bench/results/eval_buckets.json (overwritten each run).

What it measures: throughput (prompts/s) and the distinct input shapes that reach the model while it
answers an evaluation set of --prompts prompts of mixed lengths, as studio_core/evaluate/eval_worker.py answers one:
a studio_core.serve.generation.Generator (max_cache_len --max-cache-len, default the eval process's 1024),
greedy, exactly --max-new-tokens new tokens per prompt. The sides:

    bucketed    Generator.generate as it is: the prompt left-padded to its bucket (BUCKETS that fit with
                the answer: 64, 128, 256, 512 for the defaults), cache_implementation="static", max_cache_len fixed
    unbucketed  the same call, the prompt not padded (Generator._padded swapped, on this instance only, for
                one that pads to the prompt's own length): still the static cache of the same length, but
                every distinct prompt length is a new prefill shape
    dynamic     the same call without the static cache (cache_implementation and max_cache_len dropped on
                their way to model.generate): Transformers' DynamicCache, the prompt not padded

Everything else (rendering the template, fitting a prompt into the cache by dropping its oldest turns,
the streamer thread) is Generator's own code on every side. One change to the studio's path on all
sides: the model's generation_config.min_new_tokens is set to --max-new-tokens, so a model with random
weights cannot stop early at an end-of-sequence token and every side generates the same number of tokens.
Every call is checked: exactly --max-new-tokens forward calls (the prefill and one per further token).

The prompts: --prompts conversations in the model's chat template, made deterministically (--seed) from the
built-in samples as bench/chat_cache.py makes them: for each a target length drawn uniformly from 20 to
700 tokens, as many builtin:chat small-talk exchanges as stay under it as earlier turns, then a
builtin:qa question. Prompts over the largest bucket that leaves room for the answer (512 with the
defaults) are fitted by Generator.prompt, as in an evaluation, by dropping their oldest turns; the report
gives the lengths the model was fed. --max-cache-len 2048 lets them through whole (a 1024 bucket).

Per round and side: wall seconds over all prompts, prompts/s, distinct input_ids shapes (a forward pre-hook
on the model, as Generator's own `shapes`), and for the record distinct signatures (input_ids shape + KV
cache length: what a graph compiled with static shapes keys on; the dynamic cache grows every token).
Padding waste, bucketed side: padded tokens / all prompt tokens fed (the unbucketed sides feed none).
One uncounted warm-up call per side comes first; then each round runs every prompt on every side, the
order of the sides reversed every other round (A B C, C B A, ...). Reported per side: the median of the
rounds and their spread (min-max), and the ratio of the medians.

Threads: one (--threads), as the evaluation process on a CPU runs (one core taken through the leases,
torch.set_num_threads(1)); the bench does not pin itself to a core, as the machine is shared.

Noise: for each round and side, the cores' worth of CPU other processes used (bench/common.py's Noise)
and the share of the time the bench's thread ran. A round is disturbed when others used over 0.3 cores
and the bench ran under 90% of the time; disturbed rounds are not redone (a round takes tens of seconds)
but counted and shown (column `quiet`, and `others`: the median and largest cores other processes used).

Time: `prefill s` is the part of a round's seconds spent in each call's first forward (the prefill): a
forward pre-hook and hook stamp it. In our runs padding cost more than its share of tokens there: a
left-padded prompt makes Transformers build an explicit padding + causal mask for SDPA, and the CPU
kernel with that mask ran a 400-token prompt padded to 512 about 1.6x slower than 512 real tokens. In the
full default run the bucketed prefills took about twice the unbucketed ones' time for 18% padding, and the
rest of each round (decode steps against the whole static cache, generate's own work) about 9% longer.

What these CPU figures are not: Neuron figures. On this CPU generate runs the eager forward (the bench
records Dynamo's counters to show it compiled nothing), so a new shape here costs nothing extra. On
Neuron each new shape is a compilation of minutes; the report converts shapes into compilations at
--compile-minutes each (an assumption, not measured here).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from common import REPO, RESULTS_DIR, BenchError, Noise, own_cpu_s  # sets sys.path and HF_HUB_OFFLINE

import torch

from studio_core.data.builtin import BUILTIN_DATASETS, ensure_tiny_model
from studio_core.serve.generation import Generator, buckets_for

SIDES = ("bucketed", "unbucketed", "dynamic")
SHORTEST, LONGEST = 20, 700  # the prompts' target lengths (tokens), before fitting into the cache
QUIET_CORES, FULL_SHARE = 0.3, 0.9  # a round is disturbed when others used more AND the bench ran less
OUT = RESULTS_DIR / "eval_buckets.json"


# --- the prompts ------------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def build_prompts(gen: Generator, count: int, seed: int) -> list[dict]:
    """`count` conversations: earlier small-talk exchanges, as many as stay under a seeded target length,
    then a question. Rendered with Generator.render, so the lengths are the ones Generator sees."""
    rng = random.Random(seed)
    chats = read_jsonl(BUILTIN_DATASETS["builtin:chat"])
    turns = [[m for m in row["messages"] if m["role"] != "system"] for row in chats]
    exchanges = [t[i:i + 2] for t in turns for i in range(0, len(t) - 1, 2)]  # (user, assistant) pairs
    questions = [row["messages"][0] for row in read_jsonl(BUILTIN_DATASETS["builtin:qa"])]
    prompts = []
    for _ in range(count):
        # Drawn in eval-set order (not sorted), so lengths mix as they would in a real evaluation set.
        target, start = rng.randint(SHORTEST, LONGEST), rng.randrange(len(exchanges))
        question = [questions[rng.randrange(len(questions))]]
        history, length = [], len(gen.render(question))
        for k in range(len(exchanges) * 4):  # the samples repeat if a target needs more than there are
            longer = history + exchanges[(start + k) % len(exchanges)]
            longer_length = len(gen.render(longer + question))
            if longer_length > target:
                break
            history, length = longer, longer_length
        prompts.append({"messages": history + question, "target": target, "tokens": length})
    return prompts


# --- what reaches the model -------------------------------------------------------------------------
class ShapeRecorder:
    """Forward pre-hook (`before`) and hook (`after`): per side, the distinct input_ids shapes and
    (input_ids shape, KV cache length) signatures; the forward calls of the current generate call (to
    check how many tokens it generated) and the seconds spent in prefills (each call's first forward)."""

    def __init__(self) -> None:
        self.side = None
        self.call_forwards, self.started, self.prefill_s = 0, 0.0, 0.0
        self.input_ids: dict[str, set] = defaultdict(set)
        self.signatures: dict[str, set] = defaultdict(set)

    def after(self, module, args, output) -> None:
        if self.call_forwards == 1:
            self.prefill_s += time.perf_counter() - self.started

    def before(self, module, args, kwargs) -> None:
        self.call_forwards += 1
        self.started = time.perf_counter()
        if self.side is None:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        self.input_ids[self.side].add(tuple(ids.shape))
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # Transformers 5 passes it as `cache`
        layers = getattr(cache, "layers", None) or [None]
        keys = getattr(layers[0], "keys", None)  # None: a dynamic cache before its first token
        self.signatures[self.side].add((tuple(ids.shape), None if keys is None else keys.shape[-2]))


def dynamo_frames() -> int:
    """Frames Dynamo compiled so far (0 on this CPU, where generate does not compile)."""
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"]


# --- the sides --------------------------------------------------------------------------------------
class Side:
    """Switches a Generator to one side for a block, and back afterwards."""

    def __init__(self, gen: Generator, recorder: ShapeRecorder, name: str) -> None:
        self.gen, self.recorder, self.name = gen, recorder, name

    def __enter__(self):
        gen, self.recorder.side = self.gen, self.name
        if self.name in ("unbucketed", "dynamic"):
            padded = type(gen)._padded
            # Pad to the prompt's own length, i.e. not at all: the rest of generate stays the studio's.
            gen._padded = lambda ids, length, *placed, **how: padded(gen, ids, len(ids), *placed, **how)
        if self.name == "dynamic":
            generate = type(gen.model).generate

            def without_static_cache(**kwargs):
                kwargs.pop("cache_implementation", None)
                kwargs.pop("max_cache_len", None)
                return generate(gen.model, **kwargs)

            gen.model.generate = without_static_cache  # an instance attribute: only this model, only here
        return self

    def __exit__(self, *exc) -> None:
        self.recorder.side = None
        self.gen.__dict__.pop("_padded", None)
        self.gen.model.__dict__.pop("generate", None)

    def call(self, prompt: dict, max_new_tokens: int) -> dict:
        self.recorder.call_forwards = 0
        answer = self.gen.generate(prompt["messages"], max_new_tokens=max_new_tokens)
        forwards = self.recorder.call_forwards
        if forwards != max_new_tokens:  # the prefill gives the first token, each further forward one more
            raise BenchError(f"{self.name}: {forwards} forward calls for {max_new_tokens} new tokens "
                             f"(prompt of {answer['prompt_tokens']} tokens)")
        return answer


# --- the bench --------------------------------------------------------------------------------------
def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(args, report: dict) -> None:
    torch.set_num_threads(args.threads)
    path = args.model or str(ensure_tiny_model())
    gen = Generator({"label": args.model or "built-in tiny model", "model": path, "tokenizer": path,
                     "adapter": None, "base": None, "trust_remote_code": False},
                    backend="cpu", max_cache_len=args.max_cache_len)
    # Random weights may end an answer early; forcing the length keeps the work equal across sides.
    gen.model.generation_config.min_new_tokens = args.max_new_tokens
    buckets = buckets_for(args.max_cache_len, args.max_new_tokens)
    t0 = time.monotonic()
    prompts = build_prompts(gen, args.prompts, args.seed)
    for p in prompts:  # the ids the model will be fed, after Generator fits the prompt into the cache
        ids, p["bucket"], p["dropped_turns"], _ = gen.prompt(p["messages"], args.max_new_tokens)
        p["fed_tokens"] = len(ids)
    fed = [p["fed_tokens"] for p in prompts]
    report["settings"] = {
        "model": gen.setup["label"], "parameters": sum(t.numel() for t in gen.model.parameters()),
        "dtype": str(gen.model.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
        "max_cache_len": args.max_cache_len, "max_new_tokens": args.max_new_tokens, "buckets": buckets,
        "prompts": len(prompts), "rounds": args.rounds, "sides": args.sides, "seed": args.seed,
        "prompt_build_s": round(time.monotonic() - t0, 2),
        "torch": torch.__version__, "transformers": __import__("transformers").__version__}
    report["prompts"] = {
        "target_tokens": [p["target"] for p in prompts], "rendered_tokens": [p["tokens"] for p in prompts],
        "fed_tokens": fed, "buckets": [p["bucket"] for p in prompts],
        "fitted": sum(p["dropped_turns"] > 0 for p in prompts), "distinct_lengths": len(set(fed)),
        "per_bucket": {b: sum(p["bucket"] == b for p in prompts) for b in buckets}}
    padded = sum(p["bucket"] for p in prompts)
    report["padding"] = {"real_tokens": sum(fed), "padded_tokens": padded - sum(fed), "bucketed_fed_tokens": padded,
                         "waste": (padded - sum(fed)) / padded}
    print(f"[bench] {gen.setup['label']}: {report['settings']['parameters']:,} parameters; {len(prompts)} prompts "
          f"of {min(fed)}-{max(fed)} tokens fed ({report['prompts']['fitted']} fitted into the cache), "
          f"{len(set(fed))} distinct lengths", flush=True)

    recorder = ShapeRecorder()
    gen.model.register_forward_pre_hook(recorder.before, with_kwargs=True)
    gen.model.register_forward_hook(recorder.after)
    frames_before = dynamo_frames()
    report["warmup_s"] = {}
    for name in args.sides:  # uncounted: the first call of each side pays one-off set-up
        with Side(gen, recorder, name) as side:
            t = time.perf_counter()
            side.call(prompts[0], args.max_new_tokens)
            report["warmup_s"][name] = time.perf_counter() - t
    rounds: list[dict] = []
    report["rounds"] = rounds  # filled as rounds end: a failed bench still reports those it made
    per_prompt: dict[str, list[list[float]]] = {name: [[] for _ in prompts] for name in args.sides}
    for round_no in range(1, args.rounds + 1):
        order = args.sides if round_no % 2 == 1 else args.sides[::-1]
        for name in order:
            with Side(gen, recorder, name) as side:
                shapes_before, prefill_before = set(recorder.input_ids[name]), recorder.prefill_s
                noise, start = Noise(), time.perf_counter()
                for n, prompt in enumerate(prompts):
                    t = time.perf_counter()
                    side.call(prompt, args.max_new_tokens)
                    per_prompt[name][n].append(time.perf_counter() - t)
                seconds = time.perf_counter() - start
                others = noise.others_cores()
                own_share = (own_cpu_s() - noise.own) / max(time.monotonic() - noise.t, 1e-6) / args.threads
            rounds.append({"round": round_no, "side": name, "order": order.index(name) + 1, "seconds": seconds,
                           "prompts_per_s": len(prompts) / seconds, "prefill_s": recorder.prefill_s - prefill_before,
                           "others_cores": others, "own_share": own_share,
                           "disturbed": others > QUIET_CORES and own_share < FULL_SHARE,
                           "new_shapes": len(recorder.input_ids[name] - shapes_before)})
            r = rounds[-1]
            print(f"[bench] round {round_no} {name:10}: {seconds:6.1f} s ({r['prefill_s']:4.1f} s of prefills), "
                  f"{r['prompts_per_s']:5.2f} prompts/s, others {others:.2f} cores, own share {own_share:.2f}"
                  f"{' (disturbed)' if r['disturbed'] else ''}", flush=True)

    report["sides"] = {}
    for name in args.sides:
        mine = [r for r in rounds if r["side"] == name]
        shapes = sorted(recorder.input_ids[name])
        report["sides"][name] = {
            "prompts_per_s": spread([r["prompts_per_s"] for r in mine]),
            "seconds": spread([r["seconds"] for r in mine]),
            "prefill_s": spread([r["prefill_s"] for r in mine]),
            "input_ids_shapes": len(shapes), "prefill_shapes": sum(s[-1] > 1 for s in shapes),
            "shapes": shapes, "signatures": len(recorder.signatures[name]),
            "fed_tokens_per_round": padded if name == "bucketed" else sum(fed),
            "quiet_rounds": sum(not r["disturbed"] for r in mine), "rounds": len(mine),
            "others_cores": spread([r["others_cores"] for r in mine]),
            "own_share": spread([r["own_share"] for r in mine]),
            "per_prompt_median_s": [statistics.median(times) for times in per_prompt[name]]}
    report["dynamo_frames_compiled"] = dynamo_frames() - frames_before


def print_report(report: dict, args) -> None:
    sides = report.get("sides")
    if not sides:
        return
    s, p, pad = report["settings"], report["prompts"], report["padding"]
    fed = p["fed_tokens"]
    print(f"\n{s['model']}: {s['parameters']:,} parameters, {s['dtype']} on cpu ({s['threads']} thread"
          f"{'s' if s['threads'] != 1 else ''}); {s['prompts']} prompts x {s['rounds']} rounds, "
          f"{s['max_new_tokens']} new tokens each, greedy; static max_cache_len {s['max_cache_len']}, buckets "
          f"{'/'.join(map(str, s['buckets']))}")
    print(f"Prompts: targets {min(p['target_tokens'])}-{max(p['target_tokens'])} tokens; fed "
          f"{min(fed)}-{max(fed)} tokens ({p['fitted']} over {s['buckets'][-1]} fitted by dropping old turns), "
          f"{p['distinct_lengths']} distinct lengths; per bucket "
          + ", ".join(f"{b}: {n}" for b, n in p["per_bucket"].items()))
    print(f"\n{'side':10} {'prompts/s':>9} {'(min-max)':>13} {'round s':>8} {'prefill s':>9} {'input_ids':>9} "
          f"{'prefill':>7} {'signatures':>10} {'tokens fed':>10} {'quiet':>5} {'others':>11}")
    for name, m in sides.items():
        rate, secs, others = m["prompts_per_s"], m["seconds"], m["others_cores"]
        span = f"({rate['min']:.2f}-{rate['max']:.2f})"
        print(f"{name:10} {rate['median']:9.2f} {span:>13} {secs['median']:8.1f} {m['prefill_s']['median']:9.2f} "
              f"{m['input_ids_shapes']:9} {m['prefill_shapes']:7} {m['signatures']:10} "
              f"{m['fed_tokens_per_round']:10} {m['quiet_rounds']:2}/{m['rounds']:<2} "
              f"{others['median']:5.2f}/{others['max']:.2f}")
    base = sides.get("bucketed")
    if base:
        for name, m in sides.items():
            if name != "bucketed":
                ratio = m["prompts_per_s"]["median"] / base["prompts_per_s"]["median"]
                print(f"{name} / bucketed: prompts/s x{ratio:.2f} (ratio of medians)")
        print(f"Padding waste (bucketed): {pad['padded_tokens']} of {pad['bucketed_fed_tokens']} prompt tokens fed "
              f"per round are padding ({100 * pad['waste']:.1f}%).")
    print("\nprompts/s: prompts / a round's wall seconds, median of rounds (min-max); round s: median; prefill s: "
          "of those seconds,\nthe prefills' (each call's first forward), median; input_ids: distinct input_ids "
          "shapes the model saw (prefill:\nthose longer than one token; the other is the decode step's (1, 1)); "
          "signatures: distinct (input_ids shape, KV\ncache length); tokens fed: prompt tokens per round, padding "
          "included; quiet: rounds not disturbed (starved) by\nother processes; others: cores other processes "
          "used during a round, median/largest.")
    rounds = report["rounds"]
    others = [r["others_cores"] for r in rounds]
    busy = sum(o > QUIET_CORES for o in others)
    disturbed = sum(r["disturbed"] for r in rounds)
    print(f"Machine: other processes used {min(others):.2f}-{max(others):.2f} cores (median "
          f"{statistics.median(others):.2f}) during the rounds, over {QUIET_CORES} in {busy} of {len(rounds)}: "
          + ("quiet throughout." if busy == 0 else
             f"NOT quiet.\nThe bench's thread still ran {100 * min(r['own_share'] for r in rounds):.0f}%+ of the "
             f"time, {disturbed} round(s) disturbed (starved); sharing the machine still costs some speed\n"
             f"(memory bandwidth, caches), so compare sides within a run more than across runs."))
    frames = report["dynamo_frames_compiled"]
    print(f"Dynamo frames compiled: {frames} (" + ("every side ran the eager forward)." if frames == 0 else
                                                  "SOME forward was compiled: see the JSON)."))
    minutes = args.compile_minutes
    lines = []
    for name, m in sides.items():
        if name == "dynamic":
            graphs = m["signatures"]  # the cache length changes every token: a graph per (shape, length)
            why = "a graph per (input shape, cache length): the cache grows every token"
        else:
            graphs = m["input_ids_shapes"]  # the static cache's length is fixed: a graph per input shape
            why = (f"at most {len(s['buckets'])} prefill graphs (one per bucket) + 1 decode graph" if name == "bucketed"
                   else "a prefill graph per distinct prompt length + 1 decode graph")
        lines.append(f"  {name:10} {graphs:4} graphs ({why}): ~{graphs * minutes:.0f} min of compiling")
    print(f"On Neuron, where each new shape is a compilation (assumed ~{minutes:g} min each, not measured here), "
          f"before this set is answered:\n" + "\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description="Evaluation generation: prompts/s and distinct input shapes, "
                                     "prompts padded to buckets (the studio's path) vs each at its own length.")
    parser.add_argument("--model", help="a local model folder, tokenizer in it (default: the built-in tiny model)")
    parser.add_argument("--prompts", type=int, default=200, help="prompts per round (default 200)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds over all prompts and sides (default 5)")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES), help="the sides, in the first "
                        "round's order (default: all three)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="new tokens per prompt, forced (default 16)")
    parser.add_argument("--max-cache-len", type=int, default=1024, help="the static cache's length (default 1024, "
                        "the evaluation process's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the evaluation process "
                        "on a CPU takes one core)")
    parser.add_argument("--seed", type=int, default=0, help="the prompts' seed (default 0)")
    parser.add_argument("--compile-minutes", type=float, default=2.0, help="minutes one Neuron compilation is "
                        "assumed to take, for the report's last lines (default 2)")
    args = parser.parse_args()
    if min(args.prompts, args.rounds, args.threads) < 1 or args.max_new_tokens < 2 \
            or args.max_cache_len <= args.max_new_tokens or len(set(args.sides)) != len(args.sides):
        parser.error("need --prompts, --rounds, --threads >= 1, --max-new-tokens >= 2, --max-cache-len > "
                     "--max-new-tokens, and each side once")

    t0 = time.time()
    report: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args)}
    code = 1
    try:
        measure(args, report)
        code = 0
    except BenchError as error:
        report["error"] = str(error)
        print(f"[bench] FAILED: {error}", file=sys.stderr)
    except BaseException as error:  # a bug or Ctrl-C: recorded in the JSON, then re-raised
        report["error"] = f"{type(error).__name__}: {error}"
        raise
    finally:
        report["bench_seconds"] = time.time() - t0
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(report, indent=2, default=str))
        print_report(report, args)
        if report.get("error"):
            print(f"FAILED: {report['error']}")
        print(f"bench took {report['bench_seconds']:.0f} s\n\nAll figures: {OUT.relative_to(REPO)}")
    return code


if __name__ == "__main__":
    sys.exit(main())
