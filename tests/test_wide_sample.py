"""builtin:wide, the built-in sample with a long-tailed spread of lengths, and what the shape
forecast suggests for it: fewer compilations at little padding, each with its cost to the data.

The lengths are counted as SFT counts them: the forecast reads them from TRL's own tokenization
(chat template included) of the run's dataset.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from studio_core.data import sources
from studio_core.data.builtin import BUILTIN_DATASETS, WIDE_DATASET, WIDE_ROWS, WIDE_SAMPLE_FILE
from studio_core.machine.cache import cache_dir
from studio_core.recipe.data_check import detect, fit_problems
from studio_core.recipe.data_scan import scan_file
from studio_core.training.forecast import forecast
from studio_core.recipe.spec import RunSpec

pytestmark = pytest.mark.fast  # starts no run, torchrun, browser or app
REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "tiny-sft.yaml"
MAKE = "import sys; from pathlib import Path; from studio_core.data.builtin import ensure_wide_sample; " \
       "ensure_wide_sample(Path(sys.argv[1]))"


@pytest.fixture(scope="module")
def wide_forecast():
    """The tiny SFT recipe on builtin:wide as a run of it would compile: batch 4, max_length 1024
    (the tiny model's max_position_embeddings), 200 steps."""
    spec = RunSpec.load(RECIPE).with_overrides([f"dataset_name={WIDE_DATASET}", "max_length=1024", "max_steps=200"])
    return spec, forecast(spec, "cpu")


def test_made_the_same_in_two_processes(tmp_path):
    made = []
    for name in ("one", "two"):
        path = tmp_path / name / "wide.jsonl"
        # each with its own string hashing, so no set order can creep into the file
        subprocess.run([sys.executable, "-c", MAKE, str(path)], check=True, timeout=120, cwd=REPO,
                       env={**os.environ, "PYTHONHASHSEED": {"one": "1", "two": "2"}[name]})
        made.append(path.read_bytes())
    assert made[0] == made[1] and len(made[0]) > 1_000_000
    assert not [p for p in tmp_path.rglob(".*")]  # no temporary file left behind


def test_the_name_gives_the_cached_file_made_once():
    path = BUILTIN_DATASETS[WIDE_DATASET]
    assert path == cache_dir() / "data" / WIDE_SAMPLE_FILE and path.is_file()
    made = path.stat().st_mtime_ns
    assert sources.dataset_file(WIDE_DATASET) == path and sources.check_dataset(WIDE_DATASET) == []
    assert path.stat().st_mtime_ns == made
    assert WIDE_DATASET in list(BUILTIN_DATASETS)


def test_conversations_that_sft_takes_whole():
    path = BUILTIN_DATASETS[WIDE_DATASET]
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == WIDE_ROWS
    assert fit_problems(detect(rows[:5]), "sft") == []
    scan = scan_file(path)
    assert list(scan) == [] and scan.warnings == [] and scan.rows == WIDE_ROWS  # no refusal, no warning
    assert all([m["role"] for m in row["messages"]] == ["user", "assistant"] for row in rows)
    assert all(m["content"].strip() for row in rows for m in row["messages"])


def test_lengths_have_a_long_right_tail(wide_forecast):
    _, result = wide_forecast
    lengths = result.lengths  # TRL's own tokenization of each conversation, before truncation
    assert len(lengths) == WIDE_ROWS
    assert min(lengths) >= 20 and max(lengths) <= 2000
    assert min(lengths) < 40 and max(lengths) > 1900  # the whole span is there
    assert statistics.median(lengths) < 0.8 * statistics.mean(lengths)
    assert 0.02 < sum(length > 1000 for length in lengths) / len(lengths) < 0.15
    assert result.truncated == sum(length > 1024 for length in lengths) > 0  # the tail is cut


def test_the_best_suggestion_halves_the_shapes_at_little_padding(wide_forecast):
    spec, result = wide_forecast
    assert result.suggestions
    best = result.suggestions[0]
    assert best["graphs"] * 2 <= result.graphs and best["waste"] <= 0.15
    # each says what it costs the data: samples cut at max_length, and order or rows
    for suggestion in result.suggestions:
        assert suggestion["cost"] and suggestion["truncated"] in (0, result.truncated)
        if suggestion["set"].get("train_sampling_strategy") == "group_by_length":
            assert "order" in suggestion["cost"] and suggestion["truncated"] == result.truncated
        if suggestion["set"].get("packing"):
            assert "split across rows" in suggestion["cost"] and suggestion["truncated"] == 0
    assert "costs the data:" in result.describe()
    # applied, it gives what it promised (the sampler's shuffle starts from the run's seed)
    applied = forecast(spec.with_overrides([f"{k}={v}" for k, v in best["set"].items()]), "cpu")
    assert applied.graphs == best["graphs"] and applied.waste == pytest.approx(best["waste"], abs=1e-4)
