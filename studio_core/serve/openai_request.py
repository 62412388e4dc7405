"""The OpenAI endpoint's request rules (studio_core/serve/openai_api.py serves them): what a request may ask.

`parse` checks a request whole before it takes a turn at the model: a strict pydantic model of
OpenAI's fields ("yes" is no boolean, 1.0 no whole number, no unknown field), the model's name,
the fields this server does not implement (tools, logprobs, penalties, response_format...),
refused unless they hold their default, never ignored; then `sampling` (max_tokens, temperature,
top_p, seed, stop, n, in their ranges), `chat_messages` or `completion_prompt`. `too_long` says
what to change for a prompt the model's cache cannot take. Every refusal is an ApiError in
OpenAI's shape, naming the field and what to change.

`SizeLimits`: what a request may weigh before its prompt is tokenized (issue 47: one huge prompt's
tokenizing stalled every other request), from the cache's length and the chat process's tokenizer:
the body's bytes (`max_body_bytes`, 413 while the body is read) and the prompt's characters
(`check_size`, the `context_length_exceeded` 400 before anything reaches the chat process).

Pure: no server, no torch, no model; the largest prompt follows from the cache's buckets
(studio_core/serve/generation.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from studio_core.serve.generation import BUCKETS, buckets_for
from studio_core.serve.images import MAX_IMAGE_BYTES, ImageError, data_url_bytes, image_part, text_of

DEFAULT_MAX_TOKENS = 128
ROLES = ("system", "user", "assistant")
MAX_STOP = 4  # as OpenAI allows
SEEDS = (-2**63, 2**64 - 1)  # what torch.manual_seed takes
CACHE_SETTING = "MAX_CACHE_LEN in studio_core/serve/chat.py"  # what sets the cache, hence the largest bucket
# The most bytes JSON takes to write one character: one beyond the BMP escaped as a surrogate pair
# ("\ud83e\udd99"), as clients that escape all but ASCII send it (raw UTF-8 takes at most 4).
JSON_BYTES_PER_CHARACTER = 12
REST_OF_REQUEST = 1 << 20  # a body's room beside its prompt: the other fields, each message's JSON, stop strings
MAX_IMAGES = 4  # the images one request to a vision-language model may carry (each base64, up to MAX_IMAGE_BYTES)
END_THINK = "</think>"


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool = True  # nothing is obfuscated here; a client may still say it


class _Request(BaseModel):
    """OpenAI's fields, typed strictly ("yes" is no boolean, 1.0 no whole number, no unknown
    field). Those given as Any are checked below, with messages that say which part is wrong."""
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    model: str
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Any = None
    n: Any = None
    # how a client labels its requests: taken, no effect on the answer
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # not implemented: refused unless default (UNSUPPORTED)
    frequency_penalty: Any = None
    presence_penalty: Any = None
    logit_bias: Any = None
    logprobs: Any = None
    top_logprobs: Any = None


class _ChatRequest(_Request):
    messages: Any
    max_completion_tokens: int | None = None
    parallel_tool_calls: bool | None = None  # means nothing without tools
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None


class _TextRequest(_Request):
    prompt: Any
    echo: Any = None
    best_of: Any = None
    suffix: Any = None


# field: (its values this server takes, what it would ask for)
_NO_TOOLS = ((None, []), "tool calls")
UNSUPPORTED = {
    "tools": _NO_TOOLS, "functions": _NO_TOOLS, "tool_choice": ((None, "none", "auto"), "tool calls"),
    "function_call": ((None, "none", "auto"), "tool calls"),
    "response_format": ((None, {"type": "text"}), "structured output (only plain text)"),
    "logprobs": ((None, False), "log probabilities"), "top_logprobs": ((None, 0), "log probabilities"),
    "frequency_penalty": ((None, 0, 0.0), "penalties"), "presence_penalty": ((None, 0, 0.0), "penalties"),
    "logit_bias": ((None, {}), "logit biases"), "best_of": ((None, 1), "several answers to pick from"),
    "echo": ((None, False), "the prompt echoed back"), "suffix": ((None, ""), "a suffix (insertion)"),
    "modalities": ((None, ["text"]), "audio"), "audio": ((None,), "audio"),
    "prediction": ((None,), "predicted outputs"), "reasoning_effort": ((None,), "reasoning settings"),
    "verbosity": ((None,), "verbosity settings"), "web_search_options": ((None,), "web search"),
}
_EXPECTED = {"bool_type": "true or false", "int_type": "a whole number", "float_type": "a number",
             "string_type": "a string", "model_type": "an object", "dict_type": "an object",
             "finite_number": "a finite number"}


def parse(body: dict, kind: str, model: str | list[str], max_cache_len: int,
          vision: bool = False) -> tuple[dict, bool, bool]:
    """The whole request checked, before it takes a turn: (the chat process's fields, the model's
    name among them, stream, usage wanted at a stream's end). `model`: the name served, or the
    names (several runs' adapters on one base); `vision`: it is a vision-language model, whose
    user messages may hold images. Raises ApiError saying what to change."""
    served = [model] if isinstance(model, str) else list(model)
    try:
        request = (_ChatRequest if kind == "chat" else _TextRequest).model_validate(body)
    except ValidationError as invalid:
        raise _refusal(invalid.errors()[0], served) from None
    if request.model not in served:
        raise ApiError(404, f"model {request.model!r} is not served here; this server serves {_names(served)} "
                       "(GET /v1/models)", "model", "model_not_found")
    for name, (defaults, what) in UNSUPPORTED.items():
        value = getattr(request, name, None)
        if not any(value == ok and type(value) is type(ok) for ok in defaults):
            raise ApiError(400, f"{name} {json.dumps(value)[:80]}: this server does not do {what}; it writes one "
                           f"plain-text answer per request. Leave {name} out", name, "unsupported_parameter")
    if request.stream_options is not None and not request.stream:
        raise ApiError(400, "stream_options goes with \"stream\": true; leave it out of a request that is not "
                       "streamed", "stream_options")
    fields = sampling(body, max_cache_len) | {"model": request.model}
    if kind == "chat":
        fields |= {"messages": chat_messages(body, None if vision else request.model)}
    else:
        fields |= {"messages": None, "text": completion_prompt(body)}
    usage = bool(request.stream_options and request.stream_options.include_usage)
    return fields, bool(request.stream), usage


def _names(served: list[str]) -> str:
    return ", ".join(repr(name) for name in served)


def _refusal(error: dict, served: list[str]) -> ApiError:
    param = ".".join(str(part) for part in error["loc"])
    if error["type"] == "missing":
        return ApiError(400, f"{param} is required" + (f": this server serves {_names(served)} (GET /v1/models)"
                                                       if param == "model" else ""), param)
    if error["type"] == "extra_forbidden":
        return ApiError(400, f"unknown field {param!r}: OpenAI's API has no such field here; leave it out", param,
                        "unknown_parameter")
    expected = _EXPECTED.get(error["type"])
    if expected is None:
        return ApiError(400, f"{param}: {error['msg']}", param)
    return ApiError(400, f"{param} must be {expected}, got {json.dumps(error['input'])[:80]}", param)


def sampling(body: dict, max_cache_len: int) -> dict:
    """max_tokens, temperature, top_p, seed, stop and n, checked; the chat process's fields."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    room = max_cache_len - buckets_for(max_cache_len, 1)[0]  # the smallest prompt bucket stays free
    if not _whole(max_tokens) or not 1 <= max_tokens <= room:
        raise ApiError(400, f"max_tokens must be a whole number from 1 to {room} (the model's cache holds "
                            f"{max_cache_len} tokens, prompt included), got {max_tokens!r}", "max_tokens")
    temperature = body.get("temperature", 1.0)
    temperature = 1.0 if temperature is None else temperature
    if not _number(temperature) or not 0 <= temperature <= 2:
        raise ApiError(400, f"temperature must be a number from 0 to 2, got {temperature!r}", "temperature")
    top_p = 1.0 if body.get("top_p") is None else body["top_p"]
    if not _number(top_p) or not 0 < top_p <= 1:
        raise ApiError(400, f"top_p must be above 0 and at most 1, got {top_p!r}", "top_p")
    seed = body.get("seed")
    if seed is not None and not (_whole(seed) and SEEDS[0] <= seed <= SEEDS[1]):
        raise ApiError(400, f"seed must be a whole number from {SEEDS[0]} to {SEEDS[1]}, got {seed!r}", "seed")
    n = body.get("n")
    if n is not None and not (_whole(n) and n == 1):
        raise ApiError(400, f"n must be 1: this server writes one answer per request, got {n!r}", "n")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"stop must be a string or a list of up to {MAX_STOP} non-empty strings", "stop")
    return {"max_new_tokens": max_tokens, "temperature": float(temperature), "top_p": float(top_p), "seed": seed,
            "stop": stop}


def chat_messages(body: dict, text_model: str | None = None) -> list[dict]:
    """The request's messages as the chat process takes them; a user message's images (OpenAI's
    image_url parts, base64 data URLs only) as its image parts. `text_model`: the name of a model
    that takes no images (None: a vision-language model)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content}", "messages")
    images = sum(_is_image_url(part) for message in messages if isinstance(message, dict)
                 and isinstance(message.get("content"), list) for part in message["content"])
    if text_model is None and images > MAX_IMAGES:  # counted before any is decoded
        raise ApiError(400, f"the messages hold {images} images; this server takes at most {MAX_IMAGES} a request",
                       "messages")
    found = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        role = "system" if role == "developer" else role  # OpenAI's newer name for the system prompt
        if role not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}",
                           f"messages[{i}].role")
        content, param = message.get("content"), f"messages[{i}].content"
        if role == "user" and isinstance(content, list) and any(_is_image_url(p) for p in content):
            if text_model is not None:
                raise ApiError(400, f"{param} holds an image, and model {text_model!r} takes text alone: send "
                               "text, or serve a vision-language model's run", param)
            found.append({"role": role, "content": _parts(content, param)})
        else:
            found.append({"role": role, "content": _text(content, param)})
    if found[-1]["role"] == "assistant":
        raise ApiError(400, "the last message must be the user's (or the system's): the model answers it",
                       f"messages[{len(found) - 1}].role")
    return found


def completion_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt must be a non-empty string (one prompt per request)", "prompt")
    return prompt


def _text(content, param: str) -> str:
    """A message's content: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"{param} must be text (a string, or a list of {{type: text, text}} parts)", param)


def _is_image_url(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def _parts(content: list, param: str) -> list[dict]:
    """A user message's text and image_url parts as the chat process's parts: each image read from
    its base64 data URL and checked (a web address is never fetched)."""
    parts = []
    for n, part in enumerate(content):
        where = f"{param}[{n}]"
        if _is_image_url(part):
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise ApiError(400, f"{where}.image_url must be {{\"url\": \"data:image/png;base64,...\"}}", where)
            try:
                parts.append(image_part(data_url_bytes(url, f"{where}.image_url"), f"{where}: the image"))
            except ImageError as error:
                raise ApiError(400, str(error), where) from None
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise ApiError(400, f"{where} must be a text part ({{type: text, text}}) or an image "
                           "({type: image_url, image_url: {url: data:image/png;base64,...}})", where)
    return parts


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def too_long(message: str, max_cache_len: int, max_tokens: int, setting: str = CACHE_SETTING) -> str:
    """What to change for a prompt that does not fit: fewer tokens only when that helps, else the
    largest prompt there is (the largest bucket the cache leaves room in) and the setting that
    raises it. `message`: the chat process's, which counts the prompt's tokens."""
    counted = re.search(r"the prompt is (\d+) tokens", message)
    tokens = int(counted.group(1)) if counted else None
    said = f"the prompt is {tokens} tokens" if tokens is not None else "the prompt does not fit"
    return _too_long(said, tokens, max_cache_len, max_tokens, setting)


def _too_long(said: str, tokens: int | None, max_cache_len: int, max_tokens: int, setting: str) -> str:
    longest = buckets_for(max_cache_len, 1)[-1]
    if tokens is not None and tokens <= longest:
        bucket = next(b for b in buckets_for(max_cache_len, 1) if b >= tokens)
        return (f"{said}, padded to {bucket}; with the answer's max_tokens {max_tokens} they do not fit the "
                f"model's {max_cache_len}-token cache: ask for at most {max_cache_len - bucket} tokens, or "
                "shorten the prompt")
    bucket = next((b for b in BUCKETS if tokens is not None and b >= tokens), None)
    raise_it = (f"or serve with a cache of at least {bucket + max_tokens} tokens ({setting})" if bucket
                else f"the largest prompt bucket there is holds {BUCKETS[-1]}")
    return (f"{said}; the longest prompt this server takes is {longest} tokens, whatever max_tokens (its largest "
            f"prompt bucket that leaves room for an answer in its {max_cache_len}-token cache, set by {setting}): "
            f"shorten the prompt, {raise_it}")


# --- a request's size, before its prompt is tokenized ------------------------------------------
@dataclass(frozen=True)
class SizeLimits:
    """What a request may weigh before its prompt is tokenized. `longest_token_chars`: the most
    characters of a text one token of the model's tokenizer covers (its longest vocabulary entry);
    `drops_characters`: the tokenizer drops or folds characters (a prompt's length in characters
    then bounds nothing). Both are the chat process's, measured on the tokenizer it loaded
    (chat_worker.tokenizer_reach, said in its `ready` event)."""
    max_cache_len: int
    longest_token_chars: int
    drops_characters: bool = False
    vision: bool = False  # a vision-language model: a body may carry MAX_IMAGES images besides

    @property
    def longest_prompt(self) -> int:
        """No prompt takes more tokens: the largest prompt bucket that leaves room for one new token."""
        return buckets_for(self.max_cache_len, 1)[-1]

    @property
    def max_prompt_chars(self) -> int | None:
        """A prompt of more characters cannot fit, whatever max_tokens: each of its tokens covers
        at most `longest_token_chars` of its characters, so it takes more than `longest_prompt`
        tokens. None when the tokenizer drops characters."""
        return None if self.drops_characters else self.longest_prompt * self.longest_token_chars

    @property
    def max_body_bytes(self) -> int:
        """The most a request's body may weigh: the longest prompt's characters, each in the most
        bytes JSON writes one in, and room for the rest of the request."""
        images = MAX_IMAGES * (MAX_IMAGE_BYTES * 4 // 3 + 64) if self.vision else 0  # base64, in a data URL
        return self.longest_prompt * self.longest_token_chars * JSON_BYTES_PER_CHARACTER + REST_OF_REQUEST + images

    def too_large(self, setting: str = CACHE_SETTING) -> ApiError:
        """The 413 for a body over `max_body_bytes`."""
        chars = self.longest_prompt * self.longest_token_chars
        return ApiError(413, f"the request body is over {self.max_body_bytes:,} bytes, the most this server reads: "
                        f"its prompts are at most {self.longest_prompt} tokens, {chars:,} characters with this "
                        f"model's tokenizer, at most {JSON_BYTES_PER_CHARACTER} bytes each in "
                        f"JSON, with {REST_OF_REQUEST / 2**20:g} MiB for the rest of the request. Shorten the prompt, or "
                        f"serve with a longer cache ({setting})", code="request_too_large")


def check_size(fields: dict, limits: SizeLimits, setting: str = CACHE_SETTING) -> None:
    """A prompt of more characters than `limits.max_prompt_chars` is refused as too long (the
    context_length_exceeded 400) without being tokenized."""
    bound = limits.max_prompt_chars
    chars = prompt_characters(fields)
    if bound is None or chars <= bound:
        return
    tokens = -(-chars // limits.longest_token_chars)
    said = (f"the prompt is {chars:,} characters, so at least {tokens:,} tokens (a token of this model covers at "
            f"most {limits.longest_token_chars} characters)")
    message = _too_long(said, tokens, limits.max_cache_len, fields["max_new_tokens"], setting)
    raise ApiError(400, message, "messages" if fields.get("messages") is not None else "prompt",
                   "context_length_exceeded")


def prompt_characters(fields: dict) -> int:
    """The fewest characters of a request's prompt the tokenizer sees: a plain prompt's, or what a
    chat template keeps of each message at least: its text without the whitespace around it
    (Llama 3's template trims each message), an assistant's without its reasoning up to the last
    </think> (Qwen3's drops an earlier answer's)."""
    if fields.get("messages") is None:
        return len(fields["text"])
    kept = (m["content"].rsplit(END_THINK, 1)[-1] if m["role"] == "assistant" else text_of(m["content"])
            for m in fields["messages"])
    return sum(len(text.strip()) for text in kept)
