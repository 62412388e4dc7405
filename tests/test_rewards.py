"""Tests for GRPO reward functions described in a recipe (studio_core.recipe.rewards).

Broken user files are real files in tmp_path; the last test trains GRPO for 2 steps on the CPU
with the built-in tiny model and all three kinds of reward.
"""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from studio_core.recipe.rewards import (
    ExactMatchReward,
    LengthReward,
    RegexReward,
    RewardError,
    check_rewards,
    check_rewards_in_subprocess,
    completion_text,
    reward_functions,
)

STANDARD_ROWS = [{"prompt": "Say 2+2.", "reference": "4"}, {"prompt": "Say 3+3.", "reference": "6"}]
CHAT_ROWS = [{"prompt": [{"role": "user", "content": "Say 2+2."}], "reference": "4"},
             {"prompt": [{"role": "user", "content": "Say 3+3."}], "reference": "6"}]
DEF = "def my_reward(completions, **kwargs):\n"


def chat(text):
    return [{"role": "assistant", "content": text}]


def user_file(tmp_path, source, name="my_rewards.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def one_problem(rewards, rows=STANDARD_ROWS):
    problems = check_rewards(rewards, rows)
    assert len(problems) == 1, problems
    return problems[0]


@pytest.mark.fast
def test_module_imports_neither_torch_nor_trl():
    code = "import sys, studio_core.recipe.rewards; print(sorted({'torch', 'trl', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.fast
def test_completion_text_reads_the_last_assistant_message():
    assert completion_text("plain") == "plain"
    assert completion_text([{"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"},
                            {"role": "assistant", "content": "b"}]) == "b"
    assert completion_text(chat([{"type": "text", "text": "x"}, {"type": "image"}])) == "x"
    assert completion_text([]) == ""


@pytest.mark.fast
@pytest.mark.parametrize("wrap", [str, chat], ids=["standard", "conversational"])
def test_builtins(wrap):
    completions = [wrap("x" * 50), wrap("x" * 150), wrap(" 4 "), wrap("The end")]
    assert LengthReward(50)(completions) == [0.0, -1.0, -0.47, -0.43]
    assert RegexReward("^The ")(completions) == [0.0, 0.0, 0.0, 1.0]
    reference = ["x" * 50, "y", "4", None]
    exact = ExactMatchReward("reference")
    assert exact(completions, reference=reference, prompts=[""] * 4) == [1.0, 0.0, 1.0, 0.0]


@pytest.mark.fast
def test_reward_functions_names_and_weights(tmp_path):
    path = user_file(tmp_path, "def my_reward(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    funcs, weights = reward_functions([
        {"name": "length", "target": 50, "weight": 1.0},
        {"name": "regex", "pattern": "^The ", "weight": 0.5},
        {"name": "exact_match", "column": "reference"},
        {"file": path, "function": "my_reward", "weight": 2},
        {"name": "regex", "pattern": "end$"},
    ])
    assert [f.__name__ for f in funcs] == ["length", "regex", "exact_match", "my_reward", "regex_4"]
    assert weights == [1.0, 0.5, 1.0, 2.0, 1.0]
    assert funcs[3](completions=["a", "b"]) == [1.0, 1.0]
    assert funcs[4](["the end", "x"]) == [1.0, 0.0]


@pytest.mark.fast
def test_reward_functions_raises_on_a_bad_entry():
    with pytest.raises(RewardError, match=r"studio.rewards\[1\] \(length\): missing target"):
        reward_functions([{"name": "regex", "pattern": "a"}, {"name": "length"}])


@pytest.mark.fast
@pytest.mark.parametrize("rows", [STANDARD_ROWS, CHAT_ROWS], ids=["standard", "conversational"])
def test_good_rewards_pass(tmp_path, rows):
    path = user_file(tmp_path, """\
        def my_reward(prompts, completions, completion_ids, reference, trainer_state, **kwargs):
            assert trainer_state.global_step == 0 and len(completion_ids) == len(prompts) == len(reference)
            kwargs["log_metric"]("my_metric", 1.0)
            return [None if ref == "6" else 0.5 for ref in reference]
        """)
    rewards = [{"name": "length", "target": 50}, {"name": "regex", "pattern": "^The "},
               {"name": "exact_match", "column": "reference", "weight": 0.5},
               {"file": path, "function": "my_reward", "weight": 2.0}]
    assert check_rewards(rewards, rows) == []


