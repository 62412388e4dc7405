"""lm-eval tasks on the built-in tiny model (studio_core.evaluate.harness): YAML tasks of our own over
local JSONL files, each built so that its score is known in advance, on a model loaded once
for the module; the checks before a run; and the module staying light for the web app.

No Hub: the tasks read local files through the `json` builder of `datasets`. The check of an
unknown name builds lm-eval's index of its own tasks once (about 20 s on a quiet 2-core machine).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from studio_core.evaluate import harness
from studio_core.data.builtin import ensure_tiny_model

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = [f"Question {i}: what is {i} plus {i}?" for i in range(8)]


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = ensure_tiny_model()
    return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder), folder


def write_task(folder: Path, name: str, rows: list[dict], **config) -> None:
    """A YAML task `name` over `rows`, written as a JSONL file beside it (an absolute path:
    `datasets` reads data_files from the working directory, not from the YAML's folder)."""
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", **config}
    (folder / f"{name}.yaml").write_text(json.dumps(task, indent=1))  # JSON is YAML


def greedy_answer(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """What greedy decoding writes after `prompt`, up to a newline (the tasks' stop sequence)."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split("\n")[0]


@pytest.fixture(scope="module")
def tasks(tiny, tmp_path_factory):
    """The include folder: tasks whose scores are known, and one whose score is the model's."""
    model, tokenizer, _ = tiny
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    acc = [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]
    # Two identical choices score the same, and lm-eval picks the first of equals (argmax): acc
    # is the share of docs whose target is 0, 3 of 8, or 3 of the first 4 with limit=4.
    write_task(folder, "tiny_same_choices",
               [{"question": q, "choices": ["four", "four"], "label": 0 if i < 3 else 1} for i, q in enumerate(QUESTIONS)],
               output_type="multiple_choice", doc_to_text="{{question}}", doc_to_choice="choices",
               doc_to_target="label", metric_list=acc)
    # Real choices: the score is whatever the tiny model makes of them.
    write_task(folder, "tiny_choice",
               [{"question": q, "choices": ["yes", "no", "maybe"], "label": i % 3} for i, q in enumerate(QUESTIONS)],
               output_type="multiple_choice", doc_to_text="{{question}}", doc_to_choice="choices",
               doc_to_target="label", metric_list=acc)
    # Generation: half the targets are what greedy decoding writes, half can never be: exact_match 0.5.
    prompts = QUESTIONS[:4]
    answers = [greedy_answer(model, tokenizer, p, max_new_tokens=3) for p in prompts]
    write_task(folder, "tiny_echo",
               [{"prompt": p, "answer": a if i % 2 == 0 else a + " (never written)"}
                for i, (p, a) in enumerate(zip(prompts, answers))],
               output_type="generate_until", doc_to_text="{{prompt}}", doc_to_target="{{answer}}",
               generation_kwargs={"until": ["\n"], "max_gen_toks": 3, "do_sample": False},
               metric_list=[{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}])
    # Perplexity of whole texts: a number that moves with any change to the model's weights.
    write_task(folder, "tiny_perplexity", [{"text": q} for q in QUESTIONS[:4]],
               output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="{{text}}",
               metric_list=[{"metric": "word_perplexity"}])
    return folder


@pytest.fixture(scope="module")
def base_results(tiny, tasks):
    """All four tasks in one run of the base model (each run also collects lm-eval's environment
    report, about a second)."""
    model, tokenizer, _ = tiny
    names = ["tiny_same_choices", "tiny_choice", "tiny_echo", "tiny_perplexity"]
    return harness.run_tasks(model, tokenizer, names, include_path=str(tasks))


def test_multiple_choice_scores_what_lm_eval_counted(tiny, tasks, base_results):
    assert json.loads(json.dumps(base_results, allow_nan=False)) == base_results
    assert base_results["tiny_same_choices"]["acc"] == pytest.approx(3 / 8)
    assert base_results["tiny_same_choices"]["samples"] == 8
    real = base_results["tiny_choice"]
    assert 0 <= real["acc"] <= 1 and real["samples"] == 8
    assert real["acc_stderr"] > 0  # lm-eval's standard error, under the cleaned name
    assert not any("," in metric for metrics in base_results.values() for metric in metrics)

    model, tokenizer, _ = tiny
    limited = harness.run_tasks(model, tokenizer, ["tiny_same_choices"], include_path=str(tasks), limit=4)
    assert limited["tiny_same_choices"] == {"acc": pytest.approx(3 / 4), "acc_stderr": pytest.approx(0.25),
                                            "samples": 4}


def test_generation_is_scored_against_what_the_model_writes(base_results):
    assert base_results["tiny_echo"]["exact_match"] == 0.5
    assert base_results["tiny_echo"]["samples"] == 4


def test_a_peft_model_is_evaluated_through_its_adapter(tiny, tasks, base_results):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    _, tokenizer, folder = tiny
    base = base_results["tiny_perplexity"]

    def with_lora(init_lora_weights):  # its own copy of the base: get_peft_model changes the model it wraps
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=init_lora_weights)
        peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), lora)
        return harness.run_tasks(peft_model, tokenizer, ["tiny_perplexity"], include_path=str(tasks))["tiny_perplexity"]

    # A new LoRA adapter adds zero (its B matrix starts at 0): the base model's perplexity exactly.
    assert with_lora(True) == base
    # Random A and B change the outputs: lm-eval ran the adapter, not the base under it.
    assert with_lora(False)["word_perplexity"] != pytest.approx(base["word_perplexity"])
    assert base["samples"] == 4 and base["word_perplexity"] > 1


