"""The OpenAI-compatible HTTP server over `serving.engine.Engine` (`jaxmodels serve`).

    app = build_app(Engine(model, EngineConfig(max_num_seqs=64)), "smollm2", api_key="sk-local")
    uvicorn.run(app, host="127.0.0.1", port=8000)

The engine is single-threaded, so one `EngineLoop` thread owns it: HTTP handlers (on the asyncio loop) send it
adds and aborts through a queue; it steps and hands each request's outputs back to that request's asyncio queue
with call_soon_threadsafe. A request the engine refuses comes back as a 400 naming the field; a client that
leaves (streaming or not) aborts its requests, which frees their blocks.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import queue
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from jaxmodels import multimodal
from serving.engine import Engine
from serving.llm import fan_out, prompt_ids
from serving.metrics import Metrics
from serving.request import MAX_LOGPROBS, Logprob, SamplingParams, StepOutput

log = logging.getLogger("jaxmodels.serving.api")

MAX_N = 128  # completions per prompt, as OpenAI caps `n`


# ---------------------------------------------------------------------------------------------------- errors
class APIError(Exception):
    """An OpenAI-style error response: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code, self.headers = \
            status, message, param, type, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


class EngineError(Exception):
    """The engine failed while it held a request (not the request's fault): the request fails, the server goes on."""


class ServerStopping(Exception):
    pass


def _server_error(e: BaseException) -> APIError:
    if isinstance(e, ServerStopping):
        return APIError(503, "the server is shutting down", type="server_error", code="server_stopping")
    return APIError(500, str(e) or type(e).__name__, type="server_error")


