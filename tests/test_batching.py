"""Batched decoding at fixed shapes (studio_core/serve/batching.py), on the tiny SFT runs' models:
an answer is the same token for token alone, in a batch, or joining a batch already going, and
the same as the chat's own generate(); the model runs only the plan's shapes (one prefill per
length bucket, one decode per batch and length bucket); a cancelled request frees its row for the
next at once; a request joins beside one that has nearly filled its row; sampling keeps each
request's own seed; a failing step ends its batch only. Compiled with Inductor, a mixed load of
two LoRA runs' requests (joins, leaves, a cancel, long and short prompts) compiles exactly the
warm-up's graphs, none after, and answers as each run does alone with generate()."""

from __future__ import annotations

import json
import shutil
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from studio_core.serve.batching import BATCH_BUCKETS, BatchEngine, Request, batch_bucket, engine_plan, length_buckets
from studio_core.serve.chat import resolve
from studio_core.serve.generation import Generator, NoRoom, buckets_for
from studio_core.serve.row_adapters import config_problem

QA = Path(__file__).resolve().parent.parent / "studio_core" / "data" / "samples" / "qa.jsonl"

MAX_CACHE_LEN = 256
NEW = 24


@pytest.fixture(scope="module")
def chat(sft_runs, tmp_path_factory):
    runs = sft_runs.copy_to(tmp_path_factory.mktemp("runs"), "full").runs_dir
    return Generator(asdict(resolve(sft_runs.ids["full"], runs)), "cpu", MAX_CACHE_LEN)


def questions(n: int) -> list[list[dict]]:
    """The built-in set's questions (from the first, again from the first after the last), as
    conversations, some asked four or nine times (longer prompts: other buckets)."""
    rows = [json.loads(line) for line in QA.read_text().splitlines()]
    return [[{"role": "user", "content": " ".join([rows[k % len(rows)]["messages"][0]["content"]] * (1, 4, 9)[k % 3])}]
            for k in range(n)]


def eos_of(chat) -> set[int]:
    eos = chat.model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) | {chat.tokenizer.eos_token_id}


def engine(chat, **settings) -> BatchEngine:
    return BatchEngine(chat.model, chat.pad, eos_of(chat), MAX_CACHE_LEN, **settings)


def request(chat, messages, **settings) -> Request:
    ids, _, _, _ = chat.fitted(messages, None, settings.get("max_new_tokens", NEW), whole=True)
    return Request(ids, **{"max_new_tokens": NEW, **settings})


def answer_all(batcher: BatchEngine, requests: list[Request], joining: list[Request] = (), after: int = 3) -> dict:
    """Step until every request ended; `joining` are submitted `after` steps in. -> {id: reason}."""
    ended = {}
    for r in [*requests, *joining]:
        r.on_done = lambda reason, r=r: ended.__setitem__(r.id, reason)
    for r in requests:
        batcher.submit(r)
    steps = 0
    while len(ended) < len(requests) + len(joining):
        batcher.step()
        steps += 1
        if steps == after:
            for r in joining:
                batcher.submit(r)
    return ended


@pytest.mark.fast
def test_the_plan_compiles_a_graph_per_bucket_on_a_device_and_says_why_when_it_does_not():
    plan = engine_plan("neuron", 16, 1024)
    assert plan.mode == "compiled" and plan.compiler == "neuron"
    assert plan.prefill == (64, 128, 256, 512) and length_buckets(1024) == (64, 128, 256, 512, 1024)
    assert plan.graphs == 4 + 5 * 5 and (16, 1024) in plan.decode and (16, 2048) not in plan.decode
    assert "29 graphs compiled at start by neuron" in plan.describe()
    assert engine_plan("cuda", 4, 300).decode == tuple((b, k) for b in (1, 2, 4) for k in (64, 128, 256, 300))
    eager = engine_plan("cpu", 16, 1024)
    assert eager.mode == "eager" and eager.graphs == 0 and "--compile" in eager.describe()
    assert engine_plan("cpu", 16, 1024, compiled=True).compiler == "inductor"
    single = engine_plan("neuron", 16, 1024, unsupported="q_proj uses a LoRA variant (DoRA)")
    assert single.mode == "single" and single.graphs == 0 and "DoRA" in single.describe()
    assert engine_plan("neuron", 1, 1024).describe().startswith("one request at a time")
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]


