"""Tinker wire formats <-> the backend datatypes: protobuf for forward_backward and samples,
and the SDK's prompt and sampling parameters of a sample request.

Uses the message classes of the pinned SDK (`tinker.proto.tinker_public_pb2`), so the
server speaks exactly the schema the client was built with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from retrain.algorithms import losses
from retrain.backends.base import Datum, LossOutput, SamplingParams
from retrain.serve.engine import LOSS_INPUTS, EngineError, SampleResult
from retrain.serve.errors import ApiError

# what a Datum holds
READ_INPUTS = ("target_tokens", "logprobs", "advantages", "weights", "sequence_ratio_mask")
PER_DATUM_CONFIG = ("clip_low_threshold", "clip_high_threshold")  # the SDK's dtype map has them
_DTYPES = {
    pb.DTYPE_FLOAT32: np.float32,
    pb.DTYPE_INT64: np.int64,
    pb.DTYPE_INT32: np.int32,
}


@dataclass
class FwdBwdCall:
    """A decoded ForwardBackwardRequest."""

    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float]
    forward_only: bool
    data: list[Datum]


class BadCall(EngineError):
    """A ForwardBackwardRequest refused; `model_id` and `seq_id` are its own once the
    message could be parsed (so that its place in the model's order can be completed)."""

    def __init__(self, message: str, model_id: str | None = None, seq_id: int | None = None):
        super().__init__(message)
        self.model_id = model_id
        self.seq_id = seq_id


def decode_forward_backward(body: bytes) -> FwdBwdCall:
    """Parse a protobuf ForwardBackwardRequest; BadCall names what is unsupported."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # protobuf raises DecodeError and friends
        raise BadCall(f"forward_backward body is not a ForwardBackwardRequest: {exc}") from None
    try:
        return _call(msg)
    except EngineError as exc:
        raise BadCall(str(exc), msg.model_id, int(msg.seq_id)) from None


def _call(msg: pb.ForwardBackwardRequest) -> FwdBwdCall:
    if msg.loss_fn not in LOSS_INPUTS:
        raise EngineError(f"retrain serve: {losses.unknown_loss(msg.loss_fn)} (it computes "
                          f"{', '.join(LOSS_INPUTS)}; forward_backward_custom with a Python "
                          "function runs on the client and works)")
    config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():  # servers prefer v2 (SDK note)
        if value.WhichOneof("value") != "number":
            raise EngineError(f"loss_fn_config[{key!r}]: only numbers are read by loss "
                              f"{msg.loss_fn!r}")
        config[key] = float(value.number)
    problem = losses.wire_config_problem(msg.loss_fn, config)
    if problem:
        raise EngineError(problem)
    data = [_decode_datum(d, i, msg.loss_fn, msg.forward_only) for i, d in enumerate(msg.data)]
    return FwdBwdCall(msg.model_id, int(msg.seq_id), msg.loss_fn, config,
                      bool(msg.forward_only), data)


def _decode_datum(d: pb.Datum, index: int, loss_fn: str, forward_only: bool) -> Datum:
    tokens: list[int] = []
    for chunk in d.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise EngineError(f"datum {index}: only text chunks are supported by retrain serve")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise EngineError(f"datum {index}: encoded_text tokens are {len(raw)} bytes, not "
                              "a whole number of int32 values")
        tokens.extend(np.frombuffer(raw, dtype=np.int32).tolist())
    inputs = {name: _decode_tensor(t, f"datum {index}: {name}") for name, t in
              d.loss_fn_inputs.items()}
    needed = LOSS_INPUTS[loss_fn] if not forward_only else ("target_tokens",)
    for name in needed:
        if name not in inputs:
            raise EngineError(f"datum {index}: loss_fn {loss_fn!r} needs loss_fn_inputs[{name!r}]")
    for name in PER_DATUM_CONFIG:
        if name in inputs:
            raise EngineError(f"datum {index}: loss_fn_inputs[{name!r}]: per-datum clip "
                              "thresholds are not supported by retrain serve; pass them in "
                              "loss_fn_config")
    for name in READ_INPUTS:
        if name in inputs and len(inputs[name]) != len(tokens):
            raise EngineError(f"datum {index}: {name} has {len(inputs[name])} entries for "
                              f"{len(tokens)} input tokens; they must align")
    return _datum(tokens, inputs)


def _datum(tokens: list[int], inputs: dict[str, np.ndarray]) -> Datum:
    """The client's loss inputs as a Datum: inputs a loss does not read are zeros."""
    def floats(name: str) -> list[float]:
        return inputs[name].astype(float).tolist() if name in inputs else [0.0] * len(tokens)

    targets = inputs["target_tokens"].astype(int).tolist()  # every loss needs them
    def optional(name: str) -> list[float] | None:
        return inputs[name].astype(float).tolist() if name in inputs else None

    return Datum(input_tokens=tokens, target_tokens=targets, logprobs=floats("logprobs"),
                 advantages=floats("advantages"), mask=[1.0] * len(tokens),
                 weights=optional("weights"), ratio_mask=optional("sequence_ratio_mask"))


def _decode_tensor(t: pb.Tensor, where: str) -> np.ndarray:
    if t.WhichOneof("encoding") != "dense":
        raise EngineError(f"{where}: sparse tensors are not supported by retrain serve")
    if t.dtype not in _DTYPES:
        raise EngineError(f"{where}: unsupported dtype {t.dtype}")
    if len(t.shape) > 1:
        raise EngineError(f"{where}: only 1-D loss inputs are supported, got shape {list(t.shape)}")
    dtype = np.dtype(_DTYPES[t.dtype])
    if len(t.dense) % dtype.itemsize:
        raise EngineError(f"{where}: {len(t.dense)} bytes are not a whole number of "
                          f"{dtype.name} values")
    values = np.frombuffer(t.dense, dtype=dtype).copy()
    if len(t.shape) == 1 and t.shape[0] != len(values):
        raise EngineError(f"{where}: shape {list(t.shape)} but {len(values)} values")
    return values


def encode_forward_backward(result: LossOutput) -> bytes:
    """ForwardBackwardOutput: one ArrayRecord with each datum's target `logprobs`; the
    loss (a sum, Tinker's semantics) as the metric "loss:sum"."""
    arrays = [np.asarray(a, dtype=np.float32).reshape(-1) for a in result.logprobs]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([a.nbytes for a in arrays])
    record = pb.ArrayRecord(num_datums=len(arrays))
    field = record.fields["logprobs"]
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = offsets.tobytes()
    field.dtype = pb.DTYPE_FLOAT32
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    out.loss_fn_outputs.append(record)
    for key, value in {"loss:sum": result.loss, **result.metrics}.items():
        out.metrics[key] = float(value)
    return out.SerializeToString()


def encode_sample(result: SampleResult) -> bytes:
    """SampleResponse: tokens as int32, log-probs as float32, little-endian."""
    out = pb.SampleResponse()
    for seq in result.sequences:
        out.sequences.append(pb.SampledSequence(
            stop_reason=pb.STOP_REASON_STOP if seq.finish_reason == "stop"
            else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes(),
        ))
    if result.prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in result.prompt_logprobs]
        out.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return out.SerializeToString()


def prompt_tokens(prompt: types.ModelInput) -> list[int]:
    """The tokens of a sample request's prompt (text chunks only)."""
    tokens: list[int] = []
    for chunk in prompt.chunks:
        if not isinstance(chunk, types.EncodedTextChunk):
            raise ApiError(400, "retrain serve samples from text prompts only "
                           "(encoded_text chunks)")
        tokens.extend(chunk.tokens)
    if not tokens:
        raise ApiError(400, "the prompt is empty")
    return tokens


def sampling_params(p: types.SamplingParams) -> SamplingParams:
    """The SDK's SamplingParams as the backend's (stop: token ids and strings, split)."""
    raw = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
    stop_tokens = tuple(s for s in raw if isinstance(s, int))
    stop_strings = tuple(s for s in raw if isinstance(s, str) and s)
    if p.max_tokens is None:
        raise ApiError(400, "SamplingParams.max_tokens must be set (>= 1)")
    return SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                          top_k=p.top_k, seed=p.seed, stop_tokens=stop_tokens,
                          stop_strings=stop_strings)
