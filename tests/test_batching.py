"""Batched decoding at fixed shapes (studio_core/serve/batching.py), on the tiny full SFT run's
model: an answer is the same token for token alone, in a batch, or joining a batch already going,
and the same as the chat's own generate(); the model sees a decode shape per batch bucket and a
prefill shape per batch and length bucket; a cancelled request frees its row for the next at once;
a request joins beside one that has nearly filled its row; sampling keeps each request's own
seed."""

from __future__ import annotations

import pytest

import json
import threading
import time
from dataclasses import asdict
from pathlib import Path

from studio_core.serve.batching import BATCH_BUCKETS, BatchEngine, Request, batch_bucket
from studio_core.serve.chat import resolve
from studio_core.serve.generation import Generator, buckets_for

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


def engine(chat) -> BatchEngine:
    eos = chat.model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) | {chat.tokenizer.eos_token_id}
    return BatchEngine(chat.model, chat.pad, eos, MAX_CACHE_LEN)


def request(chat, messages, **settings) -> Request:
    ids, bucket, _ = chat.fitted(messages, None, settings.get("max_new_tokens", NEW), whole=True)
    return Request(ids, bucket, **{"max_new_tokens": NEW, **settings})


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


def test_the_model_sees_a_decode_shape_per_batch_bucket_and_a_prefill_shape_per_batch_and_length_bucket(chat):
    chat.shapes.clear()
    batcher = engine(chat)
    conversations = questions(batcher.rows + 4)
    answer_all(batcher, [request(chat, m, max_new_tokens=4 + k) for k, m in enumerate(conversations)])
    decode = {shape for shape in chat.shapes if shape[1] == 1}
    prefill = {shape for shape in chat.shapes if shape[1] > 1}
    prompt_buckets = buckets_for(MAX_CACHE_LEN, 1)  # the prompt buckets this cache takes
    assert decode <= {(b, 1) for b in BATCH_BUCKETS}
    assert prefill <= {(w, b) for w in BATCH_BUCKETS[:-1] for b in prompt_buckets}  # joiners prefilled together
    assert len({b for _, b in prefill}) > 1  # the questions asked nine times took another bucket
    assert len(chat.shapes) <= len(BATCH_BUCKETS) * len(prompt_buckets) + 2
    assert (batcher.rows, 1) in decode and len(decode) > 1  # a full batch, then fewer as they end
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]


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
    def extra(rows):  # input_ids twice: the forward call fails, for the broken request's batch only
        return {"input_ids": None} if any(r is not None and r.adapter == "broken" for r in rows) else {}

    eos = chat.model.generation_config.eos_token_id
    batcher = BatchEngine(chat.model, chat.pad, {eos} if isinstance(eos, int) else set(eos), MAX_CACHE_LEN,
                          forward_kwargs=extra)
    ended, done = {}, threading.Event()

    def finish(name):
        def on_done(reason):
            ended[name] = reason
            if len(ended) == 2:
                done.set()
        return on_done

    stepping = threading.Thread(target=batcher.run)
    stepping.start()
    try:
        broken = request(chat, questions(1)[0], adapter="broken", on_done=finish("broken"))
        batcher.submit(broken)
        deadline = time.monotonic() + 60
        while "broken" not in ended:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        batcher.submit(request(chat, questions(1)[0], on_done=finish("next")))
        assert done.wait(60)
    finally:
        batcher.close()
        stepping.join(timeout=30)
    assert ended["broken"].startswith("error: TypeError") and ended["next"] in ("stop", "length")
