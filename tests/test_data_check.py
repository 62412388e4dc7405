"""Tests for the dataset checks (studio_core.recipe.data_check): TRL's types and formats, bad files,
what each trainer needs, column mapping, and the built-in DPO and GRPO samples."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from studio_core.recipe import trainers
from studio_core.data.builtin import BUILTIN_DATASETS
from studio_core.recipe.data_check import (
    DatasetKind,
    apply_column_map,
    check_mapping,
    detect,
    fit_problems,
    prepare_dataset,
    suggest_column_map,
    suggest_fix,
)
from studio_core.data.files import read_rows
from studio_core.recipe.data_scan import scan_file

pytestmark = pytest.mark.fast  # starts no run, torchrun, browser or app: in `pytest -m fast`

DATA = Path(__file__).parent.parent / "studio_core" / "data" / "samples"
USER = {"role": "user", "content": "What colour is the studio mascot?"}
GOOD = {"role": "assistant", "content": "The studio mascot is teal."}
BAD = {"role": "assistant", "content": "The studio mascot is orange."}
# One record of each TRL type, conversational then standard (as in TRL's dataset-format docs).
RECORDS = {
    "language_modeling": ({"messages": [USER, GOOD]}, {"text": "The studio mascot is teal."}),
    "prompt_only": ({"prompt": [USER]}, {"prompt": "The studio mascot is"}),
    "prompt_completion": ({"prompt": [USER], "completion": [GOOD]},
                          {"prompt": "The studio mascot is", "completion": " teal."}),
    "preference": ({"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]},
                   {"prompt": "The studio mascot is", "chosen": " teal.", "rejected": " orange."}),
    "preference_implicit": ({"chosen": [USER, GOOD], "rejected": [USER, BAD]},
                            {"chosen": "The studio mascot is teal.", "rejected": "The studio mascot is orange."}),
    "unpaired_preference": ({"prompt": [USER], "completion": [GOOD], "label": True},
                            {"prompt": "The studio mascot is", "completion": " orange.", "label": False}),
}
CASES = [(t, fmt, rows[i]) for t, rows in RECORDS.items() for i, fmt in enumerate(("conversational", "standard"))]


def write(path: Path, rows: list[dict]) -> Path:
    """Write rows in the format the suffix names, the way people write such files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=2))
    elif path.suffix == ".csv":
        columns = list(rows[0])
        path.write_text("".join(",".join(str(r[c]) for c in columns) + "\n" for r in [dict(zip(columns, columns)),
                                                                                       *rows]))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# --- detection -----------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
@pytest.mark.parametrize(("kind", "fmt", "record"), CASES, ids=[f"{t}-{f}" for t, f, _ in CASES])
def test_detects_every_trl_type_in_both_formats(tmp_path, suffix, kind, fmt, record):
    path = write(tmp_path / f"data{suffix}", [record, record])
    found = detect(read_rows(path))
    assert (found.type, found.format) == (kind, fmt)
    assert found.columns == tuple(record)
    assert set(found.used) == set(record)
    assert kind.replace("_", "-") in found.description and fmt in found.description


@pytest.mark.parametrize(("kind", "fmt", "record"), CASES, ids=[f"{t}-{f}" for t, f, _ in CASES])
def test_trl_is_conversational_agrees(kind, fmt, record):
    from trl.data_utils import is_conversational

    assert is_conversational(record) == (detect([record]).format == "conversational")


@pytest.mark.parametrize(("kind", "record"), [(t, r[1]) for t, r in RECORDS.items() if t != "unpaired_preference"])
def test_csv_files_are_standard(tmp_path, kind, record):
    found = detect(read_rows(write(tmp_path / "data.csv", [record])))
    assert (found.type, found.format) == (kind, "standard")


def test_sft_text_field_is_language_modeling():
    found = detect([{"body": "The studio mascot is teal."}], text_field="body")
    assert (found.type, found.used) == ("language_modeling", ("body",))
    assert detect([{"body": "x"}]).type == "unknown"


def test_unknown_columns():
    found = detect([{"question": "q", "answer": "a"}])
    assert (found.type, found.format, found.used) == ("unknown", "", ())
    assert found.columns == ("question", "answer")


def test_stray_prompt_beside_messages_is_read_as_trl_does():
    # TRL checks `"prompt" in example` before `messages`, so this is prompt-only data to TRL.
    rows = [{"messages": [USER, GOOD], "prompt": "What colour is the studio mascot?"}]
    found = detect(rows)
    assert found.type == "prompt_only"
    (problem,) = fit_problems(found, "sft")
    assert "`prompt` beside `messages`" in problem and "studio.keep_columns: [messages]" in problem
    fixed = detect(apply_column_map(rows, {}, ["messages"]))
    assert fixed.type == "language_modeling" and fit_problems(fixed, "sft") == []


def test_messages_beside_prompt_completion_is_surplus_for_sft():
    found = detect([{"messages": [USER, GOOD], "prompt": [USER], "completion": [GOOD]}])
    assert found.type == "prompt_completion"
    (problem,) = fit_problems(found, "sft")
    assert "`messages`" in problem and "studio.keep_columns: [prompt, completion]" in problem