@pytest.mark.fast
def test_an_answer_that_leaves_no_prompt_bucket_is_refused_not_given_a_bucket_of_its_own():
    """A bucket cut to the room left would be a new prompt shape (a compilation on Neuron) for
    every such max_new_tokens."""
    assert buckets_for(1024, 960) == [64] and buckets_for(1024, 512) == [64, 128, 256, 512]
    for max_new_tokens in (961, 1000, 1023):
        with pytest.raises(NoRoom, match="ask for at most 960 new tokens"):
            buckets_for(1024, max_new_tokens)


@pytest.mark.fast
def test_adapters_the_engine_cannot_gather_per_row_are_named_from_their_configs(tmp_path):
    def adapter(name: str, **config) -> str:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps({"target_modules": ["q_proj", "v_proj"], **config}))
        return str(folder)

    plain, saved = adapter("plain", r=8), adapter("saved", modules_to_save=["lm_head"])
    assert config_problem([plain]) is None and config_problem([saved]) is None  # one adapter: its lm_head is used
    assert "modules_to_save" in config_problem([plain, saved])
    assert "DoRA" in config_problem([plain, adapter("dora", use_dora=True)])
    assert "embedding" in config_problem([adapter("embed", target_modules=["embed_tokens", "q_proj"])])
    assert "cannot be read" in config_problem([str(tmp_path / "missing")])


def test_an_answer_is_the_same_alone_in_a_batch_or_joining_one_and_as_the_chat_writes_it(chat):
    conversations = questions(6)
    alone = []
    for messages in conversations:
        single = request(chat, messages)
        answer_all(engine(chat), [single])
        alone.append(single.tokens)
    batched = [request(chat, m) for m in conversations]
    answer_all(engine(chat), batched[:3], joining=batched[3:])  # three start, three join at a step boundary
    assert [r.tokens for r in batched] == alone
    assert len({tuple(t) for t in alone}) > 1  # the answers differ: the comparison is not of one repeated answer
    for messages, tokens in zip(conversations[:2], alone):  # the chat's own generate(), one at a time
        written = chat.generate(messages, max_new_tokens=NEW)["text"]
        assert chat.tokenizer.decode(tokens, skip_special_tokens=True) == written


def test_the_model_runs_one_prefill_per_length_bucket_and_a_decode_per_batch_and_length_bucket(chat):
    batcher = engine(chat)
    conversations = questions(batcher.rows + 4)
    requests = [request(chat, m, max_new_tokens=4 + k) for k, m in enumerate(conversations)]
    answer_all(batcher, requests)
    plan_lengths = length_buckets(MAX_CACHE_LEN)
    plan = engine_plan("cpu", BATCH_BUCKETS[-1], MAX_CACHE_LEN)
    ran = batcher.ran  # (batch, input length, cells attended)
    assert {(b, k) for b, q, k in ran if q == 1} <= set(plan.decode)
    assert {(b, q) for b, q, k in ran if q > 1} <= {(1, p) for p in plan.prefill}  # one prompt a prefill
    assert len({q for _, q, _ in ran if q > 1}) > 1  # the questions asked nine times took another bucket
    assert (batcher.rows, 1) in batcher.shapes and len({b for b, q, _ in ran if q == 1}) > 1  # then fewer rows
    longest = max(len(r.ids) + len(r.tokens) for r in requests)
    # each decode attends the smallest length that holds its rows (fewer when only short ones are left), at most
    # the longest request's, never all 256 cells
    attended = {k for _, q, k in ran if q == 1}
    assert max(attended) == next(k for k in plan_lengths if k >= longest) < plan_lengths[-1], attended


