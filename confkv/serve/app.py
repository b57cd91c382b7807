"""The OpenAI-compatible HTTP layer of ``confkv serve`` (FastAPI): requests in, the engine's events out.

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (``stream: true`` as Server-Sent Events),
``/v1/models``, ``/health``, ``/metrics`` (Prometheus text). Each request may carry its own cache
settings as ``{"confkv": {"memory": 0.25, "policy": "tova", "params": {...}}}`` (the openai client's
``extra_body``); the server's settings are the default.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from confkv.errors import ConfKVError, PromptTooLongError
from confkv.serve.engine import Engine, Job, QueueFull, ShuttingDown
from confkv.serve.metrics import render_metrics
from confkv.serve.text import TextStream

#: keys of the ``confkv`` request extension
CONFKV_KEYS = ("memory", "max_kv_bytes", "policy", "params", "ignore_eos")


class BadRequest(ConfKVError, ValueError):
    """A request the server refuses with 400; the message is the reason."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Server:
    """What the app serves: the model, its tokenizer, the default cache settings and the engine.

    ``memory`` / ``max_kv_bytes`` / ``policy`` / ``params`` are the defaults of every request's cache
    (:meth:`ConfKVCache.for_model`); ``chunk`` is the prefill chunk (also the cache's ``prefill_chunk``).
    """

    model: Any
    tokenizer: Any
    model_name: str = "confkv"
    memory: float | None = 0.25
    max_kv_bytes: int | None = None
    policy: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    chunk: int = 256
    max_batch: int = 8
    max_queue: int = 64
    default_max_tokens: int = 256
    retry_after: int = 1
    step_hook: Any = None
    engine: Engine = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        from confkv.hf import enable
        from confkv.models import model_max_positions

        enable(self.model)
        self.max_positions = model_max_positions(self.model)
        self.engine = Engine(self.model, chunk=self.chunk, max_batch=self.max_batch, max_queue=self.max_queue,
                             step_hook=self.step_hook)
        self.build_cache(self.cache_settings(None))  # the server's own settings must build a cache

    # -- a request's cache -------------------------------------------------------------------
    def cache_settings(self, extra: Any) -> dict[str, Any]:
        """The cache settings of a request: the server's, overridden by its ``confkv`` extension."""
        settings: dict[str, Any] = {"memory": self.memory, "max_kv_bytes": self.max_kv_bytes,
                                    "policy": self.policy, "params": dict(self.params), "ignore_eos": False}
        if extra is not None:
            if not isinstance(extra, dict):
                raise BadRequest("confkv: must be an object, e.g. {\"memory\": 0.25}", "confkv")
            unknown = sorted(set(extra) - set(CONFKV_KEYS))
            if unknown:
                raise BadRequest(f"confkv: unknown setting {unknown[0]!r}; known: {', '.join(CONFKV_KEYS)}", "confkv")
            if "memory" in extra or "max_kv_bytes" in extra:  # a target given replaces the server's target
                settings["memory"] = extra.get("memory")
                settings["max_kv_bytes"] = extra.get("max_kv_bytes")
            if "policy" in extra:
                settings["policy"] = extra["policy"]
                settings["params"] = {}
            if extra.get("params") is not None:
                if not isinstance(extra["params"], dict):
                    raise BadRequest("confkv.params: must be an object of policy parameters", "confkv")
                settings["params"] = {**settings["params"], **extra["params"]}
            settings["ignore_eos"] = bool(extra.get("ignore_eos", False))
        if settings["policy"] is not None and not isinstance(settings["policy"], str):
            raise BadRequest("confkv.policy: must be a policy or preset name (see `confkv policies`)", "confkv")
        return settings

    def build_cache(self, settings: dict[str, Any]) -> Any:
        from confkv.config import StoreConfig
        from confkv.hf import ConfKVCache

        try:
            return ConfKVCache.for_model(self.model, settings["policy"], memory=settings["memory"],
                                         max_kv_bytes=settings["max_kv_bytes"],
                                         store=StoreConfig(prefill_chunk=self.chunk), trace_limit=8,
                                         **settings["params"])
        except (ConfKVError, ValueError, TypeError) as error:
            raise BadRequest(str(error), "confkv") from error

    # -- prompts --------------------------------------------------------------------------------
    def completion_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            vocab = self.model.config.get_text_config().vocab_size
            if any(t < 0 or t >= vocab for t in ids):
                raise BadRequest(f"prompt: token ids must be in [0, {vocab})", "prompt")
        elif isinstance(prompt, list):
            raise BadRequest("prompt: one prompt per request (a string or a list of token ids)", "prompt")
        else:
            raise BadRequest("prompt: must be a string or a list of token ids", "prompt")
        if not ids:
            raise BadRequest("prompt: empty; give at least one token", "prompt")
        return ids

    def chat_prompt(self, messages: Any) -> list[int]:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise BadRequest("messages: must be a non-empty list of {role, content} objects with text content",
                             "messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest(f"the model {self.model_name!r} has no chat template; use /v1/completions", "messages")
        text = self.tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                                  tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise BadRequest("messages: the chat template gave an empty prompt", "messages")
        return ids

    def eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return frozenset(ids)


def _number(body: dict, name: str, default: Any, low: float, high: float, integer: bool = False) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)
    if not ok or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise BadRequest(f"{name}: must be {kind} in [{low}, {high}], got {value!r}", name)
    return value