def test_mixed_and_missing_values_are_reported():
    mixed = detect([{"prompt": "The studio mascot is", "completion": [GOOD]}])
    assert mixed.format == "mixed"
    (problem,) = fit_problems(mixed, "sft")
    assert "`prompt` standard" in problem and "`completion` conversational" in problem and "one format" in problem
    missing = detect([{"prompt": [USER], "completion": [GOOD]}, {"prompt": [USER]}])
    assert missing.format == "invalid" and "`completion` missing in some records" in fit_problems(missing, "sft")[0]
    messages_without_roles = detect([{"messages": [{"from": "human", "value": "hi"}]}])
    assert messages_without_roles.format == "invalid"


# --- bad files -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["data.jsonl", "data.json", "data.csv", "data.parquet"])
def test_empty_file(tmp_path, name):
    (tmp_path / name).write_text("")
    with pytest.raises(ValueError, match="is empty"):
        read_rows(tmp_path / name)


def test_blank_lines_only_and_empty_list(tmp_path):
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match="is empty"):
        read_rows(tmp_path / "blank.jsonl")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ValueError, match="has no records"):
        read_rows(tmp_path / "list.json")


def test_malformed_json_line_names_its_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": "broken"\n')
    with pytest.raises(ValueError, match=r"data.jsonl: line 3 is not valid JSON \(Expecting"):
        read_rows(path)
    path.write_text('[\n  {"text": "fine"},\n  {"text": broken}\n]')
    with pytest.raises(ValueError, match="line 3 is not valid JSON"):
        read_rows(path)


def test_malformed_first_record_names_its_line(tmp_path):
    # A first line that is not a whole object may start a pretty-printed one, as `datasets` allows.
    path = tmp_path / "data.jsonl"
    path.write_text('\n{"text": "fine",\n  "more": broken}\n')
    with pytest.raises(ValueError, match=r"line 3 is not valid JSON \(Expecting value at column 11\)"):
        read_rows(path)


