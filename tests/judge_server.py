"""A tiny OpenAI-compatible judge for the tests: a real HTTP server (starlette + uvicorn on
127.0.0.1, in a thread) answering /v1/chat/completions with scores the test controls, counting
requests and the most in flight at once, and able to answer 429, garbage or nothing.

It stands in for a remote LLM judge, which cannot run here. The test rubric wraps the
completion(s) in << >>; a pointwise score is (length of that text mod 5) / 4, group scores
((i + length) mod 5) / 4 for reply i — varied, so the advantages are not all zero.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

RUBRIC = "Question: {prompt}\nReference: {answer}\nReply: <<{completion}>>"


def pointwise_score(block: str) -> float:
    return (len(block) % 5) / 4


def group_scores(block: str, n: int) -> list[float]:
    return [((i + len(block)) % 5) / 4 for i in range(1, n + 1)]


class JudgeServer:
    """mode: "score" | "429" | "garbage" | "junk" (not JSON) | "hang"; `block_after` makes
    requests past that many hang (to kill a run mid-step). `models`: what /v1/models lists
    (None: it answers 404, a server without the route); a request naming another model gets
    vLLM's 404, unless `any_model` (llama.cpp's server answers whatever name it is given)."""

    def __init__(self) -> None:
        self.mode, self.delay_s, self.block_after = "score", 0.0, None
        self.models: list[str] | None = ["judge"]
        self.any_model = False
        self.closing = False
        self.auth: set[str] = set()
        self.requests, self.in_flight, self.max_in_flight = 0, 0, 0
        self.prompts: list[str] = []
        self._lock = threading.Lock()
        app = Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"]),
                                Route("/v1/models", self._models, methods=["GET"])])
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"

    async def _models(self, request: Request) -> JSONResponse:
        if self.models is None:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return JSONResponse({"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "test"}
            for m in self.models]})

    async def _chat(self, request: Request):
        body = await request.json()
        prompt = body["messages"][-1]["content"]
        with self._lock:
            self.requests += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.prompts.append(prompt)
            self.auth.add(request.headers.get("authorization", ""))
            number = self.requests
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.mode == "hang" or (self.block_after is not None
                                       and number > self.block_after):
                while not self.closing:
                    await asyncio.sleep(0.05)
            return self._answer(prompt, body)
        finally:
            with self._lock:
                self.in_flight -= 1

    def _answer(self, prompt: str, body: dict):
        if not self.any_model and body.get("model") not in (self.models or ["judge"]):
            return JSONResponse({"error": {"message": f"The model `{body.get('model')}` does "
                                           "not exist.", "type": "NotFoundError",
                                           "code": 404}}, status_code=404)
        if self.mode == "429":
            return JSONResponse({"error": {"message": "slow down"}}, status_code=429)
        if self.mode == "junk":
            return PlainTextResponse("<html>not json", status_code=200,
                                     media_type="application/json")
        if self.mode == "garbage":
            return _completion(body, "What a lovely reply! I would give it full marks.")
        if "<<" not in prompt:  # the start-up probe's one-token request
            return _completion(body, "OK")
        block = prompt.split("<<", 1)[1].rsplit(">>", 1)[0]
        many = re.search(r"There are (\d+) replies", prompt)
        if many:
            n = int(many.group(1))
            text = "\n".join(f"SCORE {i}: {s}"
                             for i, s in enumerate(group_scores(block, n), start=1))
        else:
            text = f"Fine.\nSCORE: {pointwise_score(block)}"
        return _completion(body, text)

    def close(self) -> None:
        self.closing = True
        self._server.should_exit = True
        self._thread.join(timeout=10)


def _completion(body: dict, text: str) -> JSONResponse:
    return JSONResponse({
        "id": "chatcmpl-test", "object": "chat.completion", "created": 0,
        "model": body.get("model", "judge"),
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