@dataclass
class Parsed:
    prompt: list[int]
    settings: dict[str, Any]
    cache: Any
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    stream: bool


def parse_request(server: Server, body: Any, chat: bool) -> Parsed:
    """Validate an OpenAI request body; raises :class:`BadRequest` naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if _number(body, "n", 1, 1, 1, integer=True) != 1:
        raise BadRequest("n: only n=1 is supported", "n")
    for unsupported in ("logprobs", "top_logprobs", "echo", "best_of", "tools", "suffix"):
        value = body.get(unsupported)
        if value not in (None, False) and not (unsupported == "best_of" and value == 1):
            raise BadRequest(f"{unsupported}: not supported by confkv serve", unsupported)
    prompt = server.chat_prompt(body.get("messages")) if chat else server.completion_prompt(body.get("prompt"))
    settings = server.cache_settings(body.get("confkv"))
    cache = server.build_cache(settings)  # a target the cache cannot hold: 400 with the library's message
    temperature = float(_number(body, "temperature", 1.0, 0.0, 2.0))
    top_p = float(_number(body, "top_p", 1.0, 0.0, 1.0))
    if top_p <= 0:
        raise BadRequest("top_p: must be in (0, 1]", "top_p")
    seed = _number(body, "seed", None, -2**63, 2**63 - 1, integer=True)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
        raise BadRequest("stop: must be a string or a list of at most 4 strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream: must be true or false", "stream")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    room = server.max_positions - len(prompt)
    max_tokens = _number(body, name, None, 1, 2**31, integer=True)
    from confkv.hf import check_prompt_length

    try:
        check_prompt_length(server.model, len(prompt), max_tokens if max_tokens is not None else 1)
    except PromptTooLongError as error:
        raise BadRequest(str(error), name if max_tokens is not None else ("messages" if chat else "prompt")) from error
    if max_tokens is None:
        max_tokens = min(server.default_max_tokens, room)
    return Parsed(prompt, settings, cache, max_tokens, temperature, top_p, seed, stop, stream)


def _error(status: int, message: str, kind: str, param: str | None = None, headers: dict | None = None):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


def create_app(server: Server):
    """The FastAPI app of ``server``; its lifespan starts the engine and, at shutdown, drains it."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.engine.start()
        yield
        await asyncio.to_thread(server.engine.stop, True)

    app = FastAPI(title="confkv serve", lifespan=lifespan)
    app.state.server = server

    @app.get("/health")
    async def health():
        engine = server.engine
        if engine._stopping:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok", "running": len(engine.running), "waiting": engine.queue_depth, "pid": os.getpid()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "confkv", "max_model_len": server.max_positions}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(server), media_type="text/plain; version=0.0.4")

    async def handle(request: Request, chat: bool):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the body is not valid JSON", "invalid_request_error")
        try:
            parsed = parse_request(server, body, chat)
        except BadRequest as error:
            return _error(400, str(error), "invalid_request_error", error.param)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(kind: str, payload: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown)
                loop.call_soon_threadsafe(events.put_nowait, (kind, payload))

        text = TextStream(server.tokenizer, parsed.stop)
        job = Job(prompt=parsed.prompt, cache=parsed.cache, max_tokens=parsed.max_tokens,
                  emit=emit, temperature=parsed.temperature, top_p=parsed.top_p, seed=parsed.seed,
                  eos=server.eos_ids(), ignore_eos=parsed.settings["ignore_eos"],
                  stop_check=text.reached_stop if parsed.stop else None)
        try:
            server.engine.submit(job)
        except QueueFull as error:
            return _error(429, str(error), "rate_limit_error", headers={"Retry-After": str(server.retry_after)})
        except ShuttingDown as error:
            return _error(503, str(error), "server_error", headers={"Retry-After": str(server.retry_after)})
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{job.id}"
        created = int(time.time())
        if parsed.stream:
            return StreamingResponse(_stream(server, request, job, events, text, chat, ident, created),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _complete(server, request, job, events, text, chat, ident, created, parsed)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def _usage(job: Job) -> dict[str, int]:
    return {"prompt_tokens": len(job.prompt), "completion_tokens": len(job.tokens),
            "total_tokens": len(job.prompt) + len(job.tokens)}


def _confkv_info(job: Job) -> dict[str, int]:
    return {"peak_kv_bytes": job.peak_kv_bytes}


async def _complete(server, request, job, events, text, chat, ident, created, parsed):
    from fastapi.responses import JSONResponse

    reason = None
    while reason is None:
        try:
            kind, payload = await asyncio.wait_for(events.get(), timeout=0.25)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                return JSONResponse({}, status_code=499)
            continue
        if kind == "error":
            return _error(500, payload, "server_error")
        if kind == "done":
            reason = payload
    content = text.decode(job.tokens)
    end = text.stop_index(content)
    content = content if end is None else content[:end]
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None, "token_ids": list(job.tokens)}
    if chat:
        choice["message"] = {"role": "assistant", "content": content}
    else:
        choice["text"] = content
    return JSONResponse({"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
                         "model": server.model_name, "choices": [choice], "usage": _usage(job),
                         "confkv": _confkv_info(job)})