@pytest.mark.fast
def test_async_user_function_passes(tmp_path):
    path = user_file(tmp_path, "async " + DEF + "    return [1.0] * len(completions)\n")
    assert check_rewards([{"file": path, "function": "my_reward"}], CHAT_ROWS) == []


@pytest.mark.fast
@pytest.mark.parametrize("entry, expected", [
    ({"name": "lenght"}, "'lenght' is not a built-in reward; choose one of length, regex, exact_match, or"),
    ({"name": "length"}, "missing target: a whole number of characters"),
    ({"name": "length", "target": "50"}, "target must be a whole number of characters, e.g. target: 200; got '50'"),
    ({"name": "length", "target": 5, "colour": 1}, "unknown key 'colour'; this reward takes target and weight"),
    ({"name": "length", "target": 5, "weight": "high"}, "weight must be a number, e.g. weight: 0.5; got 'high'"),
    ({"name": "length", "target": 50, "weight": True}, "weight must be a number"),
    ({"name": "regex", "pattern": "(a"}, "pattern '(a' is not a valid regular expression (missing ), unterminated"),
    ({"file": "a.py", "function": "f", "name": "length"}, "must be a mapping with either name:"),
    ("length", "must be a mapping with either name:"),
    ({"file": "a.py"}, "missing function: a function name in that file"),
])
def test_bad_entries(entry, expected):
    problem = one_problem([{"name": "regex", "pattern": "ok"}, entry])
    assert problem.startswith("studio.rewards[1]"), problem
    assert expected in problem


@pytest.mark.fast
def test_exact_match_on_a_missing_column():
    problem = one_problem([{"name": "exact_match", "column": "answer"}])
    assert problem == ("studio.rewards[0] (exact_match): column 'answer' is not in the dataset "
                       "(columns: prompt, reference); set column: to one of them")


@pytest.mark.fast
def test_no_rows_or_no_rewards():
    assert "no rows with a 'prompt' column" in one_problem([{"name": "length", "target": 5}], rows=[{"text": "a"}])
    assert "must be a non-empty list" in one_problem([])


@pytest.mark.fast
def test_missing_file(tmp_path):
    problem = one_problem([{"file": str(tmp_path / "nope.py"), "function": "f"}])
    assert problem.startswith(f"studio.rewards[0] ({tmp_path / 'nope.py'}:f): file ")
    assert "does not exist" in problem