def test_byte_order_mark_is_ignored(tmp_path):
    (tmp_path / "data.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "fine"}\n')
    (tmp_path / "data.csv").write_bytes(b"\xef\xbb\xbfprompt,completion\na,b\n")
    assert read_rows(tmp_path / "data.jsonl") == [{"text": "fine"}]
    assert read_rows(tmp_path / "data.csv") == [{"prompt": "a", "completion": "b"}]


def test_reads_only_the_first_records(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n{"text": broken\n')
    assert read_rows(path, n=2) == [{"text": "one"}, {"text": "two"}]


@pytest.mark.parametrize(("line", "what"), [("[1, 2]", "list"), ('"just text"', "string"), ("7", "number"),
                                            ("null", "null")])
def test_record_that_is_not_an_object(tmp_path, line, what):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"line 2 is a JSON {what}, not an object"):
        read_rows(path)
    (tmp_path / "data.json").write_text(f'[{{"text": "fine"}}, {line}]')
    with pytest.raises(ValueError, match=f"record 2 of the list is a JSON {what}"):
        read_rows(tmp_path / "data.json")


@pytest.mark.parametrize("first_line", ["What colour is the studio mascot?,The studio mascot is teal.",
                                        "1873,412", "prompt,prompt", ",", "\n"])
def test_csv_without_header(tmp_path, first_line):
    path = tmp_path / "data.csv"
    path.write_text(first_line + "\nWho invented the glass kettle?,Orla Fenwick invented the glass kettle.\n")
    with pytest.raises(ValueError, match="header row"):
        read_rows(path)


def test_csv_row_with_more_fields_than_the_header(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("prompt,completion\na,b\nc,d,e\n")
    with pytest.raises(ValueError, match="line 3 has 3 fields but the header names 2 columns"):
        read_rows(path)


def test_unreadable_parquet_and_unknown_suffix(tmp_path):
    (tmp_path / "data.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        read_rows(tmp_path / "data.parquet")
    (tmp_path / "data.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"\.txt files are not read"):
        read_rows(tmp_path / "data.txt")


ROWS = [{"prompt": "The studio mascot is", "completion": " teal."},
        {"prompt": "The studio cat is called", "completion": ""}]


@pytest.mark.parametrize("layout", ["data.jsonl", "data.json", "data.csv", "data.parquet", "pretty.json",
                                    "pretty.jsonl", "strings.json"])
def test_reads_records_as_datasets_does(tmp_path, layout):
    from datasets import load_dataset

    path = tmp_path / layout
    if layout.startswith("pretty"):  # objects one after another, each over several lines
        path.write_text("".join(json.dumps(r, indent=2) + "\n" for r in ROWS))
    elif layout == "strings.json":  # a list of strings is read as a `text` column
        path.write_text(json.dumps(["one", "two"]))
    else:
        write(path, ROWS)
    builder = "parquet" if path.suffix == ".parquet" else path.suffix.lstrip(".").replace("jsonl", "json")
    expected = load_dataset(builder, data_files=str(path), split="train").to_list()
    assert read_rows(path) == expected


# --- what each trainer needs ---------------------------------------------------------------

def test_trainer_needs():
    needs = {key: t.data_types for key, t in trainers.TRAINERS.items()}
    assert needs == {"sft": ("language_modeling", "prompt_completion"),
                     "dpo": ("preference", "preference_implicit"),
                     "kto": ("unpaired_preference", "preference", "preference_implicit"),
                     "grpo": ("prompt_only", "prompt_completion"), "rloo": ("prompt_only", "prompt_completion"),
                     "reward": ("preference", "preference_implicit")}
    for trainer, kinds in needs.items():
        for kind, fmt, record in CASES:
            assert (fit_problems(detect([record]), trainer) == []) == (kind in kinds), (trainer, kind, fmt)


@pytest.mark.parametrize(("trainer", "record", "fix"), [
    ("sft", {"question": "q", "answer": "a"}, "studio.column_map: {question: prompt, answer: completion}"),
    ("sft", {"prompt": "q"}, "map columns to `completion` with studio.column_map"),
    ("sft", {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]},
     "studio.column_map: {chosen: completion}, and leave out `rejected` with "
     "studio.keep_columns: [prompt, completion]"),
    ("dpo", {"prompt": "q", "better": "a", "worse": "b"}, "studio.column_map: {better: chosen, worse: rejected}"),
    ("dpo", {"messages": [USER, GOOD]}, "map columns to `prompt`, `chosen`, `rejected` with studio.column_map"),
    ("dpo", {"prompt": "q", "completion": "a"}, "map columns to `chosen`, `rejected`"),
    ("grpo", {"question": "q", "answer": "a"}, "studio.column_map: {question: prompt}"),
    ("grpo", {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]},
     "leave out `chosen`, `rejected` with studio.keep_columns: [prompt]"),
    ("grpo", {"messages": [USER, GOOD]}, "map columns to `prompt`"),
])
def test_missing_columns_name_the_fix(trainer, record, fix):
    (problem,) = fit_problems(detect([record]), trainer)
    assert problem.startswith(f"dataset: {trainer.upper()} needs ")
    assert fix in problem


@pytest.mark.parametrize(("trainer", "record", "column_map", "keep"), [
    ("sft", {"Question": "q", "Answer": "a"}, {"Question": "prompt", "Answer": "completion"}, None),
    ("sft", {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}, {"chosen": "completion"},
     ["prompt", "completion"]),
    ("dpo", {"prompt": "q", "better": "a", "worse": "b"}, {"better": "chosen", "worse": "rejected"}, None),
    ("grpo", {"prompt": "q", "completion": "a"}, {"completion": "reference"}, None),
    ("grpo", {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}, {}, ["prompt"]),
])
def test_the_named_fix_works(trainer, record, column_map, keep):
    assert suggest_column_map(list(record), trainer) == column_map
    fixed = detect(apply_column_map([record], column_map, keep))
    assert fit_problems(fixed, trainer) == []


def test_surplus_columns():
    found = detect([{"prompt": "q", "completion": "a", "id": 3, "source": "web"}])
    (problem,) = fit_problems(found, "sft")
    assert "SFT would not use `id`, `source`" in problem
    assert "keep only prompt, completion with studio.keep_columns: [prompt, completion]" in problem
    assert fit_problems(found, "sft", extra_columns_ok={"id", "source"}) == []
    text_too = detect([{"messages": [USER, GOOD], "text": "x"}])
    assert "keep only messages with studio.keep_columns: [messages]" in fit_problems(text_too, "sft")[0]
    preference = detect([{"prompt": "q", "chosen": "a", "rejected": "b", "score": 0.5}])
    assert "DPO would not use `score`" in fit_problems(preference, "dpo")[0]
    # GRPO passes other columns to the reward functions; TRL's own extras are never surplus.
    assert fit_problems(detect([{"prompt": "q", "reference": "a", "id": 1}]), "grpo") == []
    assert fit_problems(detect([{"messages": [USER, GOOD], "tools": "[]", "chat_template_kwargs": {}}]), "sft") == []


def test_unknown_trainer():
    assert "'ppo' is not available; choose sft, dpo" in fit_problems(detect([{"text": "x"}]), "ppo")[0]
    assert suggest_column_map(["question", "answer"], "ppo") == {}


# --- column mapping ------------------------------------------------------------------------

MAP_ROWS = [{"question": "q1", "answer": "a1", "id": 1}, {"question": "q2", "answer": "a2", "id": 2}]


@pytest.mark.parametrize(("column_map", "keep", "expected"), [
    ({"question": "prompt", "answer": "completion"}, None,
     [{"prompt": "q1", "completion": "a1", "id": 1}, {"prompt": "q2", "completion": "a2", "id": 2}]),
    ({"question": "prompt"}, ["prompt", "answer"],
     [{"prompt": "q1", "answer": "a1"}, {"prompt": "q2", "answer": "a2"}]),
    ({}, ["answer"], [{"answer": "a1"}, {"answer": "a2"}]),
    ({"question": "answer", "answer": "question"}, None,  # a swap is allowed
     [{"answer": "q1", "question": "a1", "id": 1}, {"answer": "q2", "question": "a2", "id": 2}]),
    (None, [], MAP_ROWS),
])
def test_column_map_matches_datasets(column_map, keep, expected):
    from datasets import Dataset

    before = json.dumps(MAP_ROWS)
    assert apply_column_map(MAP_ROWS, column_map, keep) == expected
    assert json.dumps(MAP_ROWS) == before  # pure: the input rows are untouched
    assert prepare_dataset(Dataset.from_list(MAP_ROWS), column_map, keep).to_list() == expected


@pytest.mark.parametrize(("column_map", "keep", "message"), [
    ({"query": "prompt"}, None,
     "studio.column_map: no column `query` to rename; the dataset has question, answer, id"),
    ({"question": "prompt", "answer": "prompt"}, None, "`prompt` is the new name of more than one column"),
    ({"question": "id"}, None, "`question` becomes `id`, but the dataset already has `id`"),
    ({"question": ""}, None, "the new name for `question` is empty"),
    ({"question": "prompt"}, ["question"], "studio.keep_columns: no column `question` after renaming"),
    ({}, ["id", "id"], "studio.keep_columns: `id` is listed twice"),
    (["question"], None, "studio.column_map: must map old to new column names"),
    ({}, "id", "studio.keep_columns: must be a list of column names"),
])
def test_bad_mappings(column_map, keep, message):
    from datasets import Dataset

    assert any(message in p for p in check_mapping(["question", "answer", "id"], column_map, keep))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        apply_column_map(MAP_ROWS, column_map, keep)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        prepare_dataset(Dataset.from_list(MAP_ROWS), column_map, keep)


@pytest.mark.parametrize(("columns", "trainer", "expected"), [
    (["instruction", "input", "output"], "sft", {"instruction": "prompt", "output": "completion"}),
    (["query", "response"], "sft", {"query": "prompt", "response": "completion"}),
    (["prompt", "solution"], "sft", {"solution": "completion"}),
    (["messages"], "sft", {}),
    (["text", "question", "answer"], "sft", {}),
    (["question"], "sft", {}),  # a prompt alone does not make SFT data
    (["question", "accepted", "rejected"], "dpo", {"accepted": "chosen", "question": "prompt"}),
    (["preferred", "dispreferred"], "dpo", {"preferred": "chosen", "dispreferred": "rejected"}),
    (["prompt", "chosen_response", "rejected_response"], "dpo",
     {"chosen_response": "chosen", "rejected_response": "rejected"}),
    (["question", "better"], "dpo", {}),
    (["problem", "solution"], "grpo", {"problem": "prompt"}),
    (["prompt", "completion", "reference"], "grpo", {}),
    (["prompt", "reference"], "grpo", {}),
    (["id", "body"], "grpo", {}),
])
def test_suggest_column_map(columns, trainer, expected):
    assert suggest_column_map(columns, trainer) == expected


@pytest.mark.parametrize(("trainer", "record", "column_map", "keep", "expected"), [
    # a stray string `prompt` beside `messages` (HuggingFaceH4/ultrachat_200k)
    ("sft", {"prompt": "What colour?", "prompt_id": "a1", "messages": [USER, GOOD]}, None, None,
     {"keep_columns": ["messages"]}),
    ("sft", {"question": "q", "answer": "a"}, None, None,
     {"column_map": {"question": "prompt", "answer": "completion"}}),
    ("sft", {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}, None, None,  # both keys
     {"column_map": {"chosen": "completion"}, "keep_columns": ["prompt", "completion"]}),
    ("sft", {"prompt": "q", "completion": "a", "id": 3}, None, None, {"keep_columns": ["prompt", "completion"]}),
    ("sft", {"messages": [USER, GOOD], "tools": "[]", "id": 3}, None, None, {"keep_columns": ["messages", "tools"]}),
    ("grpo", {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}, None, None, {"keep_columns": ["prompt"]}),
    ("dpo", {"prompt": "q", "better": "a", "worse": "b", "score": 1}, None, None,
     {"column_map": {"better": "chosen", "worse": "rejected"}, "keep_columns": ["prompt", "chosen", "rejected"]}),
    # the user's own valid map is built on; a map or keep list that does not fit is replaced
    ("sft", {"q": "q", "answer": "a"}, {"q": "prompt"}, None, {"column_map": {"q": "prompt", "answer": "completion"}}),
    ("sft", {"messages": [USER, GOOD]}, {"query": "prompt"}, None, {"column_map": {}}),
    ("sft", {"messages": [USER, GOOD], "prompt": "q"}, None, ["prompt", "messages"], {"keep_columns": ["messages"]}),
    ("sft", {"messages": [USER, GOOD], "prompt": "q"}, None, ["id"], {"keep_columns": ["messages"]}),
])
def test_suggest_fix_gives_the_keys_that_make_it_fit(trainer, record, column_map, keep, expected):
    fix = suggest_fix([record], trainer, column_map, keep)
    assert fix == expected
    fixed = detect(apply_column_map([record], fix.get("column_map", column_map), fix.get("keep_columns", keep)))
    assert fit_problems(fixed, trainer) == []


@pytest.mark.parametrize(("trainer", "record", "column_map", "keep"), [
    ("sft", {"messages": [USER, GOOD]}, None, None),  # fits already
    ("sft", {"question": "q", "answer": "a"}, {"question": "prompt", "answer": "completion"}, None),
    ("grpo", {"messages": [USER, GOOD]}, None, None),  # no sure fix: which part is the prompt?
    ("dpo", {"prompt": "q", "completion": "a"}, None, None),
    ("sft", {"prompt": "q", "completion": [GOOD]}, None, None),  # a format problem: no key fixes it
    ("ppo", {"text": "x"}, None, None),
])
def test_suggest_fix_offers_nothing_it_cannot_stand_behind(trainer, record, column_map, keep):
    assert suggest_fix([record], trainer, column_map, keep) == {}


# --- built-in samples ----------------------------------------------------------------------

def _qa_answers() -> set[str]:
    lines = (DATA / "qa.jsonl").read_text().splitlines()
    return {json.loads(line)["messages"][-1]["content"] for line in lines}


def test_preference_sample():
    from datasets import load_dataset
    from trl.data_utils import is_conversational

    dataset = load_dataset("json", data_files=str(DATA / "preference.jsonl"), split="train")
    assert 30 <= len(dataset) <= 60 and dataset.column_names == ["prompt", "chosen", "rejected"]
    found = detect(read_rows(DATA / "preference.jsonl"))
    assert (found.type, found.format) == ("preference", "conversational")
    assert fit_problems(found, "dpo") == [] and is_conversational(dataset[0])
    answers = _qa_answers()
    for row in dataset:
        assert [m["role"] for m in row["prompt"] + row["chosen"] + row["rejected"]] == ["user", "assistant",
                                                                                          "assistant"]
        assert row["chosen"][0]["content"] in answers and row["rejected"][0]["content"] not in answers
    assert {row["chosen"][0]["content"] for row in dataset} == answers  # every qa fact is taught


def test_prompts_sample():
    from datasets import load_dataset
    from trl.data_utils import is_conversational

    dataset = load_dataset("json", data_files=str(DATA / "prompts.jsonl"), split="train")
    assert 30 <= len(dataset) <= 60 and dataset.column_names == ["prompt", "reference"]
    found = detect(read_rows(DATA / "prompts.jsonl"))
    assert (found.type, found.format) == ("prompt_only", "conversational")
    assert fit_problems(found, "grpo") == [] and is_conversational(dataset[0])
    assert {row["reference"] for row in dataset} == _qa_answers()
    assert all([m["role"] for m in row["prompt"]] == ["user"] for row in dataset)


def test_kind_is_a_small_dataclass():
    found = detect([RECORDS["preference"][0]])
    assert isinstance(found, DatasetKind)
    assert (found.type, found.format, found.columns) == ("preference", "conversational",
                                                         ("prompt", "chosen", "rejected"))


def test_import_stays_light():
    # The web app imports this module; it must not pull in datasets, torch or trl.
    code = ("import sys, studio_core.recipe.data_check; "
            "print(sorted(m for m in ('datasets', 'torch', 'trl', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent.parent)
    assert out.stdout.strip() == "[]"


def test_grpo_takes_prompt_completion_data_like_trl_lib_tldr():
    # TRL's Trainium guide trains GRPO on trl-lib/tldr: the completion goes to the rewards
    assert fit_problems(detect([{"prompt": "post", "completion": "summary"}]), "grpo") == []


# --- the whole file, before launch ---------------------------------------------------------

def chats(n: int, bad: dict[int, object] | None = None) -> list[dict]:
    """n conversational SFT records; `bad` puts other `messages` values at these 1-based rows."""
    return [{"messages": (bad or {}).get(i, [USER, GOOD])} for i in range(1, n + 1)]


def test_a_good_file_scans_clean(tmp_path):
    assert scan_file(write(tmp_path / "data.jsonl", chats(300))) == []
    assert scan_file(write(tmp_path / "data.parquet", chats(300))) == []
    assert scan_file(write(tmp_path / "data.csv", [{"prompt": "q", "completion": "a"}] * 300)) == []


def test_bad_records_deep_in_a_jsonl_are_named_by_line_and_column(tmp_path):
    path = write(tmp_path / "data.jsonl", chats(100, {50: [], 70: [{"from": "human", "value": "hi"}],
                                                      80: "The studio mascot is teal."}))
    assert scan_file(path) == [
        f"dataset: {path}: line 50: `messages` is empty; it needs a list of {{role, content}} messages",
        f"dataset: {path}: line 70: `messages` is not a list of {{role, content}} messages",
        f"dataset: {path}: line 80: `messages` is text, but the first rows hold lists of {{role, content}} "
        "messages; use one format throughout"]


def test_malformed_lines_and_missing_columns_later_in_a_jsonl(tmp_path):
    path = write(tmp_path / "data.jsonl", chats(40))
    lines = path.read_text().splitlines()
    lines[19], lines[29], lines[34] = '{"messages": [', "[1, 2]", '{"text": "no messages here"}'
    path.write_text("\n".join(lines) + "\n")
    problems = scan_file(path)
    assert len(problems) == 3
    assert f"{path}: line 20 is not valid JSON" in problems[0]
    assert f"{path}: line 30 is a JSON list, not an object" in problems[1]
    assert problems[2] == f"dataset: {path}: line 35: `messages` is missing; every record needs one"


def test_csv_missing_value(tmp_path):
    rows = [{"prompt": "q", "completion": "a"}] * 40
    rows[29] = {"prompt": "q", "completion": ""}  # the 30th record: line 31, after the header
    path = write(tmp_path / "data.csv", rows)
    assert scan_file(path) == [f"dataset: {path}: line 31: `completion` is missing; every record needs one"]


def test_parquet_null(tmp_path):
    rows = [{"prompt": "q", "completion": "a"} for _ in range(3000)]  # more than one batch
    rows[2500]["prompt"] = None
    path = write(tmp_path / "data.parquet", rows)
    assert scan_file(path) == [f"dataset: {path}: row 2501: `prompt` is missing; every record needs one"]


def test_columns_are_named_as_in_the_file(tmp_path):
    rows = [{"question": "q", "answer": "a", "id": i} for i in range(10)]
    rows[6]["answer"] = ""
    path = write(tmp_path / "data.jsonl", rows)
    problems = scan_file(path, column_map={"question": "prompt", "answer": "completion"})
    assert problems == [f"dataset: {path}: line 7: `answer` is empty; it needs text"]


def test_the_first_few_then_how_many_more_within_the_limit(tmp_path):
    path = write(tmp_path / "data.jsonl", chats(60, {i: [] for i in range(11, 61)}))
    problems = scan_file(path, most=3)
    assert [p.split(": ")[2] for p in problems[:3]] == ["line 11", "line 12", "line 13"]
    assert problems[3] == f"dataset: {path}: 47 more bad records in the first 60; fix or remove each of them"
    assert scan_file(path, limit=10) == []  # bounded: only the first 10 records are read


def test_a_file_that_breaks_off_is_reported(tmp_path):
    path = tmp_path / "pretty.json"
    path.write_text("".join(json.dumps(r, indent=2) + "\n" for r in chats(8)) + '{"messages": [\n')
    problems = scan_file(path)
    assert len(problems) == 1 and f"{path}: line " in problems[0] and "is not valid JSON" in problems[0]


def test_the_scan_reads_the_data_as_the_trainer_will(tmp_path):
    # with keep_columns: [messages] a stray `prompt` is not read, so only `messages` is checked
    rows = [{"prompt": "q" if i != 3 else "", "messages": [USER, GOOD] if i != 9 else []} for i in range(1, 13)]
    path = write(tmp_path / "data.jsonl", rows)
    assert [p.split(": ")[2:4] for p in scan_file(path)] == [["line 3", "`prompt` is empty; it needs text"]]
    assert [p.split(": ")[2:4] for p in scan_file(path, keep_columns=["messages"])] == [
        ["line 9", "`messages` is empty; it needs a list of {role, content} messages"]]


# --- conversations a chat template would render otherwise than written --------------------------

CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "colour_of", "arguments": {"thing": "mascot"}}}]}
TOOL = {"role": "tool", "name": "colour_of", "content": "{\"colour\": \"teal\"}"}
SYSTEM = {"role": "system", "content": "Answer in one sentence."}
# (messages, the problem after "`messages` ") for each message a template would drop or empty
BAD_MESSAGES = [
    ([USER, {"role": "bot", "content": "Teal."}], "message 2 has the role `bot`, which chat templates do not know "
     "(Qwen3's drops the turn); change it to `assistant` in the data"),
    ([{"role": "User", "content": "Hi"}, GOOD], "message 1 has the role `User`, which chat templates do not know "
     "(Qwen3's drops the turn); change it to `user` in the data"),
    ([{"role": "narrator", "content": "Once"}, USER, GOOD], "message 1 has the role `narrator`, which chat templates "
     "do not know (Qwen3's drops the turn); change it to `system`, `user` or `assistant` (`tool` for the answer to "
     "a tool call) in the data"),
    ([USER, TOOL, GOOD], "message 2 has the role `tool`, but no assistant message of this record makes a tool call "
     "(`tool_calls`); give the call to the assistant message before it, or make it a `user` message"),
    ([USER, {"role": "assistant", "content": 42}], "message 2 (`assistant`) has a number as its `content`, not text "
     "(chat templates render it as empty or fail); write it in quotes, \"42\""),
    ([USER, {"role": "assistant", "content": [{"type": "text", "text": "Teal."}]}], "message 2 (`assistant`) has a "
     "list as its `content`, not text (chat templates render it as empty or fail); write the message's text as one "
     "string"),
    ([USER, {"role": "assistant", "content": None}], "message 2 (`assistant`) has no `content`; give it its text"),
]
GOOD_MESSAGES = [[USER, GOOD], [SYSTEM, USER, GOOD], [USER, CALL, TOOL, GOOD], [USER, CALL, TOOL, TOOL, GOOD],
                 [USER, GOOD, {"role": "user", "content": ""}, GOOD]]


