"""`stream: true`: a request's tokens as server-sent events, as the OpenAI API sends them.

The engine calls the request's token hook from its decoding thread for every token drawn;
the hook hands it to the event loop, where each choice's `TextStream` turns tokens into the
text that is safe to send. When an engine call returns, its completions are final: the rest
of each choice's text and its finish_reason follow, then usage (when
`stream_options.include_usage`) and `data: [DONE]`. An error after the stream began is one
`data: {"error": ...}` event, which the openai SDK raises.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from retrain.serve.engine import EngineError, SampleResult
from retrain.serve.openai import reply as openai_reply
from retrain.serve.openai.reply import Choice, TextStream, Tokens
from retrain.serve.openai.wire import Job, OpenAIError

log = logging.getLogger("retrain.serve")
DONE = "data: [DONE]\n\n"


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class Events:
    """One streamed request: the queue its engine calls feed, and the events it sends."""

    def __init__(self, job: Job, tok: Tokens, cancel: threading.Event, meta: dict):
        self.job = job
        self.meta = meta  # system_fingerprint and seed_batch_invariant (openai_reply.seeding)
        self.cancel = cancel  # set when the stream ends before its last event (client gone)
        self.tok = tok
        self.n = job.call.n
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple] = asyncio.Queue()
        total = len(job.prompts) * self.n
        self.streams = [TextStream(tok, job.params.stop_strings) for _ in range(total)]
        self.offsets = [0] * total  # completions: where each choice's next token starts

    def hook(self, prompt_index: int) -> Callable[[int, int, float, Any], None]:
        """The engine's `on_token` for one prompt (runs in the decoding thread)."""
        def on_token(i: int, token: int, logprob: float, top: Any) -> None:
            if self.cancel.is_set() or self.loop.is_closed():  # nobody to tell any more
                return
            self.loop.call_soon_threadsafe(
                self.queue.put_nowait, ("token", prompt_index * self.n + i, token, logprob, top))
        return on_token

    def watch(self, futures: list[asyncio.Future]) -> None:
        """Queue each engine call's end behind the tokens it drew."""
        for p, future in enumerate(futures):
            future.add_done_callback(lambda f, p=p: self.queue.put_nowait(("done", p, f)))

    async def sse(self) -> AsyncIterator[str]:
        """The events; when the client hangs up, Starlette cancels this generator (it listens
        for the disconnect), and the request's completions leave the decode batch."""
        finished = False
        try:
            async for event in self._events():
                yield event
                # Let the loop run between two events: tokens already queued would otherwise
                # be written in one go, past a closed connection (asyncio logs each such write
                # as `socket.send() raised exception`) before the disconnect is heard.
                await asyncio.sleep(0)
            finished = True
        finally:
            if not finished:
                self.cancel.set()
                log.info("%s: the stream's client is gone; its sampling stops", self.job.rid)

    async def _events(self) -> AsyncIterator[str]:
        if self.job.chat:
            for i in range(len(self.streams)):
                yield _data(self._chunk(i, {"role": "assistant", "content": ""}))
        pending, choices = len(self.job.prompts), []
        while pending:
            kind, *rest = await self.queue.get()
            if kind == "token":
                chunk = self._token(*rest)
                if chunk is not None:
                    yield _data(chunk)
                continue
            pending -= 1
            prompt_index, future = rest
            error = _error(future)
            if error is not None:
                yield _data(error.body())
                return
            for chunk in self._finish(prompt_index, future.result(), choices):
                yield _data(chunk)
        if self.job.call.include_usage:
            yield _data({**self._chunk(None, {}), "choices": [],
                         "usage": openai_reply.usage(sum(len(p) for p in self.job.prompts),
                                                     choices)})
        yield DONE

    def _token(self, index: int, token: int, logprob: float, top: Any) -> dict | None:
        if token in self.tok.end_ids:
            return None
        text = self.streams[index].push(token)
        logprobs = None
        if self.job.call.logprobs:
            tops = [top] if top is not None else None
            if self.job.chat:
                logprobs = openai_reply.chat_logprobs(self.tok, [token], [logprob], tops)
            else:
                logprobs = openai_reply.completion_logprobs(self.tok, [token], [logprob], tops,
                                                            self.offsets[index])
                self.offsets[index] += len(self.tok.piece(token))
        if not text and logprobs is None:
            return None
        return self._chunk(index, {"content": text} if self.job.chat else text, logprobs)

    def _finish(self, prompt_index: int, result: SampleResult, choices: list[Choice]):
        for j, completion in enumerate(result.sequences):
            index = prompt_index * self.n + j
            choice = openai_reply.choice(index, completion, self.tok,
                                         self.job.params.stop_strings)
            choices.append(choice)
            rest = self.streams[index].finish(choice.text)
            if rest:
                yield self._chunk(index, {"content": rest} if self.job.chat else rest)
            yield self._chunk(index, {} if self.job.chat else "", None, choice.finish_reason)

    def _chunk(self, index: int | None, delta: dict | str, logprobs: dict | None = None,
               finish_reason: str | None = None) -> dict:
        job = self.job
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs,
                                  "finish_reason": finish_reason}
        choice["delta" if job.chat else "text"] = delta
        chunk = {"id": job.rid, "object": "chat.completion.chunk" if job.chat
                 else "text_completion", "created": job.created, "model": job.call.model,
                 **self.meta, "choices": [choice]}
        if job.call.include_usage:
            chunk["usage"] = None
        return chunk


def _error(future: asyncio.Future) -> OpenAIError | None:
    """The engine call's failure as an OpenAI error, or None when it succeeded."""
    if future.cancelled():
        return OpenAIError(500, "the request was cancelled", kind="server_error")
    exc = future.exception()
    if exc is None:
        return None
    if isinstance(exc, EngineError):
        return OpenAIError(400, str(exc))
    log.error("streamed request failed: %s: %s", type(exc).__name__, exc)
    return OpenAIError(500, f"server error: {type(exc).__name__}: {exc}", kind="server_error")
