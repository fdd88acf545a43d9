"""OpenAI-compatible routes on `retrain serve`: GET /v1/models, POST /v1/chat/completions
(with `stream`: server-sent events) and POST /v1/completions.

A request is checked (`openai_wire`), its model found (`openai_models`), its prompts
rendered and tokenized here (chat: the tokenizer's chat template, as `retrain sample` renders
them), and sampled through the same engine call as the Tinker `asample` route, on the
service's thread pool: requests of both APIs wait for the model together and are decoded in
one batch. Replies and stream chunks are built by `openai_reply` / `openai_stream`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from retrain.backends.base import Completion
from retrain.serve.door import validate
from retrain.serve.door.backlog import owed
from retrain.serve.engine import EngineError, SampleResult
from retrain.serve.errors import ApiError
from retrain.serve.openai import reply as openai_reply
from retrain.serve.openai import stream as openai_stream
from retrain.serve.openai.adapters import ServedAdapter
from retrain.serve.openai.models import Catalog, Target
from retrain.serve.openai.wire import (
    Call,
    ChatBody,
    CompletionBody,
    Job,
    OpenAIError,
    chat_call,
    completion_call,
    parse,
)
from retrain.serve.tinker.service import TinkerService

log = logging.getLogger("retrain.serve")
NO_CONTEXT_LIMIT_TOKENS = 4096  # max_tokens left out on a model that states no context


@dataclass(frozen=True)
class OpenAIServing:
    """What the OpenAI routes need beside the Tinker service: the served model's tokenizer,
    its end-of-sequence ids, and the `--adapter` checkpoints."""

    tokenizer: Any
    end_ids: frozenset[int]
    adapters: dict[str, ServedAdapter] = field(default_factory=dict)


def build_openai_routes(service: TinkerService, serving: OpenAIServing) -> list[Route]:
    api = OpenAIApi(service, serving)
    return [Route("/v1/models", _openai(api.list_models), methods=["GET"]),
            Route("/v1/models/{model:path}", _openai(api.get_model), methods=["GET"]),
            Route("/v1/chat/completions", _openai(api.chat), methods=["POST"]),
            Route("/v1/completions", _openai(api.complete), methods=["POST"])]


def error_reply(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An error in OpenAI's shape (also for the app's 404/405/413 on /v1/ paths)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(OpenAIError(status, message, param, kind).body(), status_code=status)


async def _unless_gone(work: asyncio.Future, request: Request) -> Any:
    """`work`'s result, or None once the client hangs up first (its body was read)."""
    async def hangup() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    gone = asyncio.ensure_future(hangup())
    try:
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    return work.result() if work.done() else None


def _openai(handler: Callable[[Request], Awaitable[Response]]):
    """Every failure as OpenAI's error JSON: what the client sent (4xx) names its field."""
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except OpenAIError as exc:
            reply = JSONResponse(exc.body(), status_code=exc.status)
            if exc.status == 429:  # the backlog is full: the openai SDK retries after this
                reply.headers["retry-after"] = "1"
            return reply
        except validate.RequestError as exc:
            return error_reply(400, str(exc))
        except EngineError as exc:
            return error_reply(400, str(exc))
        except ApiError as exc:
            return error_reply(exc.status, exc.message)
        except HTTPException as exc:  # the Guard's 413 for a body past the cap, while read
            return error_reply(exc.status_code, str(exc.detail))
        except Exception as exc:  # a bug or an OOM: the client gets a line, the log the trace
            log.exception("%s %s failed", request.method, request.url.path)
            return error_reply(500, f"server error: {type(exc).__name__}: {exc}")
    return endpoint