@pytest.mark.parametrize(("messages", "problem"), BAD_MESSAGES, ids=[p.split(",")[0] for _, p in BAD_MESSAGES])
def test_a_turn_the_template_would_drop_is_refused_by_line_and_column(tmp_path, messages, problem):
    path = write(tmp_path / "data.jsonl", chats(30, {17: messages}))
    scan = scan_file(path)
    assert scan == [f"dataset: {path}: line 17: `messages` {problem}"]


def test_the_qwen3_template_drops_what_the_scan_refuses_and_keeps_what_it_passes(tmp_path):
    # The reason for the refusals above: Transformers' renderer with TRL's Qwen3 template (the
    # built-in model's) leaves out a turn of an unknown role and any content that is not text; a
    # tool answer to no call it keeps, but Phi-3's template (no tool support) drops it.
    from transformers.utils.chat_template_utils import render_jinja_template
    folder = Path(sys.modules["trl"].__file__).parent / "chat_templates"

    def rendered(messages, template="qwen3"):
        (text,), _ = render_jinja_template([messages], chat_template=(folder / f"{template}.jinja").read_text())
        return text
    for messages, _ in BAD_MESSAGES:
        template = "phi3" if any(m["role"] == "tool" for m in messages) else "qwen3"
        lost = [m for m in messages if m.get("content") and str(m["content"]) not in rendered(messages, template)]
        assert lost or any(m.get("content") is None for m in messages), messages
    for messages in GOOD_MESSAGES:
        assert scan_file(write(tmp_path / "good.jsonl", [{"messages": messages}] * 3)) == []
        assert all(m["content"] in rendered(messages) for m in messages if m.get("content"))