def test_the_checks_say_what_to_change(tasks, tmp_path):
    assert harness.available()
    assert harness.check_tasks(["tiny_same_choices", "tiny_echo"], str(tasks)) == []

    [missing] = harness.check_tasks(["tiny_echo"], str(tmp_path / "no-such-folder"))
    assert "no-such-folder is not a folder" in missing

    # One misspelled name of ours, one of lm-eval's own (its index is built here, once)
    problems = harness.check_tasks(["tiny_echo", "tiny_same_choice", "hellaswg"], str(tasks))
    assert len(problems) == 2
    assert "'tiny_same_choice'" in problems[0] and "did you mean 'tiny_same_choices'" in problems[0]
    assert "'hellaswg'" in problems[1] and "'hellaswag'" in problems[1]
    assert harness.check_tasks(["hellaswag"], None) == []  # from the cached names this time


def test_importing_the_module_loads_neither_torch_nor_lm_eval():
    code = ("import sys, studio_core.evaluate.harness as h; assert h.available();"
            "print(sorted(m for m in ('torch', 'lm_eval', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_checks_leave_no_variable_of_lm_evals_in_the_environment(tasks):
    # lm-eval's __init__ sets HF_XET_HIGH_PERFORMANCE as it is imported; after a check, in a process
    # that goes on to start runs, it would be in every run's environment (and no run would be forked
    # from a zygote started before). A fresh process, as neither name is set here yet.
    code = ("import os, sys; from studio_core.evaluate import harness as h;"
            "problems = h.check_tasks(['tiny_echo'], sys.argv[1]);"
            "import lm_eval; print(problems, sorted(n for n in h.LM_EVAL_SETS if n in os.environ))")
    env = {k: v for k, v in os.environ.items() if k not in harness.LM_EVAL_SETS}
    out = subprocess.run([sys.executable, "-c", code, str(tasks)], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[] []", out.stdout + out.stderr
    # the library does set one as it is imported (else this test would prove nothing)
    bare = subprocess.run([sys.executable, "-c", "import os, lm_eval; print(os.environ.get('HF_XET_HIGH_PERFORMANCE'))"],
                          env=env, capture_output=True, text=True, check=True)
    assert bare.stdout.strip() == "1"