class OpenAIApi:
    """The handlers, bound to one Tinker service (its engine, pool and sampler state)."""

    def __init__(self, service: TinkerService, serving: OpenAIServing):
        self.service = service
        self.engine = service.engine
        self.tokenizer = serving.tokenizer
        self.catalog = Catalog(service, serving.adapters)
        piece = functools.lru_cache(maxsize=65536)(lambda t: self.tokenizer.decode([t]))
        self.tok = openai_reply.Tokens(
            decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            piece=piece, end_ids=serving.end_ids)
        self._tasks: set[asyncio.Task] = set()
        self.seeding = openai_reply.seeding(getattr(self.engine, "dtype_name", "unknown"))

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": self.catalog.models()})

    async def get_model(self, request: Request) -> Response:
        return JSONResponse(self.catalog.card(request.path_params["model"]))

    async def chat(self, request: Request) -> Response:
        call = chat_call(parse(await request.body(), ChatBody))
        target = await self.catalog.target(call.model)
        try:
            prompt = self._render(call.messages, target)
            job = self._job(call, [prompt], chat=True)
        except BaseException:
            await self.catalog.release(target)
            raise
        return await self._answer(job, target, request)

    async def complete(self, request: Request) -> Response:
        call = completion_call(parse(await request.body(), CompletionBody))
        target = await self.catalog.target(call.model)
        try:
            job = self._job(call, [self._tokens(p, i) for i, p in enumerate(call.prompts)],
                            chat=False)
        except BaseException:
            await self.catalog.release(target)
            raise
        return await self._answer(job, target, request)

    # ------------------------------------------------------------------ prompts

    def _render(self, messages: list[dict], target: Target) -> list[int]:
        from retrain.results.sample import render

        try:
            return render(self.tokenizer, messages, target.chat_template)
        except Exception as exc:  # the template's own checks (roles, order) raise anything
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise OpenAIError(400, f"messages: the chat template cannot render them: "
                              f"{first}", "messages") from None

    def _tokens(self, prompt: str | list[int], i: int) -> list[int]:
        ids = [int(t) for t in self.tokenizer(prompt)["input_ids"]] \
            if isinstance(prompt, str) else prompt
        if not ids:
            raise OpenAIError(400, f"prompt[{i}] is empty", "prompt")
        return ids

    def _job(self, call: Call, prompts: list[list[int]], chat: bool) -> Job:
        """The sampling settings for these prompts; the Tinker route's checks on each."""
        name = "messages" if chat else "prompt"
        context = self.engine.max_context
        max_tokens = call.max_tokens
        if max_tokens is None:
            longest = max(len(p) for p in prompts)
            max_tokens = (context or longest + NO_CONTEXT_LIMIT_TOKENS) - longest
            if max_tokens < 1:
                raise OpenAIError(400, f"{name}: the prompt ({longest} tokens) fills the "
                                  f"model's context of {context} tokens", name)
        params = replace(call.params, max_tokens=max_tokens)
        # Scoring only (max_tokens 0, echo): checked as one token more in one more place.
        checked, room = (params, context) if max_tokens else \
            (replace(params, max_tokens=1), context and context + 1)
        for prompt in prompts:
            try:
                validate.check_sample(prompt, call.n, checked, self.engine.vocab_size, room)
            except validate.RequestError as exc:
                message = str(exc).replace("SamplingParams.", "")
                param = message.split(":")[0].split()[0]
                param = {"prompt": name, "num_samples": "n"}.get(param, param)
                raise OpenAIError(400, message, param) from None
        kind = "chatcmpl" if chat else "cmpl"
        return Job(call, prompts, params, chat, f"{kind}-{uuid.uuid4().hex[:24]}",
                   int(time.time()))

    # ------------------------------------------------------------------ sampling

    async def _answer(self, job: Job, target: Target, request: Request) -> Response:
        """Sample the job and answer it (streamed or whole). Once its client is gone (the
        connection closed: noticed at once) its completions leave the decode batch at the
        next step."""
        n = job.call.n
        try:
            taken = self.service.backlog.take(owed([len(p) for p in job.prompts], n,
                                                   job.params.max_tokens))
        except ApiError as exc:
            await self.catalog.release(target)
            raise OpenAIError(429, exc.message, code="rate_limit_exceeded") from None
        cancel = self.service.running.start(job.rid, "")  # also set when the server stops
        if job.call.stream:
            events = openai_stream.Events(job, self.tok, cancel, self.seeding)
            futures = self._sample(job, target, cancel, taken, events.hook)
            events.watch(futures)
            return StreamingResponse(events.sse(), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})
        futures = self._sample(job, target, cancel, taken)
        done = await _unless_gone(asyncio.gather(*futures, return_exceptions=True), request)
        if done is None:
            cancel.set()
            log.info("%s: its client is gone; its sampling stops", job.rid)
            return Response(status_code=499)  # nobody reads it
        failed = next((r for r in done if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
        results: list[SampleResult] = list(done)
        stops = job.params.stop_strings
        choices = [openai_reply.choice(p * n + j, c, self.tok, stops)
                   for p, r in enumerate(results) for j, c in enumerate(r.sequences)]
        if job.call.echo:
            echoes = [self._echo(job, p, r) for p, r in enumerate(results)]
            choices = [openai_reply.echoed(c, echoes[c.index // n]) for c in choices]
        body = openai_reply.chat_body if job.chat else openai_reply.completion_body
        return JSONResponse(body(job.rid, job.created, job.call.model, choices, self.tok,
                                 job.call.logprobs, sum(len(p) for p in job.prompts),
                                 self.seeding))

    def _sample(self, job: Job, target: Target, cancel: threading.Event, taken: int,
                hook: Callable[[int], Callable] | None = None) -> list[asyncio.Future]:
        """One engine call per prompt, as the Tinker route makes it, on the service's pool;
        once every call is over the backlog is given back and a snapshot loaded for this
        request dropped."""
        loop = asyncio.get_running_loop()
        futures = []
        for p, prompt in enumerate(job.prompts):
            extra = {} if hook is None else {"on_token": hook(p)}
            work = functools.partial(self._one, target.snap, prompt, job, cancel, extra)
            futures.append(loop.run_in_executor(self.service.pool, work))
        self._keep(loop.create_task(self._release_after(futures, job.rid, target, taken)))
        return futures

    def _one(self, snap: Any, prompt: list[int], job: Job, cancel: threading.Event,
             extra: dict) -> SampleResult:
        """One prompt's engine call (in a worker thread): its completions and, for `echo`
        with log-probs, its own log-probs and alternatives (the Tinker route's prompt
        log-probs, at temperature 1)."""
        scored = job.call.echo and job.call.logprobs
        if not job.params.max_tokens:  # echo alone: the prompt scored, nothing sampled
            empty = Completion([], [], "length", [] if job.call.top_logprobs else None)
            result = SampleResult([empty] * job.call.n, self.engine.prompt_logprobs(
                snap, prompt) if scored else None)
        else:
            result = self.engine.sample(snap, prompt, job.call.n, job.params, scored, cancel,
                                        **extra)
        if scored and job.call.top_logprobs:
            result.prompt_top = self.engine.prompt_alternatives(snap, prompt,
                                                                job.call.top_logprobs)
        return result

    def _echo(self, job: Job, p: int, result: SampleResult) -> openai_reply.Echo:
        """Prompt `p` as `echo` shows it: its text as sent (token ids decoded), and where
        log-probs were asked for, each token's, the first None. An alternative that is the
        prompt's own token carries the token's own number (one log-prob for one token)."""
        given, tokens = job.call.prompts[p], job.prompts[p]
        text = given if isinstance(given, str) else self.tok.decode(tokens)
        if result.prompt_logprobs is None:
            return openai_reply.Echo(text, tokens, [None] * len(tokens), None)
        logprobs = [None, *result.prompt_logprobs[1:]]
        top = None
        if result.prompt_top is not None:
            top = [None if row is None else [(t, logprobs[i] if t == tokens[i] else v)
                                             for t, v in row]
                   for i, row in enumerate(result.prompt_top)]
        return openai_reply.Echo(text, tokens, logprobs, top)

    async def _release_after(self, futures: list[asyncio.Future], rid: str, target: Target,
                             taken: int) -> None:
        await asyncio.gather(*futures, return_exceptions=True)
        self.service.running.finish(rid)
        self.service.backlog.give_back(taken)
        await self.catalog.release(target)

    def _keep(self, task: asyncio.Task) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
