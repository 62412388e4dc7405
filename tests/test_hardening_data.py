"""Issue 29, the data checks before launch: an eval_dataset file checked like the training file,
turns out of order counted by kind, a 20 MB record checked quickly and warned about, a Hub
dataset's records checked in the run like a local file's, records rendered through the model's
own chat template, and a dataset folder's files checked before `datasets` reads them.

Real files in tmp_path, the real check (recipe.validate.validate), the built-in model's real tokenizer, the
loopback Hub (tests/hub_standin.py) and the real `datasets` loader; no run is started.
"""

from __future__ import annotations

import json
import shutil

import pytest

from studio_core.data import sources
from studio_core.data.builtin import ensure_tiny_model
from studio_core.rundir import events as ev
from studio_core.recipe.spec import RunSpec, SpecError
from studio_core.recipe.validate import validate
from studio_core.training.train_data import load_checked_datasets
from test_hub_dataset import publish
from test_hub_download import hub  # noqa: F401 (fixture: the loopback Hub, an empty Hub cache)
from test_runs import REPO

pytestmark = pytest.mark.fast  # starts no run, torchrun, browser or app

USER, GOOD = {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}


def chats(n: int, odd: dict[int, list] | None = None) -> list[dict]:
    """n conversations; `odd`: line number -> messages of that line instead."""
    return [{"messages": (odd or {}).get(i + 1, [USER, GOOD])} for i in range(n)]


def write(path, rows: list[dict]):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def sft(*overrides: str) -> RunSpec:
    return RunSpec.load(REPO / "recipes" / "tiny-sft.yaml").with_overrides(list(overrides))


def checked(spec: RunSpec) -> tuple[list[str], list[str]]:
    warnings: list[str] = []
    return validate(spec, warnings=warnings), warnings


# --- 1. the eval_dataset file --------------------------------------------------------------------

def test_an_empty_eval_dataset_file_is_refused_before_launch(tmp_path):
    train = write(tmp_path / "train.jsonl", chats(8))
    empty = tmp_path / "eval.jsonl"
    empty.write_text("")
    problems, _ = checked(sft(f"dataset_name={train}", f"studio.eval_dataset={empty}"))
    assert problems == [f"studio.eval_dataset: {empty} is empty (0 bytes): it holds no records; give a file that does"]
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    (problem,) = checked(sft(f"dataset_name={train}", f"studio.eval_dataset={blank}"))[0]
    assert problem.startswith(f"studio.eval_dataset: {blank} is empty (blank lines only)")


def test_an_eval_dataset_file_of_the_wrong_schema_is_refused_naming_the_file(tmp_path):
    train = write(tmp_path / "train.jsonl", chats(8))
    wrong = write(tmp_path / "eval.jsonl", [{"question": "2 + 2?", "answer": "4"}] * 4)
    (problem,) = checked(sft(f"dataset_name={train}", f"studio.eval_dataset={wrong}"))[0]
    assert problem.startswith(f"studio.eval_dataset {wrong}: SFT needs")
    assert "studio.column_map: {question: prompt, answer: completion}" in problem
    # a bad record of the eval file, found where the training file's would be
    bad = write(tmp_path / "bad.jsonl", chats(6, {4: [USER, {"role": "bot", "content": "4."}]}))
    (problem,) = checked(sft(f"dataset_name={train}", f"studio.eval_dataset={bad}"))[0]
    assert problem.startswith(f"studio.eval_dataset: {bad}: line 4: `messages` message 2 has the role `bot`")
    good = write(tmp_path / "good.jsonl", chats(4))
    assert checked(sft(f"dataset_name={train}", f"studio.eval_dataset={good}")) == ([], [])


# --- 2. turns out of order -------------------------------------------------------------------------

def test_both_kinds_of_turns_out_of_order_are_counted_with_their_first_line(tmp_path):
    path = write(tmp_path / "order.jsonl", chats(30, {3: [GOOD, USER, GOOD], 9: [GOOD, USER, GOOD],
                                                      5: [USER, USER, GOOD], 12: [USER, USER, GOOD],
                                                      20: [USER, USER, GOOD]}))
    problems, warnings = checked(sft(f"dataset_name={path}"))
    assert problems == []
    first, twice = warnings
    assert first.startswith(f"dataset: {path}: 2 records of the first 30 start with an `assistant` turn, before any "
                            "user turn (line 3, line 9; the first, line 3, in `messages`: message 1)")
    assert twice.startswith(f"dataset: {path}: 3 records of the first 30 have two `user` turns in a row (line 5, "
                            "line 12, line 20; the first, line 5, in `messages`: messages 1 and 2); merge them")
    assert all(w.endswith("(this trains, but likely not as meant)") for w in warnings)


# --- 3. a 20 MB record -------------------------------------------------------------------------------