BROKEN_FILES = {  # source, then two parts of the expected message
    "syntax error": (DEF + "    return [1.0 for c in completions\n",
                     "importing my_rewards.py raised SyntaxError: ",
                     "at my_rewards.py line 2: `return [1.0 for c in completions`; fix the file so that `python "),
    "raises at import": ("import json\nSETTINGS = json.loads('{bad')\n",
                         "importing my_rewards.py raised JSONDecodeError: ",
                         "at my_rewards.py line 2: `SETTINGS = json.loads('{bad')`"),
    "exits at import": ("import sys\nsys.exit(3)\n", "importing my_rewards.py raised SystemExit: 3", "line 2"),
    "raises when called": (DEF + "    scores = {}\n    return [scores[c] for c in completions]\n",
                           "calling it on 2 sample rows raised KeyError: 'The answer is 42.' at my_rewards.py line 3: "
                           "`return [scores[c] for c in completions]`",
                           "fix the function (completions are strings for this dataset)"),
    "wrong signature": ("def my_reward(completions):\n    return [1.0]\n",
                        "raised TypeError: my_reward() got an unexpected keyword argument",
                        "TRL calls it as f(prompts=, completions=, completion_ids=, <dataset columns>=, "),
    "wrong return type": (DEF + "    return 1.0\n",
                          "returned 1.0 (float); return a list with one float (or None) per completion", ""),
    "wrong length": (DEF + "    return [1.0]\n",
                     "returned 1 rewards for 2 completions; return one per completion", ""),
    "wrong element": (DEF + "    return ['good' for c in completions]\n",
                      "returned 'good' (str) at position 0; each reward must be a float", ""),
    "all NaN": (DEF + "    return [float('nan')] * len(completions)\n",
                "returned no usable reward for any of the 2 sample completions (all None or NaN); return a finite "
                "float for each completion", ""),
    "all None": (DEF + "    return [None for c in completions]\n",
                 "returned no usable reward for any of the 2 sample completions", ""),
    "an infinite reward": (DEF + "    return [1.0, float('-inf')]\n",
                           "returned -inf at position 1; each reward must be a finite float", ""),
    "missing function": ("def other(completions, **kwargs):\n    return [1.0]\n",
                         "my_rewards.py has no 'my_reward'; it defines: other; set function: to one of them", ""),
    "not callable": ("my_reward = 0.5\n", "'my_reward' in my_rewards.py is 0.5 (float), not a function", ""),
}


@pytest.mark.fast
@pytest.mark.parametrize("case", BROKEN_FILES)
def test_broken_user_files(tmp_path, case):
    source, what, where = BROKEN_FILES[case]
    path = user_file(tmp_path, source)
    problem = one_problem([{"name": "length", "target": 5}, {"file": path, "function": "my_reward"}])
    assert problem.startswith(f"studio.rewards[1] ({path}:my_reward): "), problem
    assert what in problem and where in problem, problem


