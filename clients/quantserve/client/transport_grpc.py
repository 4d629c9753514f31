"""The gRPC transport: quantserve.v1.Inference through the committed stubs, sync and asyncio.

Conversion (typed request -> proto, proto -> typed result) is shared by both; the two classes differ only in
how they wait. Every grpc.RpcError leaves as a :class:`ClientError` (errors.from_grpc).
"""

from __future__ import annotations

import dataclasses
from typing import AsyncIterator, Iterator

import grpc
from google.protobuf import json_format

from quantserve.client.errors import INVALID_ARGUMENT, ClientError, from_grpc
from quantserve.client.types import (Alternative, Candidate, EngineMemory, MemoryAccounting, ModelInfo, Options, Plan,
                                     Request, RequestShape, Result, StreamChunk, TokenLogprob, Tokens, TRACE_CONTROLS,
                                     TRACE_STAGES, TraceStep, Usage, _Joined, plan_from_dict)
from quantserve.v1 import inference_pb2 as pb
from quantserve.v1 import inference_pb2_grpc as pb_grpc

# The server sends up to 64 MiB (a long generation with trace=50 is large); grpc's default receive limit is 4.
# round_robin: a target that resolves to several servers (dns:///quantserve-headless...:50051 in Kubernetes)
# gets its calls spread over all of them; with one address it behaves as the default pick_first.
_CHANNEL_OPTIONS = (("grpc.max_receive_message_length", 64 * 2**20), ("grpc.lb_policy_name", "round_robin"))

# ------------------------------------------------------------------------------------------ conversion


def request_to_proto(req: Request) -> pb.GenerateRequest:
    s = pb.SamplingParameters()
    for name, value in req.sampling.given().items():
        try:
            if name == "stop":
                s.stop.extend(value)
            elif name == "logit_bias":  # a map field
                s.logit_bias.update(value)
            else:
                setattr(s, name, value)
        except (TypeError, ValueError) as e:  # wrong type / out of int64: the proto refuses it here
            raise ClientError(INVALID_ARGUMENT, f"{name}: {e}", name) from None
    out = pb.GenerateRequest(sampling=s, request_id=req.request_id or "")
    if req.n != 1:
        try:
            out.n = req.n
        except (TypeError, ValueError) as e:
            raise ClientError(INVALID_ARGUMENT, f"n: {e}", "n") from None
    if req.messages is not None:
        out.messages.extend(pb.ChatMessage(role=m.role, content=m.content) for m in req.messages)
    elif req.prompt_ids is not None:
        try:
            out.prompt_ids.extend(req.prompt_ids)
        except (TypeError, ValueError) as e:
            raise ClientError(INVALID_ARGUMENT, f"prompt_ids: {e}", "prompt_ids") from None
    else:
        out.prompt = req.prompt or ""
    return out


def _engine(e: pb.EngineMemory) -> EngineMemory:
    return EngineMemory(weight_bytes=e.weight_bytes, kv_capacity_bytes=e.kv_capacity_bytes,
                        kv_used_bytes=e.kv_used_bytes, kv_block_size=e.kv_block_size, running=e.running,
                        queued=e.queued, kv_cached_bytes=e.kv_cached_bytes, prefix_cache=e.prefix_cache,
                        prefix_hit_tokens=e.prefix_hit_tokens, prefix_queried_tokens=e.prefix_queried_tokens,
                        prefix_evictions=e.prefix_evictions, preemptions=e.preemptions,
                        recomputed_tokens=e.recomputed_tokens, speculated_tokens=e.speculated_tokens,
                        accepted_tokens=e.accepted_tokens, draft_weight_bytes=e.draft_weight_bytes,
                        draft_kv_capacity_bytes=e.draft_kv_capacity_bytes)


def _memory(m: pb.MemoryAccounting) -> MemoryAccounting:
    return MemoryAccounting(kv_bytes_per_token=m.kv_bytes_per_token, kv_blocks_reserved=m.kv_blocks_reserved,
                            kv_bytes_reserved=m.kv_bytes_reserved, kv_bytes_used=m.kv_bytes_used,
                            activation_peak_bytes=m.activation_peak_bytes, attention=m.attention,
                            engine=_engine(m.engine) if m.HasField("engine") else None,
                            kv_bytes_shared=m.kv_bytes_shared, kv_bytes_own=m.kv_bytes_own,
                            prompt_tokens_cached=m.prompt_tokens_cached, kv_dtype=m.kv_dtype,
                            preemptions=m.preemptions, recomputed_tokens=m.recomputed_tokens,
                            speculated_tokens=m.speculated_tokens, accepted_tokens=m.accepted_tokens,
                            kv_bytes_speculative=m.kv_bytes_speculative, kv_bytes_draft=m.kv_bytes_draft)


