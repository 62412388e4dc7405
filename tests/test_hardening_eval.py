"""Issue 29's evaluation and chat findings, for real on the session's tiny trained runs
(conftest's trained_runs: a full and a LoRA SFT run of the built-in Q&A set):

- an evaluation set with prompts longer than the largest prompt bucket: those rows are skipped,
  not scored as wrong answers, and the summary (summary.json, `launch.py eval`'s printout, the
  Evaluate tab's text) says how many, how long against the bucket, and the setting that lets
  them in; a set whose every prompt is too long is refused before the model is loaded, and a
  longer cache (--max-cache-len) lets them in;
- a LoRA run's input shapes are counted (they reach the Transformers model under the PEFT
  wrapper, which generate() bypasses), in chat and in an evaluation, as a full run's are;
- the Chat tab's messages with Single-turn off (the whole conversation) and on (the message alone).

    .venv/bin/python -m pytest -q tests/test_hardening_eval.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cli.main import main
from conftest import make_unloadable
from studio_core.data.builtin import BUILTIN_DATASETS, BUILTIN_MODEL
from studio_core.serve.chat import ChatProcess
from studio_core.evaluate.evaluation import EvalError, EvalProcess, EvalRequest, check_request, read_rows_file
from studio_core.machine.hardware import cpu_hardware

QA = [json.loads(line) for line in BUILTIN_DATASETS["builtin:qa"].read_text().splitlines() if line.strip()]


def long_row(repeats: int) -> dict:
    """A question of about 5 x `repeats` tokens, over the largest bucket (512) for repeats >= 110."""
    return {"messages": [{"role": "user", "content": "tell me more " * repeats},
                         {"role": "assistant", "content": "No."}]}


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_over_long_prompts_are_skipped_and_said_and_a_lora_evaluation_counts_its_shapes(trained_runs, tmp_path,
                                                                                         capsys):
    from app.eval_tab import about

    manager, ids = trained_runs
    runs_dir = tmp_path / "runs"
    shutil.copytree(manager.runs_dir / ids["lora"], runs_dir / ids["lora"])
    # prompts #2 and #5 are too long; the other four are questions the run learned to answer
    rows = [QA[0], long_row(120), QA[1], QA[2], long_row(150), QA[3]]
    data = write_rows(tmp_path / "mixed.jsonl", rows)
    code = main(["eval", ids["lora"], "--data", data, "--metrics", "exact_match,rouge_l", "--max-new-tokens", "32",
                 "--runs-dir", str(runs_dir), "--backend", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0, err
    [saved] = (runs_dir / ids["lora"] / "eval").glob("*/summary.json")
    summary = json.loads(saved.read_text())
    skipped = summary["skipped"]
    assert summary["rows"] == summary["of_rows"] == 4 and not summary["stopped"]
    assert skipped["count"] == 2 and skipped["of"] == 6 and [p["index"] for p in skipped["prompts"]] == [1, 4]
    assert all(p["prompt_tokens"] > skipped["largest_bucket"] == 512 for p in skipped["prompts"])
    assert skipped["max_cache_len"] == summary["max_cache_len"] == 1024
    message = skipped["message"]
    for said in ("2 of 6 prompts (#2, #5) were not scored", "over the largest prompt bucket, 512 tokens",
                 "a cache of 1024 tokens less 32 for the answer", "raise the cache length to 1056 or more",
                 "--max-cache-len", "Cache length"):
        assert said in message
    # the skipped rows are neither answered nor counted: the four learned answers score full marks
    answered = read_rows_file(saved.parent)
    assert [r["prompt"][-1]["content"] for r in answered] == [QA[i]["messages"][0]["content"] for i in range(4)]
    assert summary["results"]["tuned"]["exact_match"] == 1.0
    assert f"Skipped: {message}." in out  # the CLI's printed summary
    assert "(2 too long, skipped: see the summary)" in err
    assert f"**Skipped:** {message}." in about({**summary, "dir": str(saved.parent)})  # the Evaluate tab's text
    # a LoRA run's answers reach the model: the decode shape and the questions' one prefill bucket,
    # with the adapter on (tuned) and off (base), as a full run's
    assert summary["shapes"] == [[1, 1], [1, 64]] and summary["buckets"] == [64]


def test_a_set_of_only_over_long_prompts_is_refused_before_loading_and_a_longer_cache_takes_them(trained_runs,
                                                                                                 tmp_path):
    manager, ids = trained_runs
    runs_dir = tmp_path / "runs"
    run_dir = runs_dir / ids["full"]
    shutil.copytree(manager.runs_dir / ids["full"], run_dir)
    data = write_rows(tmp_path / "long.jsonl", [long_row(120), long_row(130)])
    # the model's weights made unloadable (kept aside): a refusal that loaded the model would fail on them instead
    weights = sorted((run_dir / "output").glob("*.safetensors"))
    assert weights
    for path in weights:
        shutil.copy2(path, tmp_path / path.name)
        make_unloadable(path)
    request = EvalRequest(ids["full"], data=data, metrics=("exact_match",), max_new_tokens=8)
    evaluation = EvalProcess.start(request, runs_dir, cpu_hardware())
    seen = []
    with pytest.raises(EvalError) as refused:
        for event in evaluation.events():
            seen.append(event["type"])
    assert "loaded" not in seen and "cannot load" not in str(refused.value)
    assert str(refused.value).startswith("nothing to evaluate: every prompt (#1, #2) is too long:")
    assert "raise the cache length to 1032 or more (--max-cache-len" in str(refused.value)
    assert not (run_dir / "eval").exists() or not list((run_dir / "eval").glob("*/summary.json"))

    for path in weights:
        (tmp_path / path.name).replace(run_dir / "output" / path.name)
    longer = EvalRequest(ids["full"], data=data, metrics=("answer_tokens",), max_new_tokens=8, max_cache_len=1032)
    done = list(EvalProcess.start(longer, runs_dir, cpu_hardware()).events())[-1]
    summary = done["summary"]
    assert summary["rows"] == 2 and summary["skipped"] is None and summary["buckets"] == [1024]


def test_a_lora_chat_counts_its_input_shapes_as_a_full_runs_chat_does(trained_runs):
    manager, ids = trained_runs
    question = [{"role": "user", "content": QA[1]["messages"][0]["content"]}]
    shapes = {}
    for key in ("full", "lora"):
        chat = ChatProcess.start(ids[key], manager.runs_dir, cpu_hardware())
        try:
            tuned = list(chat.generate(question, max_new_tokens=16))[-1]
            base = list(chat.generate(question, which="base", max_new_tokens=16))[-1]
        finally:
            chat.unload()
        assert tuned["text"] == QA[1]["messages"][1]["content"]
        shapes[key] = (tuned["shapes"], base["shapes"])
    assert shapes["lora"] == shapes["full"] == ([[1, 1], [1, 64]], [[1, 1], [1, 64]])


@pytest.mark.fast
def test_single_turn_asks_the_message_alone_and_the_default_the_whole_conversation():
    from app.chat_tab import HISTORY_NOTE, asked

    earlier = [{"role": "user", "content": "What colour is the studio mascot?"},
               {"role": "assistant", "content": "<think>hm</think>The studio mascot is teal."}]
    new = {"role": "user", "content": "What is the name of the studio cat?"}
    assert asked(earlier, new["content"], "Be terse.", thinking=False, single_turn=False) == [
        {"role": "system", "content": "Be terse."}, earlier[0],
        {"role": "assistant", "content": "The studio mascot is teal."}, new]  # its reasoning left out
    assert asked(earlier, new["content"], "Be terse.", thinking=False, single_turn=True) == [
        {"role": "system", "content": "Be terse."}, new]
    assert asked(earlier, new["content"], "", thinking=False, single_turn=True) == [new]
    assert "sees the whole conversation" in HISTORY_NOTE and "Clear" in HISTORY_NOTE


@pytest.mark.fast
def test_a_cache_too_short_for_a_prompt_bucket_and_the_answer_is_refused_saying_the_range(tmp_path):
    for length, said in ((100, "max_cache_len 100: use 128 (the smallest prompt bucket, 64 tokens, and "
                                "max_new_tokens) to 16384"), (20000, "max_cache_len 20000: use 128")):
        _, problems = check_request(EvalRequest(BUILTIN_MODEL, data="builtin:qa", max_cache_len=length), tmp_path)
        assert any(said in p for p in problems), problems
    assert check_request(EvalRequest(BUILTIN_MODEL, data="builtin:qa", max_cache_len=2048), tmp_path)[1] == []
