"""Evaluation: did the fine-tune help? The tuned model and its base answer the same prompts,
and each answer is scored against the reference.

    evaluation = EvalProcess.start(EvalRequest("20261130-...-tiny-sft-1a2b3c"), runs_dir, hardware)
    for event in evaluation.events():
        ...  # {"type": "progress", "done", "total"}, then {"type": "done", "summary", "dir"}

lm-evaluation-harness tasks (`EvalRequest.tasks`, when lm-eval is installed) run on the tuned
model in the same process, on the model it loaded (studio_core.evaluate.harness); their scores go to the
summary's `harness`.

The work happens in `studio_core.evaluate.eval_worker`, a child process of its own that takes a core
through the same leases as chat (kind "eval"), answers through the same generation path
(static cache, prompt buckets, greedy by default: studio_core.serve.generation) and ends when done
or stopped. Results go to the run folder's `eval/<time>/`: `rows.jsonl` (prompt, reference,
each model's answer and scores) and `summary.json` (the settings used and each model's mean
scores). An evaluation of a model that is not a run goes to `<runs dir>/evals/<time>-<name>/`.

The metrics (METRICS): exact match (after NORMALISE), ROUGE-L F1 (Google's `rouge-score`
package, with its stemmer), the loss and perplexity of the reference answer under each model
(teacher-forced, as training counts it), the answer length in tokens, the run's own reward
functions on the answers (GRPO, RLOO: weighted and summed as the trainer sums them, and each
one's mean), and for preference data how often the model gives the chosen answer a higher
likelihood than the rejected one. Without metrics asked for, every one that applies to the
data and the run is taken.

A run's default evaluation set is the one it held out (studio_core.recipe.eval_data), else its
training data, which the summary then says.

A prompt is answered whole or not at all (a cut one is another question): one over the largest
bucket of the static cache (`max_cache_len`) is skipped, and the summary's `skipped` says so;
when every prompt is, the evaluation process refuses before it loads the model.

No torch import here: this module runs in the web app's process.
"""

from __future__ import annotations

import json
import math
import re
import string
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from studio_core.recipe import eval_data
from studio_core.data import sources
from studio_core.serve.images import text_of
from studio_core.serve.chat import MAX_CACHE_LEN, ChatError, ChatProcess, kill, resolve
from studio_core.data.files import read_rows
from studio_core.machine.hardware import Hardware
from studio_core.recipe.rewards import HUB_TOKENS
from studio_core.recipe.spec import load_spec
from studio_core.rundir import folder
from studio_core.rundir.folder import EVAL_DIR, SUMMARY, evaluations  # where a run keeps its evaluations

# metric -> (what it says, what it needs: a reference answer, the run's rewards, or preference pairs)
REFERENCE, REWARDS, PAIRS = "reference", "rewards", "pairs"
METRICS = {
    "exact_match": ("the answer equals the reference (case, spacing and end punctuation aside)", REFERENCE),
    "rouge_l": ("ROUGE-L F1 of the answer against the reference (longest common word sequence)", REFERENCE),
    "eval_loss": ("the reference answer's loss under the model (teacher-forced; its perplexity beside it)", REFERENCE),
    "answer_tokens": ("the answer's length in tokens", None),
    "mean_reward": ("the run's reward functions on the answer, weighted and summed as its trainer does (runs "
                    "the run's reward code, your files included)", REWARDS),
    "preference_accuracy": ("the chosen answer is more likely under the model than the rejected one", PAIRS),
}
MAX_NEW_TOKENS = 64
LONGEST_CACHE = 16384  # the static cache's largest length asked for (tokens)
MODEL_EVALS = "evals"  # in the runs folder, for a model that is not a run
ROWS = "rows.jsonl"
NORMALISE = "lower case, runs of spaces as one, punctuation and spaces at either end dropped"


class EvalError(ValueError):
    """The evaluation cannot start or go on; the message says what to change."""