def _logprobs(lps) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(lp.token_id, lp.token, lp.logprob,
                              tuple(Alternative(c.token_id, c.token, c.logprob) for c in lp.top)) for lp in lps)


def _trace(steps) -> tuple[TraceStep, ...]:
    def cands(cs) -> tuple[Candidate, ...]:
        return tuple(Candidate(c.token_id, c.token, c.prob) for c in cs)

    return tuple(TraceStep(**{f"after_{s}": cands(getattr(t, f"after_{s}")) for s in TRACE_STAGES},
                           **{f"{k}_{c}": getattr(t, f"{k}_{c}") for k in ("kept", "mass") for c in TRACE_CONTROLS},
                           entropy=t.entropy, draft_token_id=t.draft_token_id if t.HasField("draft_token_id") else None,
                           draft_token=t.draft_token if t.HasField("draft_token_id") else None) for t in steps)


def _final(request_id: str, f: pb.Final) -> dict:
    """Result fields that come from the proto's Final (the rest come from the text / ids / lists)."""
    return dict(request_id=request_id, finish_reason=f.finish_reason, stop=f.stop or None, seed=f.seed,
                usage=Usage(f.usage.prompt_tokens, f.usage.completion_tokens, f.usage.cached_tokens),
                memory=_memory(f.memory) if f.HasField("memory") else None,
                ttft_s=f.ttft_s, duration_s=f.duration_s, transport="grpc")


def result_from_proto(r: pb.GenerateResponse) -> Result:
    samples = tuple(Result(text=c.text, token_ids=tuple(c.token_ids), logprobs=_logprobs(c.logprobs),
                           trace=_trace(c.trace), prompt_logprobs=_logprobs(c.prompt_logprobs),
                           **_final(r.request_id, c.final)) for c in r.choices)
    return Result(text=r.text, token_ids=tuple(r.token_ids), logprobs=_logprobs(r.logprobs), trace=_trace(r.trace),
                  **_final(r.request_id, r.final), samples=samples if len(samples) > 1 else (),
                  prompt_logprobs=_logprobs(r.prompt_logprobs))


def _chunk(m: pb.GenerateStreamResponse, joined: dict[int, _Joined]) -> StreamChunk:
    """A message as a chunk, joined into its sample's result (``joined``: sample index -> what arrived so far)."""
    c = StreamChunk(text=m.text, token_ids=tuple(m.token_ids), logprobs=_logprobs(m.logprobs), trace=_trace(m.trace),
                    seed=m.seed, index=m.index, prompt_logprobs=_logprobs(m.prompt_logprobs))
    j = joined.setdefault(m.index, _Joined())
    j.add(c)
    if m.HasField("final"):
        c = dataclasses.replace(c, result=j.result(**_final(m.request_id, m.final)))
    return c


def info_from_proto(i: pb.ModelInfoResponse) -> ModelInfo:
    return ModelInfo(model=i.model, scheme=i.scheme, context_length=i.context_length, dtype=i.dtype, device=i.device,
                     attention=i.attention, vocab_size=i.vocab_size, kv_bytes_per_token=i.kv_bytes_per_token,
                     glue_ops=i.glue_ops, embeddings=i.embeddings, kernels=tuple(i.kernels), max_new_tokens_limit=i.max_new_tokens_limit,
                     max_prompt_tokens=i.max_prompt_tokens, memory=_engine(i.memory), speculation=i.speculation)


def plan_to_proto(shapes: tuple[RequestShape, ...]) -> pb.PlanRequest:
    return pb.PlanRequest(requests=[pb.RequestShape(prompt_tokens=s.prompt_tokens, max_new_tokens=s.max_new_tokens,
                                                    count=s.count, n=s.n, expected_new_tokens=s.expected_new_tokens)
                                 for s in shapes])


def plan_from_proto(m: pb.PlanResponse) -> Plan:
    return plan_from_dict(json_format.MessageToDict(m, preserving_proto_field_name=True,
                                                    always_print_fields_with_no_presence=True))


def _no_final() -> ClientError:
    return ClientError("internal", "the stream ended without a final message")


# ------------------------------------------------------------------------------------------ channels


def channel(opts: Options) -> grpc.Channel:
    """A blocking channel to ``opts.target`` (TLS per ``opts``), balanced round robin."""
    creds = _credentials(opts)
    return grpc.secure_channel(opts.target, creds, _CHANNEL_OPTIONS) if creds else \
        grpc.insecure_channel(opts.target, _CHANNEL_OPTIONS)