def test_a_cancelled_request_frees_its_row_for_a_waiting_one_at_the_next_step(chat):
    batcher = engine(chat)
    rows = batcher.rows
    conversations = questions(rows + 1)
    full = [request(chat, m, max_new_tokens=60) for m in conversations[:rows]]
    waiting = request(chat, conversations[rows], max_new_tokens=8)
    ended = {}
    for r in [*full, waiting]:
        r.on_done = lambda reason, r=r: ended.__setitem__(r.id, reason)
        batcher.submit(r)
    batcher.step()
    assert len(batcher.active) == rows and list(batcher.waiting) == [waiting]  # every row taken
    batcher.cancel(full[2])
    batcher.step()
    assert ended[full[2].id] == "cancelled" and waiting in batcher.active and not batcher.waiting
    assert waiting.row == full[2].row  # the row it left
    while len(ended) < rows + 1:
        batcher.step()
    assert ended[waiting.id] in ("stop", "length") and 0 < len(waiting.tokens) <= 8
    alone = request(chat, conversations[rows], max_new_tokens=8)
    answer_all(engine(chat), [alone])
    assert waiting.tokens == alone.tokens  # joined in a row another had used: the same answer


def test_a_request_joins_beside_a_long_answer_near_the_end_of_the_cache_without_waiting_for_it(chat):
    batcher = BatchEngine(chat.model, chat.pad, set(), MAX_CACHE_LEN)  # no end of sequence: each runs to its max
    first, second = questions(2)
    long = request(chat, first, max_new_tokens=MAX_CACHE_LEN - 64)
    batcher.submit(long)
    for _ in range(MAX_CACHE_LEN - 64 - 10):  # its row is filled to 10 cells from the end
        batcher.step()
    short = batcher.submit(request(chat, second, max_new_tokens=24))
    batcher.step()
    assert short in batcher.active and long in batcher.active  # more than 10 cells: it has a row of its own
    while batcher.active:
        batcher.step()
    assert len(long.tokens) == MAX_CACHE_LEN - 64 and len(short.tokens) == 24
    alone = request(chat, second, max_new_tokens=24)
    answer_all(BatchEngine(chat.model, chat.pad, set(), MAX_CACHE_LEN), [alone])
    assert short.tokens == alone.tokens
    with pytest.raises(ValueError, match="do not fit a row"):
        batcher.submit(Request(short.ids, MAX_CACHE_LEN - len(short.ids) + 2))  # one token past its row's end


def test_sampling_keeps_each_requests_own_seed_in_a_batch(chat):
    conversations = questions(4)
    settings = {"temperature": 1.8, "top_p": 0.98, "seed": 7}  # hot: another seed writes another answer
    alone = request(chat, conversations[0], **settings)
    answer_all(engine(chat), [alone])
    batched = [request(chat, conversations[0], **settings)] + [request(chat, m, temperature=1.0, seed=k)
                                                               for k, m in enumerate(conversations[1:])]
    answer_all(engine(chat), batched)
    assert batched[0].tokens == alone.tokens
    other = request(chat, conversations[0], **{**settings, "seed": 8})
    answer_all(engine(chat), [other])
    assert other.tokens != alone.tokens


def test_a_step_that_fails_ends_its_batch_with_the_error_and_the_engine_goes_on(chat):
    batcher = engine(chat)
    ended, done = {}, threading.Event()

    def finish(name):
        def on_done(reason):
            ended[name] = reason
            if len(ended) == 2:
                done.set()
        return on_done

    stepping = threading.Thread(target=batcher.run)
    stepping.start()
    try:  # a token the model's vocabulary does not have: its embedding lookup fails
        batcher.submit(Request([chat.model.config.vocab_size + 5] * 3, NEW, on_done=finish("broken")))
        deadline = time.monotonic() + 60
        while "broken" not in ended:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        batcher.submit(request(chat, questions(1)[0], on_done=finish("next")))
        assert done.wait(60)
    finally:
        batcher.close()
        stepping.join(timeout=30)
    assert ended["broken"].startswith("error: IndexError") and ended["next"] in ("stop", "length")