@dataclass
class EvalRequest:
    target: str  # a run id, or a model (builtin, Hub id, local folder)
    data: str | None = None  # a file or Hub dataset; None: the run's own dataset
    split: str | None = None  # None: the dataset's train split (a file has only that)
    config: str | None = None
    metrics: tuple[str, ...] | None = None  # None: every metric that applies
    limit: int | None = None  # the first N rows
    max_new_tokens: int = MAX_NEW_TOKENS
    column_map: dict = field(default_factory=dict)
    tasks: tuple[str, ...] = ()  # lm-evaluation-harness tasks, run on the tuned model (studio_core.evaluate.harness)
    task_include: str | None = None  # a folder of the user's own lm-eval task YAML files
    max_cache_len: int = MAX_CACHE_LEN  # the static cache: a prompt's bucket + the answer; longer prompts are skipped


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text.lower()).strip(string.punctuation + string.whitespace)


def as_text(value) -> str | None:
    """A reference or answer as text: a string, or the last assistant message's content."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for message in reversed(value):
            if isinstance(message, dict) and message.get("role") == "assistant":
                return text_of(message.get("content"))
    return str(value)


def as_messages(prompt) -> list[dict]:
    """A prompt as a conversation: a string becomes one user turn (the model's chat template
    then renders it, as chat does)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def item(row: dict) -> dict | None:
    """What one record gives an evaluation: the prompt (a conversation), the reference answer and,
    for preference data, the chosen and rejected answers. None: the record has no prompt (plain
    text, or a conversation with no user turn before an answer)."""
    if isinstance(row.get("messages"), list):
        messages = row["messages"]
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        if last is None or last == 0:
            return None
        answer = messages[last].get("content")
        return {"prompt": as_messages(messages[:last]), "row": row,
                "reference": text_of(answer) if isinstance(answer, list) else as_text(answer)}
    if "prompt" not in row or row["prompt"] is None:
        return None
    chosen = as_text(row.get("chosen"))
    reference = next((as_text(row[k]) for k in ("completion", "reference", "answer") if row.get(k) is not None),
                     chosen)
    return {"prompt": as_messages(row["prompt"]), "reference": reference, "chosen": chosen,
            "rejected": as_text(row.get("rejected")), "row": row}


def items_and_problems(rows: list[dict], metrics, rewards=()) -> tuple[list[dict], tuple, list[str]]:
    """The records' evaluation items, the metrics to score them with (`metrics` None: every one
    that applies to them and to a run with these `rewards`), and what stops an evaluation."""
    if not rows:
        return [], (), ["the evaluation set has no rows; give a dataset, split or --limit that holds some"]
    items = [i for i in (item(row) for row in rows) if i is not None]
    columns = ", ".join(sorted(rows[0]))
    if not items:
        return [], (), [f"the evaluation set has no prompts to answer (columns: {columns}): give `messages` "
                        "(a conversation ending in the answer) or `prompt` with `completion` or `reference`"]
    has = {None: True, REFERENCE: any(i["reference"] is not None for i in items), REWARDS: bool(rewards),
           PAIRS: any(i.get("chosen") is not None and i.get("rejected") is not None for i in items)}
    if metrics is None:
        return items, tuple(m for m, (_, needs) in METRICS.items() if has[needs]), []
    problems = check_metrics(metrics)
    missing = [m for m in metrics if m in METRICS and not has[METRICS[m][1]]]
    need = {METRICS[m][1] for m in missing}
    if REFERENCE in need:
        problems.append(f"{', '.join(m for m in missing if METRICS[m][1] == REFERENCE)} compare with a reference "
                        f"answer, and the evaluation set has none (columns: {columns}): give a `completion`, "
                        "`reference`, `answer` or `chosen` column (--column-map old=new renames one), or leave "
                        "those metrics out")
    if REWARDS in need:
        problems.append("mean_reward scores answers with a run's reward functions, and this one has none (only "
                        "GRPO and RLOO runs do); leave it out")
    if PAIRS in need:
        problems.append(f"preference_accuracy compares a `chosen` and a `rejected` answer, and the evaluation set "
                        f"has no such pairs (columns: {columns}); leave it out")
    return items, tuple(metrics), problems