# ----------------------------------------------------------------------------------------------- engine loop
class Job:
    """The engine requests of one HTTP request. Iterating yields, per engine step, the StepOutputs of those of
    them that advanced, until all have finished; an engine failure is raised."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rids: list[str]):
        self.loop, self.rids, self.open = loop, rids, set(rids)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrival = time.monotonic()

    async def __aiter__(self) -> AsyncIterator[list[StepOutput]]:
        while self.open:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.open.clear()  # the engine thread has dropped them already
                raise item
            self.open.difference_update(o.request_id for o in item if o.finished)
            yield item


class EngineLoop:
    """Owns an Engine: one thread takes adds and aborts from a queue, steps, and posts each job's outputs to its
    asyncio queue. It waits on an Event while there is no work. At most `capacity` engine requests are in flight
    (running + waiting); past that `submit` raises APIError 429."""

    def __init__(self, engine: Engine, capacity: int, metrics: Metrics | None = None):
        self.engine, self.capacity = engine, capacity
        self.metrics = metrics or Metrics(lambda: self.stats)
        self.stats = engine.stats()  # the engine's, as of the last step: what other threads may read
        self.pending = 0  # engine requests accepted and not finished (guarded by _lock)
        self._lock = threading.Lock()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._jobs: dict[str, Job] = {}  # engine thread only, as are the two below
        self._last: dict[str, float] = {}  # time of each request's latest output
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---------------------------------------------------------------------- any thread
    def start(self) -> None:
        if not self.alive:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="jaxmodels-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Fail what is still in flight and end the thread."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _send(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wake.set()

    # ---------------------------------------------------------------------- the asyncio side
    async def submit(self, requests: list[tuple[str, list[int], SamplingParams, dict | None]]) -> Job:
        """Queue (request id, prompt ids, params, processed images or None) as one job: all accepted, or ValueError
        from the engine and none."""
        if self._stopping or not self.alive:  # nobody would take the command
            raise ServerStopping()
        with self._lock:
            if self.pending + len(requests) > self.capacity:
                raise APIError(429, f"the server is at capacity ({self.capacity} requests in flight); retry later",
                               type="rate_limit_error", code="server_overloaded", headers={"Retry-After": "1"})
            self.pending += len(requests)
        loop = asyncio.get_running_loop()
        job, accepted = Job(loop, [r[0] for r in requests]), loop.create_future()
        self._send(("add", job, requests, accepted))
        try:
            await accepted
        except BaseException:  # refused (the engine thread has released it) or the client left meanwhile
            self.abort(job)
            raise
        return job

    def abort(self, job: Job) -> None:
        """Abort the job's unfinished requests (a no-op for those the engine has finished meanwhile)."""
        if job.open:
            self._send(("abort", list(job.open)))

    # ---------------------------------------------------------------------- the engine thread
    def _run(self) -> None:
        while not self._stopping:
            try:
                self._take_commands()
                if not self.engine.has_work():
                    self.stats = self.engine.stats()
                    self._wake.wait()
                    self._wake.clear()  # then take_commands sees whatever set it
                    continue
                self._deliver(self.engine.step())
                self.stats = self.engine.stats()
            except Exception as e:  # noqa: BLE001 - whatever breaks, fail the requests in flight and go on
                log.exception("engine step failed; failing the %d requests in flight", len(self._jobs))
                self._fail(list(self._jobs), EngineError(f"the engine failed: {type(e).__name__}: {e}"))
        self._fail(list(self._jobs), ServerStopping())
        while True:  # adds that came too late
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                self._release(len(command[2]))
                _settle(command[1].loop, command[3], ServerStopping())

    def _take_commands(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._add(*command[1:])
            else:
                for rid in command[1]:
                    if self._jobs.get(rid) is not None and self.engine.abort(rid):
                        self._done(rid, "abort")

    def _add(self, job: Job, requests: list, accepted: asyncio.Future) -> None:
        added = []
        try:
            for rid, ids, params, images in requests:
                self.engine.add(rid, ids, params, images)
                added.append(rid)
        except Exception as e:  # noqa: BLE001 - ValueError: the request's fault (400); anything else: ours (500)
            for rid in added:
                self.engine.abort(rid)
            self._release(len(requests))
            _settle(job.loop, accepted, e if isinstance(e, ValueError) else EngineError(f"{type(e).__name__}: {e}"))
            return
        for rid in added:
            self._jobs[rid] = job
        _settle(job.loop, accepted, None)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        now, by_job = time.monotonic(), {}
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if job is None:  # aborted in this step's commands
                continue
            last = self._last.get(out.request_id)
            (self.metrics.ttft if last is None else self.metrics.itl).observe(now - (last or job.arrival))
            self._last[out.request_id] = now
            by_job.setdefault(job, []).append(out)
            if out.finished:
                self.metrics.e2e.observe(now - job.arrival)
                self._done(out.request_id, out.finish_reason)
        for job, outs in by_job.items():
            self._post(job, outs)

    def _post(self, job: Job, item) -> None:
        try:
            job.loop.call_soon_threadsafe(job.queue.put_nowait, item)
        except RuntimeError:  # its event loop has closed: nobody is listening
            for rid in job.rids:
                if self._jobs.get(rid) is job and self.engine.abort(rid):
                    self._done(rid, "abort")

    def _fail(self, rids: list[str], error: Exception) -> None:
        jobs = {}
        for rid in rids:
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - the engine is already broken; free what can be freed
                log.exception("abort of %s failed", rid)
            jobs[self._jobs[rid]] = None
            self._done(rid, "error")
        for job in jobs:
            self._post(job, error)

    def _done(self, rid: str, reason: str) -> None:
        self._jobs.pop(rid, None)
        self._last.pop(rid, None)
        self._release(1)
        self.metrics.finished.labels(reason).inc()

    def _release(self, n: int) -> None:
        with self._lock:
            self.pending -= n


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future, error: BaseException | None) -> None:
    def settle():
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(None)
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # that event loop has closed
        pass


# ------------------------------------------------------------------------------------------- request bodies
class StreamOptions(BaseModel):
    include_usage: bool = False


Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class _Sampling(BaseModel):
    """What completions and chat share: OpenAI's sampling fields, then vLLM's extras."""

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False, description="0: greedy (default 1)")
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, description="reproducible sampling (taken modulo 2**32)")
    stop: Text | list[Text] | None = Field(None, description="the text ends before the first of these")
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = Field(None, ge=-1, description="vLLM extra; 0 or -1: off")
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False, description="vLLM extra")
    ignore_eos: bool = Field(False, description="vLLM extra: keep generating past the end-of-sequence token")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, description="vLLM extra")
    skip_special_tokens: bool = Field(True, description="vLLM extra")
    include_stop_str_in_output: bool = Field(False, description="vLLM extra")


class CompletionRequest(_Sampling):
    prompt: Text | Annotated[list[Text], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(
        min_length=1)] = Field(description="text or token ids, or a batch of either")
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="top alternatives per token")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str = Field(description="a data: URI (data:image/png;base64,...); http(s) URLs are refused: the server "
                                 "fetches nothing")
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias of max_completion_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