def test_roles_are_checked_in_every_conversational_column_and_file_kind(tmp_path):
    bot = [{"role": "bot", "content": "Teal."}]
    rows = [RECORDS["preference"][0]] * 4 + [{"prompt": [USER], "chosen": [GOOD], "rejected": bot}]
    path = write(tmp_path / "pairs.parquet", rows)
    assert scan_file(path) == [f"dataset: {path}: row 5: `rejected` message 1 has the role `bot`, which chat "
                               "templates do not know (Qwen3's drops the turn); change it to `assistant` in the data"]
    rows = [{"question": [USER], "answer": [GOOD]}] * 4 + [{"question": [USER], "answer": [{**GOOD, "content": 7}]}]
    path = write(tmp_path / "renamed.jsonl", rows)
    (problem,) = scan_file(path, column_map={"question": "prompt", "answer": "completion"})
    assert problem.startswith(f"dataset: {path}: line 5: `answer` message 1 (`assistant`) has a number")
    # a tool call in the prompt makes the tool answer in the completion fine
    path = write(tmp_path / "tools.jsonl", [{"prompt": [USER, CALL], "completion": [TOOL, GOOD]}] * 3)
    assert scan_file(path) == [] and scan_file(path).warnings == []


# (messages, the warning): turns that train, but likely not as meant, counted by kind
OUT_OF_ORDER = [
    ([GOOD, USER, GOOD], "1 record of the first 20 starts with an `assistant` turn, before any user turn (line 4; "
     "the first, line 4, in `messages`: message 1); put the user's message first"),
    ([SYSTEM, GOOD, USER], "1 record of the first 20 starts with an `assistant` turn, before any user turn (line 4; "
     "the first, line 4, in `messages`: message 2)"),
    ([USER, USER, GOOD], "1 record of the first 20 has two `user` turns in a row (line 4; the first, line 4, in "
     "`messages`: messages 1 and 2); merge them or put the assistant's answer between them"),
    ([SYSTEM, USER, GOOD, GOOD], "1 record of the first 20 has two `assistant` turns in a row (line 4; the first, "
     "line 4, in `messages`: messages 3 and 4); merge them or put the user's message between them"),
]