async def _stream(server, request, job, events, text, chat, ident, created):
    kind_name = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | None, reason: str | None, token_ids: list[int], role: bool = False) -> str:
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None, "token_ids": token_ids}
        if chat:
            choice["delta"] = {"role": "assistant", "content": ""} if role else (
                {"content": delta} if delta is not None else {})
        else:
            choice["text"] = delta or ""
        body: dict[str, Any] = {"id": ident, "object": kind_name, "created": created, "model": server.model_name,
                                "choices": [choice]}
        if reason is not None:
            body["usage"] = _usage(job)
            body["confkv"] = _confkv_info(job)
        return f"data: {json.dumps(body)}\n\n"

    finished = False
    try:
        if chat:
            yield chunk(None, None, [], role=True)
        while True:
            kind, payload = await events.get()
            if kind == "token":
                delta = text.update(job.tokens[:len(job.tokens)])
                yield chunk(delta, None, [payload])
            elif kind == "error":
                finished = True
                error = {"error": {"message": payload, "type": "server_error", "param": None, "code": 500}}
                yield f"data: {json.dumps(error)}\n\n"
                return
            else:  # done
                finished = True
                if payload == "cancelled":
                    return
                tail = text.update(list(job.tokens), final=True)
                yield chunk(tail, payload, [])
                yield "data: [DONE]\n\n"
                return
    finally:
        if not finished:  # the client went away: the row leaves at its next step
            job.cancel()