def test_a_20_mb_single_line_record_is_checked_and_warned_about(tmp_path):
    text = ("The quick brown fox jumps over the lazy dog. " * 450_000)[:20_000_000]
    path = write(tmp_path / "big.jsonl", [{"messages": [USER, {"role": "assistant", "content": text}]}])
    assert path.stat().st_size > 20_000_000
    problems, (warning,) = checked(sft(f"dataset_name={path}", "max_length=128"))
    assert problems == []
    times = int(warning.split(" is ")[1].split(" times")[0].replace(",", ""))
    assert times > 10_000  # ~9.8 million tokens: tens of thousands of times max_length
    assert warning.startswith(f"dataset: {path}: line 1 is {times:,} times longer than max_length (")
    assert "max_length 128) and will be cut (truncated) to max_length" in warning
    # a record within FAR times max_length is no warning: truncation of a little is usual
    near = write(tmp_path / "near.jsonl", [{"messages": [USER, {"role": "assistant", "content": "word " * 300}]}])
    assert checked(sft(f"dataset_name={near}", "max_length=128")) == ([], [])


# --- 4. a Hub dataset's records, in the run ----------------------------------------------------

def test_a_hub_datasets_records_get_the_role_checks_in_the_run(hub, tmp_path):  # noqa: F811
    rows = chats(12, {7: [USER, {"role": "bot", "content": "4."}], 9: [GOOD, USER, GOOD]})
    publish(hub, "alice/roles", {"data/train.parquet": rows}, tmp_path)
    spec = sft("dataset_name=alice/roles")
    with pytest.raises(SpecError) as refused:
        load_checked_datasets(spec, None)
    assert refused.value.problems == [
        "dataset: alice/roles: row 7: `messages` message 2 has the role `bot`, which chat templates do not know "
        "(Qwen3's drops the turn); change it to `assistant` in the data"]
    publish(hub, "alice/order", {"data/train.parquet": chats(12, {9: [GOOD, USER, GOOD]})}, tmp_path)
    events = tmp_path / "events.jsonl"
    load_checked_datasets(sft("dataset_name=alice/order"), events)
    logged = [e["message"] for e in ev.read(events) if e["type"] == "log"]
    assert any(m.startswith("warning: dataset: alice/order: 1 record of the first 12 starts with an `assistant` turn")
               for m in logged), logged


# --- 5. the model's own chat template ----------------------------------------------------------

ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
               "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_records_are_rendered_through_the_models_chat_template_before_launch(tmp_path):
    model = tmp_path / "model"  # the tiny model's tokenizer, config and weights, a stricter template
    model.mkdir()
    for f in ensure_tiny_model().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "config", "model.")):
            shutil.copy(f, model / f.name)
    (model / "chat_template.jinja").write_text(ALTERNATING)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    path = write(tmp_path / "data.jsonl", chats(10, {3: [USER, USER, GOOD]}))
    (problem,) = checked(sft(f"dataset_name={path}", f"model_name_or_path={model}"))[0]
    assert problem.startswith(f"dataset: {path}: line 3: the model's chat template cannot render `messages` "
                              "(TemplateError: Conversation roles must alternate user/assistant/user/assistant/...)")
    # the built-in model's template takes the same record (a warning, not a refusal)
    problems, warnings = checked(sft(f"dataset_name={path}"))
    assert problems == [] and len(warnings) == 1
    assert checked(sft(f"dataset_name={write(tmp_path / 'ok.jsonl', chats(10))}",
                       f"model_name_or_path={model}")) == ([], [])


# --- 6. a dataset folder -------------------------------------------------------------------------

def test_a_folder_of_mixed_files_is_refused_naming_the_files(tmp_path):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write(mixed / "a.jsonl", chats(3))
    (mixed / "b.csv").write_text("prompt,completion\n2 + 2?,4\n")
    (problem,) = sources.check_dataset(str(mixed))
    assert problem == (f"dataset_name: {mixed} holds files of more than one format (JSON: a.jsonl; CSV: b.csv); "
                       "`datasets` would read only the most common format and skip the others without a word: keep "
                       "files of one format in the folder")
    text = tmp_path / "text"
    text.mkdir()
    write(text / "a.jsonl", chats(3))
    (text / "notes.txt").write_text("some notes\n")
    assert sources.check_dataset(str(text)) == [
        f"dataset_name: {text / 'notes.txt'}: .txt is not a format the studio reads in a dataset folder; use .jsonl, "
        f".json, .csv or .parquet, or move it out of {text}"]
    columns = tmp_path / "columns"
    columns.mkdir()
    write(columns / "a.jsonl", chats(3))
    write(columns / "b.jsonl", [{"prompt": "2 + 2?", "completion": "4"}])
    (problem,) = sources.check_dataset(str(columns))
    assert problem.startswith(f"dataset_name: {columns / 'b.jsonl'} has the columns prompt, completion and "
                              f"{columns / 'a.jsonl'} has messages")
    good = tmp_path / "good"
    good.mkdir()
    write(good / "a.jsonl", chats(3))
    write(good / "b.jsonl", chats(3))
    (good / "README.md").write_text("# a card\n")
    assert sources.check_dataset(str(good)) == []