def check_metrics(metrics) -> list[str]:
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        return [f"metric {', '.join(unknown)}: unknown; choose from {', '.join(METRICS)}"]
    return [] if metrics else [f"choose at least one metric: {', '.join(METRICS)}"]


def rouge_l(answer: str, reference: str) -> float:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True).score(reference, answer)["rougeL"].fmeasure


def scores(entry: dict, metrics, reference: str | None) -> dict:
    """One model's scores for one row: `entry` holds its answer, answer_tokens and (if scored)
    the reference's summed loss and its token count."""
    out = {}
    if "exact_match" in metrics and reference is not None:
        out["exact_match"] = float(normalise(entry["answer"]) == normalise(reference))
    if "rouge_l" in metrics and reference is not None:
        out["rouge_l"] = rouge_l(entry["answer"], reference)
    if "eval_loss" in metrics and entry.get("reference_tokens"):
        out["eval_loss"] = entry["reference_loss"] / entry["reference_tokens"]
    if "answer_tokens" in metrics:
        out["answer_tokens"] = float(entry["answer_tokens"])
    if "preference_accuracy" in metrics and "chosen_loss" in entry:
        out["preference_accuracy"] = float(entry["chosen_loss"] < entry["rejected_loss"])
    return out


def summarise(rows: list[dict], sides: list[str]) -> dict:
    """{model: {metric: mean over the rows that have it}}; eval_loss is token-weighted (the loss
    over every reference token) and perplexity is exp of it. Each reward function's own mean
    (`reward/NAME`) comes after the metrics."""
    summary = {}
    for side in sides:
        entries = [row[side] for row in rows if side in row]
        names = list(dict.fromkeys(k for e in entries for k in e["scores"]))
        means = {}
        for metric in sorted(names, key=lambda m: (m not in METRICS, list(METRICS).index(m) if m in METRICS else 0)):
            scored = [e for e in entries if e["scores"].get(metric) is not None]
            if metric == "eval_loss" and scored:
                means[metric] = sum(e["reference_loss"] for e in scored) / sum(e["reference_tokens"] for e in scored)
                means["perplexity"] = math.exp(min(means[metric], 50))
            elif scored:
                means[metric] = sum(e["scores"][metric] for e in scored) / len(scored)
        summary[side] = {k: round(v, 4) for k, v in means.items()}
    return summary


def format_summary(summary: dict) -> str:
    """The summary as a small table: a row per metric, a column per model."""
    sides = list(summary["results"])
    metrics = list(dict.fromkeys(m for s in sides for m in summary["results"][s]))
    width = max(14, *(len(m) + 2 for m in metrics))
    lines = [f"{'metric':<{width}}" + "".join(f"{s:>12}" for s in sides)]
    for metric in metrics:
        cells = [summary["results"][s].get(metric) for s in sides]
        lines.append(f"{metric:<{width}}" + "".join(f"{'-' if c is None else format(c, '.4f'):>12}" for c in cells))
    return "\n".join(lines)