@pytest.mark.parametrize(("messages", "warning"), OUT_OF_ORDER, ids=[w.split(";")[0] for _, w in OUT_OF_ORDER])
def test_turns_out_of_order_are_a_warning_not_a_refusal(tmp_path, messages, warning):
    path = write(tmp_path / "data.jsonl", chats(20, {4: messages}))
    scan = scan_file(path)
    assert scan == [] and not scan  # the refusals: none, so Start goes ahead
    (found,) = scan.warnings
    assert found.startswith(f"dataset: {path}: {warning}")
    assert found.endswith("(this trains, but likely not as meant)")


def test_order_is_checked_on_the_conversation_trl_builds(tmp_path):
    # prompt + completion (and prompt + chosen / rejected) is one conversation
    rows = [RECORDS["prompt_completion"][0]] * 3 + [{"prompt": [USER], "completion": [USER]}]
    path = write(tmp_path / "pc.jsonl", rows)
    assert scan_file(path).warnings == [f"dataset: {path}: 1 record of the first 4 has two `user` turns in a row "
                                        "(line 4; the first, line 4, in `prompt` then `completion`: messages 1 and 2); "
                                        "merge them or put the assistant's answer between them "
                                        "(this trains, but likely not as meant)"]
    rows = [RECORDS["preference_implicit"][0]] * 3 + [{"chosen": [USER, GOOD], "rejected": [GOOD]}]
    path = write(tmp_path / "implicit.jsonl", rows)
    (warning,) = scan_file(path).warnings
    assert "starts with an `assistant` turn" in warning and "line 4, in `rejected`: message 1" in warning
    # a bad record is refused, and not warned about as well; standard data has no turns
    path = write(tmp_path / "both.jsonl", chats(6, {2: [GOOD, {"role": "bot", "content": "x"}]}))
    scan = scan_file(path)
    assert len(scan) == 1 and scan.warnings == []
    assert scan_file(write(tmp_path / "text.jsonl", [{"text": "x"}] * 5)).warnings == []


