"""What a long stop string costs a streamed choice per token (issue 53): `TextStream.push`
timed over a reply of `--chars` characters with one stop string of `--stop-chars`
characters that never completes, tokens of one character each (decoding is not timed: the
decode appends the new piece). `--repo` times another checkout's `TextStream` (the before
figure):

    .venv/bin/python -m bench.serve.stop_scan                   # this checkout
    .venv/bin/python -m bench.serve.stop_scan --repo /tmp/old   # e.g. `git archive` of before
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time


def _stream_class(repo: str | None):
    if repo:
        sys.path.insert(0, repo)
        for name in [m for m in sys.modules if m == "retrain" or m.startswith("retrain.")]:
            del sys.modules[name]
    reply = importlib.import_module("retrain.serve.openai.reply")
    return reply.TextStream, reply.Tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chars", type=int, default=4000)
    ap.add_argument("--stop-chars", type=int, default=4000)
    ap.add_argument("--repo", default=None)
    args = ap.parse_args()
    TextStream, Tokens = _stream_class(args.repo)
    pieces, text = "ab x", [""]

    def decode(ids: list[int]) -> str:  # one piece more than last time: not the whole join
        text[0] += pieces[ids[-1]]
        return text[0]

    tok = Tokens(decode=decode, piece=pieces.__getitem__, end_ids=frozenset())
    stream = TextStream(tok, ("x" * (args.stop_chars - 1) + "!",))
    marks = {args.chars // 4, args.chars // 2, args.chars}
    t0, last = time.perf_counter(), 0
    for n in range(1, args.chars + 1):
        stream.push(n % 4)
        if n in marks:
            now = time.perf_counter()
            print(f"tokens {last + 1}-{n}: {1e6 * (now - t0) / (n - last):.0f} us a token")
            t0, last = now, n


if __name__ == "__main__":
    main()