def test_compiled_a_mixed_load_of_two_adapters_compiles_only_the_warm_ups_graphs_and_answers_as_alone(
        sft_runs, tmp_path):
    """Inductor on the CPU stands in for the neuron backend: the same whole graphs per bucket. Two
    runs on one base: the tiny LoRA run and a copy whose adapter's B matrices are negated (it
    answers otherwise, so a row given the wrong adapter would show)."""
    import torch
    from safetensors.torch import load_file, save_file
    from torch._dynamo.utils import counters

    from studio_core.serve.row_adapters import install

    runs = sft_runs.copy_to(tmp_path / "runs", "lora").runs_dir
    lora = resolve(sft_runs.ids["lora"], runs)
    other = tmp_path / "other"
    shutil.copytree(lora.adapter, other)
    weights = load_file(other / "adapter_model.safetensors")
    save_file({k: -t if "lora_B" in k else t for k, t in weights.items()}, other / "adapter_model.safetensors")
    cells, new = 128, 20  # two batch buckets x two length buckets + one prefill: 5 graphs (each ~10 s here)
    chat = Generator(asdict(lora), "cpu", cells, adapters={"tuned": lora.adapter, "other": str(other)})
    rows = [json.loads(line)["messages"][0]["content"] for line in QA.read_text().splitlines()]
    load = [([{"role": "user", "content": " ".join([rows[k]] * (1, 4)[k % 2])}], ("adapter0", "adapter1")[k % 3 == 1])
            for k in range(6)]  # short and long prompts (the long ones cross into the 128-cell decodes)
    alone = [chat.generate(messages, max_new_tokens=new, adapter=adapter)["text"] for messages, adapter in load]
    assert len(set(alone)) > 2 and alone[1] != chat.generate(load[1][0], max_new_tokens=new, adapter="adapter0")["text"]

    chat.stop_counting()
    model, adapter_rows, undo = install(chat.model, ["adapter0", "adapter1"])
    batcher = BatchEngine(model, chat.pad, eos_of(chat), cells, batch_buckets=(1, 2), compiler="inductor",
                          rows=adapter_rows, names=["adapter0", "adapter1"])
    before = counters["stats"]["unique_graphs"]
    warm = batcher.warm_up()
    assert warm["graphs"] == 5 == counters["stats"]["unique_graphs"] - before  # exactly the plan's graphs
    assert engine_plan("cpu", 2, cells, compiled=True).graphs == 5
    requests = [Request(chat.fitted(m, None, new, True)[0], new, adapter=a) for m, a in load]
    cancelled = Request(chat.fitted(load[0][0], None, new, True)[0], new, adapter="adapter1")
    ended = {}
    for r in [*requests, cancelled]:
        r.on_done = lambda reason, r=r: ended.__setitem__(r.id, reason)
    for r in requests[:2]:
        batcher.submit(r)
    for _ in range(2):
        batcher.step()
    for r in [cancelled, *requests[2:]]:  # two rows: these wait, then join as rows free up
        batcher.submit(r)
    while cancelled.row < 0 and cancelled.id not in ended:
        batcher.step()
    batcher.cancel(cancelled)  # it leaves at the next step, its row taken by the next waiting
    while len(ended) < len(requests) + 1:
        batcher.step()
    assert ended.pop(cancelled.id) == "cancelled" and len(cancelled.tokens) < new
    assert counters["stats"]["unique_graphs"] - before == 5  # the load compiled nothing
    assert {r.bucket for r in requests} == {64} and len({b for b, q, k in batcher.ran if q == 1}) == 2
    assert len({k for b, q, k in batcher.ran if q == 1}) == 2  # the long prompts' rows attended to 128 cells
    assert [chat.tokenizer.decode(r.tokens, skip_special_tokens=True) for r in requests] == alone
    assert set(ended.values()) <= {"stop", "length"}
    undo()
    with torch.no_grad():  # put back: the PEFT model answers as before
        assert chat.generate(load[0][0], max_new_tokens=new, adapter="adapter0")["text"] == alone[0]