def _credentials(opts: Options) -> grpc.ChannelCredentials | None:
    if not opts.tls:
        return None
    roots = None
    if opts.ca_file:
        with open(opts.ca_file, "rb") as f:
            roots = f.read()
    return grpc.ssl_channel_credentials(root_certificates=roots)


def _metadata(opts: Options) -> tuple[tuple[str, str], ...]:
    # ErrorsAndAuth on the server reads the lower-cased "authorization" metadata: "Bearer KEY".
    return (("authorization", f"Bearer {opts.api_key}"),) if opts.api_key else ()


class GrpcTransport:
    """Blocking gRPC calls. One channel per transport; grpc channels are thread-safe (the sweep shares one)."""

    name = "grpc"

    def __init__(self, opts: Options):
        self._channel = channel(opts)
        self._stub = pb_grpc.InferenceStub(self._channel)
        self._kw = dict(timeout=opts.timeout, metadata=_metadata(opts))

    def generate(self, req: Request) -> Result:
        msg = request_to_proto(req)
        try:
            return result_from_proto(self._stub.Generate(msg, **self._kw))
        except grpc.RpcError as e:
            raise from_grpc(e) from None

    def stream(self, req: Request) -> Iterator[StreamChunk]:
        msg = request_to_proto(req)
        call = self._stub.GenerateStream(msg, **self._kw)
        joined: dict[int, _Joined] = {}
        left = req.n  # samples whose result has not arrived
        try:
            for m in call:
                chunk = _chunk(m, joined)
                yield chunk
                left -= chunk.result is not None
                if left == 0:
                    return
            raise _no_final()
        except grpc.RpcError as e:
            raise from_grpc(e) from None
        finally:
            call.cancel()  # a caller that stops early cancels the request (and frees its KV blocks) on the server

    def tokenize(self, text: str) -> Tokens:
        try:
            r = self._stub.Tokenize(pb.TokenizeRequest(text=text), **self._kw)
        except grpc.RpcError as e:
            raise from_grpc(e) from None
        return Tokens(tuple(r.token_ids), tuple(r.tokens))

    def info(self) -> ModelInfo:
        try:
            return info_from_proto(self._stub.ModelInfo(pb.ModelInfoRequest(), **self._kw))
        except grpc.RpcError as e:
            raise from_grpc(e) from None

    def plan(self, shapes: tuple[RequestShape, ...]) -> Plan:
        try:
            return plan_from_proto(self._stub.Plan(plan_to_proto(shapes), **self._kw))
        except grpc.RpcError as e:
            raise from_grpc(e) from None

    def close(self) -> None:
        self._channel.close()


class AsyncGrpcTransport:
    """The same calls over grpc.aio (create and use it inside one running event loop)."""

    name = "grpc"

    def __init__(self, opts: Options):
        creds = _credentials(opts)
        self._channel = (grpc.aio.secure_channel(opts.target, creds, _CHANNEL_OPTIONS) if creds else
                         grpc.aio.insecure_channel(opts.target, _CHANNEL_OPTIONS))
        self._stub = pb_grpc.InferenceStub(self._channel)
        self._kw = dict(timeout=opts.timeout, metadata=_metadata(opts))

    async def generate(self, req: Request) -> Result:
        msg = request_to_proto(req)
        try:
            return result_from_proto(await self._stub.Generate(msg, **self._kw))
        except grpc.RpcError as e:
            raise from_grpc(e) from None

    async def stream(self, req: Request) -> AsyncIterator[StreamChunk]:
        msg = request_to_proto(req)
        call = self._stub.GenerateStream(msg, **self._kw)
        joined: dict[int, _Joined] = {}
        left = req.n
        try:
            async for m in call:
                chunk = _chunk(m, joined)
                yield chunk
                left -= chunk.result is not None
                if left == 0:
                    return
            raise _no_final()
        except grpc.RpcError as e:
            raise from_grpc(e) from None
        finally:
            call.cancel()

    async def tokenize(self, text: str) -> Tokens:
        try:
            r = await self._stub.Tokenize(pb.TokenizeRequest(text=text), **self._kw)
        except grpc.RpcError as e:
            raise from_grpc(e) from None
        return Tokens(tuple(r.token_ids), tuple(r.tokens))

    async def info(self) -> ModelInfo:
        try:
            return info_from_proto(await self._stub.ModelInfo(pb.ModelInfoRequest(), **self._kw))
        except grpc.RpcError as e:
            raise from_grpc(e) from None

    async def plan(self, shapes: tuple[RequestShape, ...]) -> Plan:
        try:
            return plan_from_proto(await self._stub.Plan(plan_to_proto(shapes), **self._kw))
        except grpc.RpcError as e:
            raise from_grpc(e) from None

    async def close(self) -> None:
        await self._channel.close()
