"""Request bodies sent with `Content-Encoding: zstd`, decompressed under a size cap.

The cap is on what the body inflates to, checked while streaming, so a frame that does
not declare its size is capped too: a small body can no longer inflate to gigabytes in the
server's memory (413). A body that is not whole zstd (garbage, empty, cut short) is a 400.
"""

from __future__ import annotations

import io

import zstandard

from retrain.serve.errors import ApiError

_CHUNK = 1 << 20


def inflate_zstd(body: bytes, cap: int) -> bytes:
    """The decompressed body; ApiError 413 past `cap` bytes, 400 when it is not whole zstd."""
    if not body:
        raise ApiError(400, "the zstd body is empty")
    try:
        _check_size(body, cap)
        return _whole_frames(body)
    except zstandard.ZstdError as exc:
        raise ApiError(400, f"the body is not valid zstd: {exc}") from None


def _check_size(body: bytes, cap: int) -> None:
    """Stream through every frame, keeping nothing, and stop once past `cap`."""
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body),
                                                        read_across_frames=True)
    total = 0
    while chunk := reader.read(_CHUNK):
        total += len(chunk)
        if total > cap:
            raise ApiError(413, f"request body over {cap} bytes once decompressed")


def _whole_frames(body: bytes) -> bytes:
    """Decompress frame by frame (their sizes are known to fit); a cut-short frame is a 400."""
    out: list[bytes] = []
    rest = body
    while rest:
        frame = zstandard.ZstdDecompressor().decompressobj()
        out.append(frame.decompress(rest))
        if not frame.eof:
            raise ApiError(400, "the zstd body ends inside a frame (cut short?)")
        rest = frame.unused_data
    return b"".join(out)