def results_dir(target: str, runs_dir: Path) -> Path:
    """Where an evaluation of `target` goes: the run's eval/, else the runs folder's evals/."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if folder.is_run_id(target) and folder.is_run(runs_dir / target):
        base = runs_dir / target / EVAL_DIR
    else:
        base = runs_dir / MODEL_EVALS
        stamp += "-" + folder.file_safe(target)[-40:]
    out, n = base / stamp, 1
    while out.exists():
        n += 1
        out = base / f"{stamp}-{n}"
    return out


def evaluations_of(target: str, runs_dir: Path) -> list[dict]:
    """The finished evaluations of a run (its eval/), or of a model that is not a run (the runs
    folder's evals/, those whose summary names it), newest first."""
    runs_dir = Path(runs_dir)
    if folder.is_run_id(target) and folder.is_run(runs_dir / target):
        return evaluations(runs_dir / target)
    return [s for s in evaluations(runs_dir, MODEL_EVALS) if s.get("target") == target]


def evaluated_models(runs_dir: Path) -> list[str]:
    """The models that are not runs and have been evaluated in this runs folder, newest first."""
    return list(dict.fromkeys(s["target"] for s in evaluations(Path(runs_dir), MODEL_EVALS)
                              if isinstance(s.get("target"), str)))


def read_rows_file(eval_dir: Path) -> list[dict]:
    with open(Path(eval_dir) / ROWS) as f:
        return [json.loads(line) for line in f if line.strip()]


def data_source(request: EvalRequest, runs_dir: Path) -> dict:
    """The dataset to evaluate on: the one asked for, else the run's own evaluation set (the rows
    it held out, its eval dataset or test split), else its training data (with a note saying
    so); with the run's column map and reward functions."""
    run_dir = runs_dir / request.target
    spec = None
    if folder.is_run_id(request.target) and folder.is_run(run_dir):
        spec = load_spec(run_dir)  # DamagedRun names a damaged spec.yaml
    rewards = spec.rewards if spec is not None else []
    if request.data:
        return {"name": request.data, "split": request.split or "train", "config": request.config,
                "column_map": request.column_map, "holdout": None, "note": "", "rewards": rewards}
    if spec is None:
        raise EvalError(f"{request.target} is not a run: name an evaluation set (--data FILE or Hub id)")
    return run_source(spec, request)


def run_source(spec, request: EvalRequest) -> dict:
    """The dataset a run of `spec` is evaluated on when the request names none: its own evaluation
    set, else its training data (with a note saying so)."""
    held = eval_data.eval_source(spec)
    common = {"column_map": request.column_map or spec.column_map, "rewards": spec.rewards}
    if held is None or request.split:
        return {**common, "name": spec.dataset_name, "split": request.split or spec.dataset_train_split,
                "config": spec.dataset_config, "holdout": None,
                "note": "" if request.split else "the run's training data (it held none out): this shows what it "
                "learned, not how it does on new prompts; name a held-out set (--data, or the Evaluate tab's "
                "evaluation set)"}
    holdout = {"fraction": held.fraction, "seed": held.seed} if held.kind == eval_data.FRACTION else None
    return {**common, "name": held.name, "split": held.split, "config": held.config, "holdout": holdout,
            "note": f"the run's evaluation set ({held.describe()}), which it did not train on"}


def check_run_evaluation(spec, metrics: tuple[str, ...] | None = None, limit: int | None = None) -> list[str]:
    """What would stop `launch.py eval RUN_ID` on a run of `spec` once it has trained (on its own
    evaluation set, else its training data): the metrics, the limit and, for a local file, its
    records against the metrics (prompts to answer, references, the run's rewards, pairs). A
    sweep's `--eval` asks it of each run before any is made."""
    request = EvalRequest("", metrics=metrics, limit=limit)
    problems = settings_problems(request)
    try:
        source = run_source(spec, request)
    except (EvalError, ValueError) as error:
        return problems + [str(error)]
    return problems + records_problems(source, request.metrics, read_records=not problems)


def settings_problems(request: EvalRequest) -> list[str]:
    """What is wrong with the request's own settings: metrics, limit, lengths, lm-eval tasks."""
    problems = check_metrics(request.metrics) if request.metrics is not None else []
    if request.limit is not None and request.limit < 1:
        problems.append(f"limit {request.limit}: evaluate at least 1 row (or no limit)")
    if not 1 <= request.max_new_tokens <= 512:
        problems.append(f"max_new_tokens {request.max_new_tokens}: use 1 to 512")
    elif not request.max_new_tokens + 64 <= request.max_cache_len <= LONGEST_CACHE:
        problems.append(f"max_cache_len {request.max_cache_len}: use {request.max_new_tokens + 64} (the smallest "
                        f"prompt bucket, 64 tokens, and max_new_tokens) to {LONGEST_CACHE}")
    if request.tasks or request.task_include:
        from studio_core.evaluate import harness

        problems += [f"lm-eval: {p}" for p in harness.check_tasks(list(request.tasks), request.task_include)]
    return problems


def check_request(request: EvalRequest, runs_dir: Path) -> tuple[dict, list[str]]:
    """(the data source, the problems) before anything starts: metrics, the target, the limit, and
    for a local file its records (a Hub dataset is checked by the evaluation process on its rows)."""
    problems = settings_problems(request)
    try:
        target = resolve(request.target, runs_dir)
        if target.vision and request.tasks:
            raise EvalError(f"{target.label} is a vision-language model, and lm-eval's tasks take a text model: "
                            "evaluate it on its own data (leave out --tasks, or the Evaluate tab's lm-eval tasks)")
        source = data_source(request, runs_dir)
    except (ChatError, EvalError, folder.DamagedRun) as error:
        return {}, problems + [str(error)]
    return source, problems + records_problems(source, request.metrics, read_records=not problems)


def records_problems(source: dict, metrics, read_records: bool = True) -> list[str]:
    """A local file's problems as an evaluation set: it is there, its one split, and (`read_records`)
    its first records against `metrics`; a Hub dataset is checked by the evaluation process on its rows."""
    path = sources.dataset_file(source["name"])
    missing = [p.replace("dataset_name: ", "evaluation set: ", 1) for p in sources.check_dataset(source["name"])]
    if path is None or missing:
        return missing
    if source["split"] != "train":
        return [f"split {source['split']!r}: a file has one split, train; leave the split out"]
    if not read_records:
        return []
    try:
        from studio_core.recipe.data_check import apply_column_map

        rows = apply_column_map(read_rows(path, 50), source["column_map"], None)
        return items_and_problems(rows, metrics, source["rewards"])[2]
    except ValueError as error:
        return [f"{source['name']}: {error}"]


class EvalProcess:
    """A running evaluation process and the pipe to it."""

    def __init__(self, proc, events, stderr_tail, out: Path, cores: list[int]):
        self.proc, self._events, self._stderr_tail, self.out, self.cores = proc, events, stderr_tail, out, cores

    @classmethod
    def start(cls, request: EvalRequest, runs_dir: str | Path, hardware: Hardware, cores: str | None = None,
              reading=None, checked: dict | None = None) -> EvalProcess:
        """Check the request (EvalError saying what to change), take a core and start the process.
        `checked`: the data source check_request gave for this request, which then is not checked
        again (the CLI checks before it probes the hardware)."""
        runs_dir = Path(runs_dir).expanduser()
        source, problems = (checked, []) if checked is not None else check_request(request, runs_dir)
        if problems:
            raise EvalError("\n".join(f"- {p}" for p in problems))
        target = resolve(request.target, runs_dir)
        out = results_dir(request.target, runs_dir)
        setup = {"target": asdict(target), "request": asdict(request), "source": source, "out": str(out),
                 "runs_dir": str(runs_dir), "backend": hardware.backend, "kind": "eval"}
        try:
            # a user's reward file may run in it (mean_reward): then without the Hub token, as at Start
            user_code = any(isinstance(r, dict) and "file" in r for r in source["rewards"])
            proc, events, stderr_tail, chosen = ChatProcess.spawn("studio_core.evaluate.eval_worker", setup, runs_dir,
                                                                  hardware, cores, without=HUB_TOKENS * user_code)
        except ChatError as error:
            raise EvalError(str(error)) from error
        return cls(proc, events, stderr_tail, out, chosen)

    def events(self, timeout: float = 600):
        """The process's events until it is done; EvalError if it fails."""
        import queue

        while True:
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                self.stop()
                raise EvalError(f"the evaluation said nothing for {timeout:.0f} s and was stopped") from None
            if event.get("type") == "eof":
                self.proc.wait()
                raise EvalError("the evaluation process ended without a result: "
                                + ("\n".join(self._stderr_tail[-6:]) or f"exit code {self.proc.returncode}"))
            if event.get("type") == "error":
                self.proc.wait()
                raise EvalError(event["message"])
            yield event
            if event.get("type") == "done":
                self.proc.wait()
                return

    def stop(self) -> None:
        """Stop after the row in progress; what is done so far is still saved."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                return

    def kill(self) -> None:
        kill(self.proc)