def _sampling(body: _Sampling, max_tokens: int | None, logprobs: int | None, names: dict,
              vocab: int) -> SamplingParams:
    """SamplingParams of a body; its ValueError (which starts with the field's name) as a 400 naming the field."""
    def given(value, default):
        return default if value is None else value
    try:
        return SamplingParams(
            n=body.n, temperature=given(body.temperature, 1.0), top_p=given(body.top_p, 1.0),
            # top_k >= vocab keeps every token, as 0 does; the runner's int32 cannot hold any int (e.g. 2**31)
            top_k=min(given(body.top_k, 0), vocab), min_p=given(body.min_p, 0.0),
            seed=None if body.seed is None else body.seed % 2**32, max_tokens=max_tokens,
            stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos, logprobs=logprobs,
            presence_penalty=given(body.presence_penalty, 0.0), frequency_penalty=given(body.frequency_penalty, 0.0),
            skip_special_tokens=body.skip_special_tokens, include_stop_str_in_output=body.include_stop_str_in_output)
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), names.get(field, field)) from None


# -------------------------------------------------------------------------------------------------- responses
@dataclass
class _Choice:
    text: str = ""
    tokens: int = 0
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, out: StepOutput) -> None:
        self.text += out.text
        self.tokens += len(out.token_ids)
        self.logprobs += out.logprobs
        self.finish_reason = out.finish_reason


def _lp(v: float) -> float:
    return max(v, -9999.0) if not math.isnan(v) else -9999.0  # JSON has no -inf (vLLM clamps the same way)


class _Kind:
    """How one endpoint writes choices, chunks and logprobs."""

    def __init__(self, chat: bool, token_text):
        self.chat, self.token = chat, token_text
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.prefix = "chatcmpl" if chat else "cmpl"

    def logprobs(self, lps: list[Logprob], offset: int) -> dict:
        if self.chat:
            def entry(i, v):
                s = self.token(i)
                return {"token": s, "logprob": _lp(v), "bytes": list(s.encode())}
            return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                                for lp in lps]}
        tokens = [self.token(lp.token_id) for lp in lps]
        offsets = [offset + sum(map(len, tokens[:k])) for k in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [_lp(lp.logprob) for lp in lps],
                "top_logprobs": [{self.token(i): _lp(v) for i, v in lp.top} for lp in lps], "text_offset": offsets}

    def choice(self, index: int, c: _Choice, want_logprobs: bool) -> dict:
        lps = self.logprobs(c.logprobs, 0) if want_logprobs else None
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": c.text}, "logprobs": lps,
                    "finish_reason": c.finish_reason}
        return {"index": index, "text": c.text, "logprobs": lps, "finish_reason": c.finish_reason}

    def delta(self, index: int, text: str, lps: dict | None, finish_reason: str | None) -> dict:
        if self.chat:
            return {"index": index, "delta": {"content": text} if text else {}, "logprobs": lps,
                    "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": lps, "finish_reason": finish_reason}


def _usage(prompts: list[list[int]], completion_tokens: int) -> dict:
    p = sum(map(len, prompts))
    return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}