@pytest.mark.fast
def test_user_function_named_like_a_builtin(tmp_path):
    path = user_file(tmp_path, "def length(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    problem = one_problem([{"name": "length", "target": 5}, {"file": path, "function": "length"}])
    assert "logs it as rewards/length, like studio.rewards[0] (length)" in problem


@pytest.mark.fast
def test_every_problem_is_reported_at_once(tmp_path):
    path = user_file(tmp_path, "def my_reward(completions, **kwargs):\n    return None\n")
    problems = check_rewards([{"name": "regex", "pattern": "["}, {"name": "exact"},
                              {"file": path, "function": "my_reward"}], CHAT_ROWS)
    assert [p.split(":")[0] for p in problems] == [
        "studio.rewards[0] (regex)", "studio.rewards[1] (exact)", f"studio.rewards[2] ({path}"]


@pytest.mark.fast
def test_without_rows_functions_are_imported_and_looked_up_but_not_called(tmp_path):
    # A Hub dataset is not read before launch: a function that reads one of its real columns must
    # not be refused on made-up rows (the worker calls it on the first real rows)
    path = user_file(tmp_path, "def f(completions, completion, **kwargs):\n"
                               "    return [float(len(c) < len(r)) for c, r in zip(completions, completion)]\n"
                               "def raises(completions, **kwargs):\n    raise RuntimeError('only when called')\n")
    assert check_rewards([{"file": path, "function": "f"}, {"file": path, "function": "raises"},
                          {"name": "exact_match", "column": "reference"}], None) == []
    assert "on 2 sample rows raised TypeError" in one_problem([{"file": path, "function": "f"}])
    for case in ("syntax error", "raises at import", "missing function", "not callable"):
        broken = user_file(tmp_path, BROKEN_FILES[case][0], name=f"{case.replace(' ', '_')}.py")
        (problem,) = check_rewards([{"file": broken, "function": "my_reward"}], None)
        assert BROKEN_FILES[case][1].replace("my_rewards.py", f"{case.replace(' ', '_')}.py") in problem, problem
    problems = check_rewards_in_subprocess([{"file": path, "function": "f"}, {"file": path, "function": "g"}], None)
    assert len(problems) == 1 and "has no 'g'; it defines: f, raises" in problems[0]


def test_subprocess_check(tmp_path):
    good = user_file(tmp_path, "print('hello from the user file')\n"
                               "def my_reward(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    assert check_rewards_in_subprocess([{"file": good, "function": "my_reward"}], CHAT_ROWS) == []
    bad = user_file(tmp_path, DEF + "    return 1 / 0\n", name="bad.py")
    rewards = [{"name": "length", "target": 5}, {"file": bad, "function": "my_reward"}]
    problems = check_rewards_in_subprocess(rewards, STANDARD_ROWS)
    assert len(problems) == 1 and "ZeroDivisionError: division by zero at bad.py line 2" in problems[0]


def test_subprocess_check_stops_a_function_that_hangs(tmp_path):
    # The helper process it starts holds the check's output pipes: it must be stopped too.
    path = user_file(tmp_path, """\
        import subprocess, sys, time
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        def my_reward(completions, **kwargs):
            time.sleep(60)
        """)
    start = time.monotonic()  # a short timeout: the test waits all of it
    problems = check_rewards_in_subprocess([{"file": path, "function": "my_reward"}], STANDARD_ROWS, timeout=4)
    assert time.monotonic() - start < 14
    assert problems == [f"studio.rewards[0] ({path}:my_reward): did not finish within 4 s (an endless loop, or "
                        "waiting on the network or a lock?); the check was stopped. Make importing the file and "
                        "calling the function fast"]


@pytest.mark.fast
def test_subprocess_check_reports_a_crash(tmp_path):
    path = user_file(tmp_path, "import os\nos._exit(7)\n")
    problems = check_rewards_in_subprocess([{"file": path, "function": "my_reward"}], STANDARD_ROWS)
    assert len(problems) == 1
    assert problems[0].startswith(f"studio.rewards[0] ({path}:my_reward): the check process exited with code 7")


def test_grpo_trains_with_the_rewards(tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from studio_core.data.builtin import ensure_tiny_model

    path = user_file(tmp_path, "def always_one(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    rewards = [{"name": "length", "target": 20}, {"name": "exact_match", "column": "reference", "weight": 2.0},
               {"file": path, "function": "always_one", "weight": 0.5}]
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "reference": str(2 * i)}
            for i in range(4)]
    assert check_rewards(rewards, rows) == []
    funcs, weights = reward_functions(rewards)
    args = GRPOConfig(use_cpu=True, bf16=False, max_steps=2, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, report_to="none", output_dir=str(tmp_path / "out"),
                      reward_weights=weights, logging_steps=1)
    trainer = GRPOTrainer(model=str(ensure_tiny_model(tmp_path / "m")), reward_funcs=funcs, args=args,
                          train_dataset=Dataset.from_list(rows))
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert len(logs) == 2
    for log in logs:
        for name in ("length", "exact_match", "always_one"):
            assert f"rewards/{name}/mean" in log and f"rewards/{name}/std" in log
        assert log["rewards/always_one/mean"] == 1.0
        assert -1.0 < log["rewards/length/mean"] <= 0.0
        weighted = log["rewards/length/mean"] + 2.0 * log["rewards/exact_match/mean"] + 0.5
        assert log["reward"] == pytest.approx(weighted, abs=1e-5)


@pytest.mark.fast
def test_reward_code_checked_in_this_process_never_sees_the_hub_token(tmp_path, monkeypatch):
    # the worker checks a Hub dataset's first rows in its own process, the token still in its environment
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token_for_the_test")
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    path = user_file(tmp_path, """\
        import os
        from huggingface_hub import get_token
        AT_IMPORT = (os.environ.get("HF_TOKEN"), get_token())

        def my_reward(completions, **kwargs):
            assert AT_IMPORT == (None, None) and (os.environ.get("HF_TOKEN"), get_token()) == (None, None)
            return [1.0] * len(completions)
        """)
    assert check_rewards([{"file": path, "function": "my_reward"}], STANDARD_ROWS) == []
    assert os.environ["HF_TOKEN"] == "hf_fake_token_for_the_test"  # back for the worker's own downloads
