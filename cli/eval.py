"""eval: the tuned model against its base on an evaluation set, with a progress bar; the summary
as a table, or with --json as one JSON object keyed by model, then metric (for scripts)."""

from __future__ import annotations

import json
import sys

from cli.options import CommandLineError, check_one_core, hardware_for, runs_folder
from studio_core.serve.chat import MAX_CACHE_LEN
from studio_core.evaluate.evaluation import METRICS, EvalError, EvalProcess, EvalRequest, check_request, format_summary


def cmd_eval(args) -> int:
    metrics = tuple(m.strip() for m in args.metrics.split(",") if m.strip()) if args.metrics else None
    column_map = {}
    for item in args.column_map:
        old, sep, new = item.partition("=")
        if not sep or not old or not new:
            raise CommandLineError(f"--column-map {item!r}: write it as old=new, e.g. answer=completion")
        column_map[old] = new
    request = EvalRequest(args.target, data=args.data, split=args.split, config=args.config, metrics=metrics,
                          limit=args.limit, max_new_tokens=args.max_new_tokens, column_map=column_map,
                          tasks=tuple(t.strip() for t in (args.lm_eval_tasks or "").split(",") if t.strip()),
                          task_include=args.lm_eval_include, max_cache_len=args.max_cache_len)
    runs_dir = runs_folder(args, write=True)  # the evaluation holds a core there and saves into the run
    source, problems = check_request(request, runs_dir)  # before the hardware probe (a child Python, seconds)
    if problems:
        print("Cannot evaluate:\n" + "\n".join(f"- {p}" for p in problems), file=sys.stderr)
        return 2
    hardware = hardware_for(args)
    check_one_core(args.cores, hardware)
    try:
        evaluation = EvalProcess.start(request, runs_dir, hardware, cores=args.cores, checked=source)
    except EvalError as error:
        print(f"Cannot evaluate:\n{error}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    bar, done = None, None
    try:
        for event in evaluation.events():
            if event["type"] == "loaded":
                skipped = f" ({event['skipped']} too long, skipped: see the summary)" if event.get("skipped") else ""
                print(f"Evaluating {args.target} ({' and '.join(event['sides'])}) on {event['rows']} prompts{skipped}.",
                      file=sys.stderr)
                bar = tqdm(total=event["rows"] * len(event["sides"]), unit="answer", dynamic_ncols=True,
                           file=sys.stderr)
            elif event["type"] == "progress" and bar is not None:
                bar.set_postfix_str(event["side"], refresh=False)
                bar.update(event["done"] - bar.n)
            elif event["type"] == "done":
                done = event
    except KeyboardInterrupt:
        evaluation.stop()
        print("\nStopping after the answer in progress; what is done is saved.", file=sys.stderr)
        done = next((e for e in evaluation.events() if e["type"] == "done"), None)
    except EvalError as error:
        print(f"Evaluation failed: {error}", file=sys.stderr)
        return 1
    finally:
        if bar is not None:
            bar.close()
    if done is not None and done["summary"].get("harness_error"):
        print(f"lm-eval failed: {done['summary']['harness_error']}", file=sys.stderr)
    if done is None:
        print("Stopped before any answer was scored; nothing was saved.", file=sys.stderr)
        return 1
    summary = done["summary"]
    if args.json:
        results = summary["results"]  # lm-eval's scores are the tuned model's metrics lm_eval/TASK/METRIC
        results["tuned"] |= {f"lm_eval/{task}/{metric}": value for task, scores in summary.get("harness", {}).items()
                             for metric, value in scores.items()}
        print(json.dumps(results))
        if summary.get("skipped"):  # stdout is the scores alone, for scripts
            print(f"Skipped: {summary['skipped']['message']}.", file=sys.stderr)
    else:
        if summary["note"]:
            print(f"Evaluated on {summary['note']}.")
        print(format_summary(summary))
        for task, scores in summary.get("harness", {}).items():
            shown = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in scores.items())
            print(f"lm-eval {task} (tuned): {shown}")
        print(f"{summary['rows']} prompts, greedy, at most {summary['max_new_tokens']} new tokens; "
              f"{len(summary['shapes'])} distinct input shapes (buckets {summary['buckets']}), each a compilation "
              "on Neuron.")
        if summary.get("skipped"):
            print(f"Skipped: {summary['skipped']['message']}.")
    print(f"Saved in {done['dir']} (rows.jsonl: every answer and its scores).", file=sys.stderr)
    return 0


def add_parser(command) -> None:
    sub = command("eval", cmd_eval, "evaluate a run's model against its base on an evaluation set")
    sub.add_argument("target", help="a run id (its model or LoRA adapter, against its base), or a model")
    sub.add_argument("--data", help="the evaluation set: a .jsonl/.json/.csv/.parquet file, a builtin: set or a Hub "
                     "dataset (default: the run's own dataset)")
    sub.add_argument("--split", help="the dataset's split (default: train; a file has only that one)")
    sub.add_argument("--config", help="a Hub dataset's configuration")
    sub.add_argument("--metrics", help=f"comma-separated, from {', '.join(METRICS)} (default: every one that "
                     "applies to the data and the run; mean_reward runs the run's reward functions, your files "
                     "included)")
    sub.add_argument("--limit", type=int, help="evaluate the first N rows only")
    sub.add_argument("--max-new-tokens", type=int, default=64, help="each answer's length limit (default 64)")
    sub.add_argument("--max-cache-len", type=int, default=MAX_CACHE_LEN, help="the static cache's length in tokens: "
                     f"a prompt's bucket plus the answer (default {MAX_CACHE_LEN}); a longer prompt is skipped")
    sub.add_argument("--column-map", action="append", default=[], metavar="OLD=NEW",
                     help="rename a column of the evaluation set, e.g. answer=completion")
    sub.add_argument("--lm-eval-tasks", metavar="TASK,...", help="lm-evaluation-harness tasks to run on the tuned "
                     "model too (needs `pip install lm-eval`; offline, name your own tasks with --lm-eval-include)")
    sub.add_argument("--lm-eval-include", metavar="FOLDER", help="a folder of lm-eval task YAML files")
    sub.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")
    sub.add_argument("--cores", help="the core to evaluate on (default: the first free one)")
    sub.add_argument("--backend", choices=("cpu",), help="evaluate on the CPU even if a device is present")