class _SSE(StreamingResponse):
    """Server-sent events that abort the job however the response ends (also when the client leaves before the
    body generator ever started, so that its `finally` would never run)."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _event(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Server:
    def __init__(self, engine: Engine, name: str, runner: EngineLoop):
        self.engine, self.name, self.runner, self.tokenizer = engine, name, runner, engine.tokenizer
        self.created = int(time.time())
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._token_text)

    def _token_text(self, i: int) -> str:
        return self.tokenizer.decode([i], skip_special_tokens=False) if self.tokenizer else f"token_id:{i}"

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "jaxmodels",
                "max_model_len": self.engine.max_model_len}

    def check_model(self, name: str) -> None:
        if name != self.name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.name!r}", "model",
                           code="model_not_found")

    # ---------------------------------------------------------------------------- endpoints
    async def completion(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        params = _sampling(body, body.max_tokens, body.logprobs, {}, self.engine.model.config.logits_size)
        batch = isinstance(body.prompt, list) and not isinstance(body.prompt[0], int)
        prompts = body.prompt if batch else [body.prompt]
        try:
            ids = await run_in_threadpool(lambda: [prompt_ids(p, self.tokenizer) for p in prompts])
        except ValueError as e:
            raise APIError(400, f"prompt: {e}", "prompt") from None
        return await self._run(_Kind(False, self.token_text), ids, params, body, request, "prompt",
                               body.logprobs is not None)

    async def chat(self, body: ChatRequest, request: Request):
        self.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = _sampling(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                           {"logprobs": "top_logprobs",
                            "max_tokens": "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"},
                           self.engine.model.config.logits_size)
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
        images = [(f"messages[{i}].content[{j}]", p.image_url.url) for i, m in enumerate(body.messages)
                  if isinstance(m.content, list) for j, p in enumerate(m.content) if p.type == "image_url"]
        if images and self.engine.model.config.vision is None:
            raise APIError(400, f"{images[0][0]}: this model takes no images", images[0][0])
        messages = [{"role": "system" if m.role == "developer" else m.role,  # HF templates know no "developer"
                     "content": _content(m.content, bool(images)), **({"name": m.name} if m.name else {})}
                    for m in body.messages]

        def encode():
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            if not images:
                return self.tokenizer.encode(text, add_special_tokens=False), None  # the template holds any BOS
            pictures = []
            for where, url in images:
                if not url[:5].lower() == "data:":  # never a path on this machine, never a fetch
                    raise APIError(400, f"{where}: image_url must be a data: URI (data:image/png;base64,...); "
                                        f"the server fetches nothing", where)
                try:
                    pictures.append(multimodal.load(self.engine.model, url, where))
                except ValueError as e:
                    raise APIError(400, str(e), where) from None
            ids, arrays = multimodal.prepare(self.engine.model, [text], [pictures], templated=True)
            return ids[0], arrays
        try:
            ids, arrays = await run_in_threadpool(encode)
        except ValueError as e:  # ChatTemplateError: the template refused the messages, or went past its bounds
            raise APIError(400, f"messages: {e}", "messages") from None
        return await self._run(_Kind(True, self.token_text), [ids], params, body, request, "messages", body.logprobs,
                               arrays)

    # ---------------------------------------------------------------------------- running a request
    async def _run(self, kind: _Kind, prompts: list[list[int]], params: SamplingParams, body: _Sampling,
                   request: Request, prompt_field: str, want_logprobs: bool, images: dict | None = None):
        rid = f"{kind.prefix}-{uuid.uuid4().hex}"
        per_prompt = fan_out(params)
        subs = [(f"{rid}-{p}-{j}", ids, sp, images) for p, ids in enumerate(prompts) for j, sp in enumerate(per_prompt)]
        if len(subs) > self.runner.capacity:
            raise APIError(400, f"{len(prompts)} prompt(s) x n={params.n} is {len(subs)} requests; this server holds "
                                f"at most {self.runner.capacity} at once", "n")
        try:
            job = await self.runner.submit(subs)
        except ValueError as e:  # the engine's: the prompt is too long, a token id is out of range, ...
            raise APIError(400, str(e), "stop" if str(e).startswith("stop") else prompt_field) from None
        except (EngineError, ServerStopping) as e:
            raise _server_error(e) from None
        index = {s[0]: i for i, s in enumerate(subs)}
        head = {"id": rid, "created": int(time.time()), "model": self.name}
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            events = self._stream(job, kind, index, prompts, head, usage, want_logprobs)
            return _SSE(events, functools.partial(self.runner.abort, job))
        try:
            choices = await self._collect(job, index, request)
        except (EngineError, ServerStopping) as e:
            raise _server_error(e) from None
        finally:
            self.runner.abort(job)
        if choices is None:  # the client left; nobody reads this
            return Response(status_code=499)
        return {**head, "object": kind.object, "choices": [kind.choice(i, c, want_logprobs) for i, c in
                                                             enumerate(choices)],
                "usage": _usage(prompts, sum(c.tokens for c in choices))}

    async def _collect(self, job: Job, index: dict, request: Request) -> list[_Choice] | None:
        """The choices, once all have finished; None if the client leaves first."""
        choices = [_Choice() for _ in index]

        async def collect():
            async for outs in job:
                for out in outs:
                    choices[index[out.request_id]].add(out)

        work, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this handler is cancelled
            gone.cancel()
            work.cancel()
        if work not in done:
            return None
        work.result()  # raises the engine's failure
        return choices

    async def _stream(self, job: Job, kind: _Kind, index: dict, prompts, head: dict, usage: bool, want_logprobs: bool):
        chunk = {**head, "object": kind.chunk_object, **({"usage": None} if usage else {})}
        offsets, tokens = [0] * len(index), 0
        if kind.chat:  # the role first, as OpenAI sends it
            yield _event({**chunk, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None} for i in range(len(index))]})
        try:
            async for outs in job:
                choices = []
                for out in outs:
                    i = index[out.request_id]
                    tokens += len(out.token_ids)
                    if not (out.text or out.finished or out.logprobs):
                        continue  # a token whose text is held back (half a character, maybe a stop string)
                    lps = kind.logprobs(out.logprobs, offsets[i]) if want_logprobs else None
                    offsets[i] += len(out.text)
                    choices.append(kind.delta(i, out.text, lps, out.finish_reason))
                if choices:
                    yield _event({**chunk, "choices": choices})
        except (EngineError, ServerStopping) as e:
            yield _event(_server_error(e).body())
        else:
            if usage:
                yield _event({**chunk, "choices": [], "usage": _usage(prompts, tokens)})
        yield _event("[DONE]")


# ------------------------------------------------------------------------------------------------------- app
_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})  # pydantic's names of union branches


def _content(content, images: bool):
    """A message's content for the chat template: text (parts joined), or, when the request has images, the parts
    as HF templates read them ({"type": "image"} where an image goes)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not images:
        return "".join(p.text for p in content)
    return [{"type": "text", "text": p.text} if p.type == "text" else {"type": "image"} for p in content]