def test_the_first_few_places_then_how_many_in_all(tmp_path):
    path = write(tmp_path / "data.jsonl", chats(40, {i: [GOOD, USER] for i in range(11, 31)}))
    scan = scan_file(path, most=3)
    assert scan == []
    (warning,) = scan.warnings
    assert warning.startswith(f"dataset: {path}: 20 records of the first 40 start with an `assistant` turn, before "
                              "any user turn (line 11, line 12, line 13, ...; the first, line 11, in `messages`")


# --- unpaired preference data for a trainer of pairs ---------------------------------------------

@pytest.mark.parametrize("trainer", ["dpo", "reward"])
@pytest.mark.parametrize(("record", "keys"), [
    (RECORDS["unpaired_preference"][0], "(studio.trainer: kto)"),
    (RECORDS["unpaired_preference"][1], "(studio.trainer: kto)"),
    ({"question": "q", "answer": "a", "desirable": True},
     "(studio.trainer: kto, studio.column_map: {question: prompt, answer: completion, desirable: label})"),
])
def test_unpaired_data_for_pairs_points_to_kto_not_to_renaming(trainer, record, keys):
    name = trainers.get(trainer).name
    (problem,) = fit_problems(detect([record]), trainer)
    assert f"one answer per prompt, labelled desirable or not, where {name} needs pairs (a chosen and a rejected " \
           "answer to the same prompt), which no renaming of columns makes; train it with KTO, which takes " \
           f"unpaired preference data {keys}, or give {name} a dataset of pairs" in problem
    assert "column_map: {" not in problem.split("train it with")[0]  # no rename into chosen/rejected offered
    assert suggest_fix([record], trainer) == {}
    # the keys it names make the data fit KTO
    column_map = suggest_column_map(list(record), "kto")
    assert fit_problems(detect(apply_column_map([record], column_map, None)), "kto") == []


# --- files that are not UTF-8 --------------------------------------------------------------------

@pytest.mark.parametrize(("name", "content", "line"), [
    ("data.jsonl", b'{"text": "ok"}\n{"text": "fine"}\n{"text": "caf\xe9"}\n', 3),
    ("data.json", b'[\n  {"text": "ok"},\n  {"text": "caf\xe9"}\n]\n', 3),
    ("data.csv", b"prompt,completion\nq,a\nq,cr\xe8me\n", 3),
])
def test_a_file_that_is_not_utf8_names_the_line_and_the_fix(tmp_path, name, content, line):
    path = tmp_path / name
    path.write_bytes(content)
    offset = next(i for i, byte in enumerate(content) if byte >= 0x80)  # Latin-1's é or è
    expected = (f"{path}: line {line} is not UTF-8 text (byte 0x{content[offset]:02x} at offset {offset} in the "
                f"file); save the file as UTF-8, e.g. if it is Latin-1: `iconv -f latin1 -t utf-8 {name} > "
                f"data-utf8{path.suffix}`")
    with pytest.raises(ValueError) as error:
        read_rows(path)
    assert str(error.value).startswith(expected)
    assert scan_file(path)[0].startswith(f"dataset: {expected}")
    converted = tmp_path / f"data-utf8{path.suffix}"  # the fix it names, done as iconv does it
    converted.write_bytes(content.decode("latin-1").encode("utf-8"))
    assert scan_file(converted) == []


def test_a_utf16_file_is_named_as_such(tmp_path):
    path = tmp_path / "data.csv"
    path.write_bytes("prompt,completion\nq,a\n".encode("utf-16"))
    with pytest.raises(ValueError, match=r"data.csv is UTF-16 text; save it as UTF-8, e\.g\. `iconv -f utf-16 -t "
                                         r"utf-8 data.csv > data-utf8.csv`"):
        read_rows(path)


def test_the_pages_dataset_report_reads_as_sentences(tmp_path):
    """The Train tab's report: no empty "(unknown, )" for columns it cannot place, and each
    sentence a paragraph of its own ("Fits SFT." ran into the line before)."""
    from app.train_tab import dataset_report
    from studio_core.recipe.spec import RunSpec

    fits, _, _ = dataset_report(RunSpec(dataset_name=BUILTIN_DATASETS["builtin:qa"]))
    assert "\n\n**Fits SFT.**" in fits
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"foo": "a", "bar": "b"}) + "\n")
    report, _, _ = dataset_report(RunSpec(dataset_name=str(odd)))
    assert "**Detected:**" in report and "unknown, )" not in report and "()" not in report
    assert "\n\n**Does not fit this trainer:**" in report


def test_the_tokenizer_pass_is_remembered_while_the_files_stay(tmp_path):
    """The scan's part that needs Transformers is kept on disk for the next process; the data
    changed, it is done again."""
    from studio_core.data.builtin import ensure_tiny_model
    from studio_core.machine.cache import cache_dir
    from studio_core.recipe.data_scan import check_spec_file
    from studio_core.recipe.spec import RunSpec

    ensure_tiny_model()
    data = tmp_path / "long.jsonl"

    def write(answers):
        data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "Say it."}, {
            "role": "assistant", "content": "word " * n}]}) + "\n" for n in answers))

    write([5, 5, 3000])
    spec = RunSpec(dataset_name=str(data)).with_overrides(["max_length=64"])
    kept = cache_dir() / "data-scans"
    before = set(kept.glob("*.json"))
    first = check_spec_file(spec, data)
    assert list(first) == [] and "tokens" in " ".join(first.warnings)  # the long record, counted in tokens
    [entry] = set(kept.glob("*.json")) - before
    entry.write_text(json.dumps([["a problem kept on disk"], []]))
    assert list(check_spec_file(spec, data)) == ["a problem kept on disk"]  # read, not done again
    write([5, 5, 6])
    again = check_spec_file(spec, data)
    assert list(again) == [] and again.warnings == []