def _param(loc: tuple) -> str | None:
    """'messages[0].content' of pydantic's ('body', 'messages', 0, 'content', 'str') (union branches dropped)."""
    out = ""
    for part in loc[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in _TAGS:
            out += f".{part}" if out else part
        else:
            break
    return out or None


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # of a union's branches, the one that got furthest: deepest, and past the type check
    err = max(exc.errors(), key=lambda e: (len(e["loc"]), not e["type"].endswith("_type")))
    if err["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}").response()
    param = _param(tuple(err["loc"]))
    if param is None:
        return APIError(400, f"the body must be a JSON object with the request's fields ({err['msg']})").response()
    return APIError(400, f"{param}: {err['msg']}", param).response()


def build_app(engine: Engine, served_model_name: str, api_key: str | None = None, max_waiting: int = 1024) -> FastAPI:
    """The OpenAI-compatible app over `engine`; it starts the engine thread (stopped at the app's shutdown).
    api_key: /v1/* then needs `Authorization: Bearer <api_key>`. max_waiting: engine requests that may queue
    beyond the engine's max_num_seqs before new ones get 429."""
    runner = EngineLoop(engine, engine.config.max_num_seqs + max_waiting)
    server = _Server(engine, served_model_name, runner)
    bearer = HTTPBearer(auto_error=False)

    async def authorized(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)):
        if api_key is not None and (credentials is None or not secrets.compare_digest(
                credentials.credentials.encode(), api_key.encode())):
            raise APIError(401, "a valid API key is needed: Authorization: Bearer <key>", type="invalid_request_error",
                           code="invalid_api_key")

    @asynccontextmanager
    async def lifespan(app):
        runner.start()
        yield
        runner.stop()

    app = FastAPI(title="jaxmodels", summary="OpenAI-compatible completions and chat", lifespan=lifespan)
    app.state.engine_loop = runner
    app.add_exception_handler(APIError, lambda request, e: e.response())
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, lambda request, e: APIError(
        e.status_code, str(e.detail), type="invalid_request_error" if e.status_code < 500 else "server_error",
        headers=getattr(e, "headers", None)).response())
    v1 = [Depends(authorized)] if api_key is not None else []

    app.get("/v1/models", dependencies=v1)(server.models)

    @app.get("/v1/models/{model:path}", dependencies=v1)
    async def model(model: str):
        server.check_model(model)
        return server.model_card()

    app.post("/v1/completions", dependencies=v1, responses={400: {}, 404: {}, 429: {}})(server.completion)
    app.post("/v1/chat/completions", dependencies=v1, responses={400: {}, 404: {}, 429: {}})(server.chat)

    @app.get("/health")
    async def health():
        if not runner.alive:
            return JSONResponse({"status": "engine stopped"}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        data, content_type = runner.metrics.render()
        return Response(data, media_type=content_type)

    runner.start()  # also without lifespan events (an ASGI test transport may not send them)
    return app
