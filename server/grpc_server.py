"""The gRPC transport: quantserve.v1.Inference over grpc.aio, with the standard health service and reflection.

Handlers only convert (proto <-> SamplingParams / events) and call the Service. One interceptor checks the API
key and maps every exception to a status code through ``server.service.classify``. A client that cancels or
whose deadline passes cancels the request in the engine: grpc.aio cancels the handler's task, and leaving
``Service.run`` early cancels the request and frees its KV blocks.
"""

from __future__ import annotations

import logging

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from quantserve.client.types import (
    SAMPLING_TYPES,  # the one list of sampling controls (stdlib only)
)
from quantserve.v1 import inference_pb2 as pb
from quantserve.v1 import inference_pb2_grpc as pb_grpc

from server.capacity import Shape
from server.outputs import Accounting, Event, RequestError, TokenLogprob, TraceStep
from server.sampling import TRACE_STAGES, TRACE_STATS
from server.sampling_params import SamplingParams
from server.service import Service, classify

log = logging.getLogger("quantserve.grpc")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
_OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # probes and discovery need no key


# ---------------------------------------------------------------------------------------- conversion

def params_from_proto(s: pb.SamplingParameters, default_max_new_tokens: int) -> SamplingParams:
    """The controls set in ``s``; an unset one is the engine's default."""
    kw = {}
    for name, kind in SAMPLING_TYPES.items():
        if kind is tuple:  # a repeated field (stop): empty is its default
            kw[name] = tuple(getattr(s, name))
        elif kind is dict:  # a map (logit_bias): empty is its default
            kw[name] = dict(getattr(s, name))
        elif s.HasField(name):
            kw[name] = getattr(s, name)
    kw.setdefault("max_new_tokens", default_max_new_tokens)
    return SamplingParams(**kw)


async def prompt_from_proto(svc: Service, req: pb.GenerateRequest) -> str | list[int]:
    given = [n for n in ("prompt", "prompt_ids", "messages") if getattr(req, n)]
    if len(given) > 1:
        raise RequestError(given[1], f"give one of prompt, prompt_ids or messages, not {' and '.join(given)}")
    if req.messages:
        return await svc.chat_prompt([{"role": m.role, "content": m.content} for m in req.messages])
    return req.prompt if req.prompt else list(req.prompt_ids)


def _candidates(svc: Service, pairs, field: str) -> list[pb.Candidate]:
    return [pb.Candidate(token_id=i, token=svc.token_text(i), **{field: v}) for i, v in pairs]


def _logprobs(svc: Service, lps: tuple[TokenLogprob, ...]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, token=svc.token_text(lp.token_id), logprob=lp.logprob,
                            top=_candidates(svc, lp.top, "logprob")) for lp in lps]


def _trace(svc: Service, steps: tuple[TraceStep, ...]) -> list[pb.TraceStep]:
    return [pb.TraceStep(**{f"after_{k}": _candidates(svc, getattr(t, k), "prob") for k in TRACE_STAGES},
                         **{k: getattr(t, k) for k in TRACE_STATS},
                         **({} if t.draft is None else {"draft_token_id": t.draft,
                                                        "draft_token": svc.token_text(t.draft)}))
            for t in steps]


def accounting_to_proto(a: Accounting) -> pb.MemoryAccounting:
    e = a.engine
    return pb.MemoryAccounting(
        kv_bytes_per_token=a.kv_bytes_per_token, kv_blocks_reserved=a.kv_blocks_reserved,
        kv_bytes_reserved=a.kv_bytes_reserved, kv_bytes_used=a.kv_bytes_used,
        activation_peak_bytes=a.activation_peak_bytes, attention=a.attention, engine=totals_to_proto(e),
        kv_bytes_shared=a.kv_bytes_shared, kv_bytes_own=a.kv_bytes_own, prompt_tokens_cached=a.prompt_tokens_cached,
        kv_dtype=a.kv_dtype, preemptions=a.preemptions, recomputed_tokens=a.recomputed_tokens,
        speculated_tokens=a.speculated_tokens, accepted_tokens=a.accepted_tokens,
        kv_bytes_speculative=a.kv_bytes_speculative, kv_bytes_draft=a.kv_bytes_draft,
    )


def totals_to_proto(e) -> pb.EngineMemory:
    return pb.EngineMemory(weight_bytes=e.weight_bytes, kv_capacity_bytes=e.kv_capacity_bytes,
                           kv_used_bytes=e.kv_used_bytes, kv_block_size=e.kv_block_size, running=e.running,
                           queued=e.queued, kv_cached_bytes=e.kv_cached_bytes, prefix_cache=e.prefix_cache,
                           prefix_hit_tokens=e.prefix_hit_tokens, prefix_queried_tokens=e.prefix_queried_tokens,
                           prefix_evictions=e.prefix_evictions, preemptions=e.preemptions,
                           recomputed_tokens=e.recomputed_tokens, speculated_tokens=e.speculated_tokens,
                           accepted_tokens=e.accepted_tokens, draft_weight_bytes=e.draft_weight_bytes,
                           draft_kv_capacity_bytes=e.draft_kv_capacity_bytes)


def final_to_proto(ev) -> pb.Final:
    a = ev.accounting
    return pb.Final(
        finish_reason=ev.finish_reason or "", stop=ev.stop or "", seed=ev.seed,
        usage=pb.Usage(prompt_tokens=a.prompt_tokens if a else 0, completion_tokens=a.generated_tokens if a else 0,
                       cached_tokens=a.prompt_tokens_cached if a else 0),
        memory=accounting_to_proto(a) if a else None, ttft_s=ev.ttft_s or 0.0, duration_s=ev.duration_s or 0.0,
    )


def _n(request) -> int:
    """GenerateRequest.n: 1 when unset; the engine checks the value (an explicit 0 is refused, naming n)."""
    return request.n if request.HasField("n") else 1


# ---------------------------------------------------------------------------------------- service

class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, service: Service):
        self.svc = service

    async def Generate(self, request, context):
        params = params_from_proto(request.sampling, self.svc.default_max_new_tokens)
        prompt = await prompt_from_proto(self.svc, request)
        cs = await self.svc.complete_n(prompt, params, "grpc", request.request_id or None, _n(request))
        choices = [pb.Choice(index=i, text=c.text, token_ids=c.token_ids, logprobs=_logprobs(self.svc, c.logprobs),
                             trace=_trace(self.svc, c.trace), final=final_to_proto(c),
                             prompt_logprobs=_logprobs(self.svc, c.prompt_logprobs)) for i, c in enumerate(cs)]
        first = choices[0]
        return pb.GenerateResponse(request_id=cs[0].request_id, text=first.text, token_ids=first.token_ids,
                                   logprobs=first.logprobs, trace=first.trace, final=first.final, choices=choices,
                                   prompt_logprobs=first.prompt_logprobs)

    async def GenerateStream(self, request, context):
        params = params_from_proto(request.sampling, self.svc.default_max_new_tokens)
        ev: Event
        prompt = await prompt_from_proto(self.svc, request)
        async for ev in self.svc.run(prompt, params, "grpc", request.request_id or None, _n(request)):
            yield pb.GenerateStreamResponse(
                request_id=ev.request_id, seed=ev.seed, text=ev.text, token_ids=ev.token_ids,
                logprobs=_logprobs(self.svc, ev.logprobs), trace=_trace(self.svc, ev.trace),
                final=final_to_proto(ev) if ev.finished else None, index=ev.index,
                prompt_logprobs=_logprobs(self.svc, ev.prompt_logprobs),
            )

    async def Tokenize(self, request, context):
        ids, tokens = await self.svc.tokenize(request.text)
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens)

    async def Plan(self, request, context):
        shapes = [Shape(r.prompt_tokens, r.max_new_tokens, r.count if r.HasField("count") else 1,
                        r.n if r.HasField("n") else 1, r.expected_new_tokens) for r in request.requests]
        return json_format.ParseDict(await self.svc.plan(shapes), pb.PlanResponse())

    async def ModelInfo(self, request, context):
        i = self.svc.info()
        return pb.ModelInfoResponse(
            model=i["model"], scheme=i["scheme"], dtype=i["dtype"], device=i["device"], attention=i["attention"],
            context_length=i["context_length"], vocab_size=i["vocab_size"],
            kv_bytes_per_token=i["kv_bytes_per_token"], memory=pb.EngineMemory(**i["memory"]),
            glue_ops=i["glue_ops"], embeddings=i["embeddings"], kernels=i["kernels"], max_new_tokens_limit=i["max_new_tokens_limit"],
            max_prompt_tokens=i["max_prompt_tokens"], speculation=i["speculation"],
        )


class ErrorsAndAuth(grpc.aio.ServerInterceptor):
    """API key check and the one exception -> status mapping for every Inference method."""

    def __init__(self, service: Service):
        self.svc = service

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_METHODS):
            return handler
        md = {k.lower(): v for k, v in (details.invocation_metadata or ())}
        svc = self.svc

        async def fail(context, exc: BaseException):
            kind = classify(exc)
            if kind.param:  # the parameter by name, for clients that act on it (HTTP has error.param)
                context.set_trailing_metadata((("quantserve-param", kind.param),))
            await context.abort(getattr(grpc.StatusCode, kind.grpc_code), kind.message)

        deserialize = handler.request_deserializer

        def checked(raw: bytes):
            """Auth, drain, then the message: parsed here, not by grpc, so corrupt bytes are INVALID_ARGUMENT
            (grpc's own deserializer failure is UNKNOWN with a traceback in the log)."""
            svc.check_auth(md.get("authorization"))
            svc.check_accepting()
            try:
                return deserialize(raw)
            except DecodeError as e:
                raise RequestError("request", f"malformed {details.method.rsplit('/', 1)[-1]} message: {e}") from e

        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(raw, context):
                try:
                    return await inner(checked(raw), context)
                except Exception as e:  # noqa: BLE001 - mapped to a status in one place
                    await fail(context, e)

            return grpc.unary_unary_rpc_method_handler(unary, None, handler.response_serializer)
        if handler.unary_stream:
            inner_s = handler.unary_stream

            async def stream(raw, context):
                try:
                    async for msg in inner_s(checked(raw), context):
                        yield msg
                except Exception as e:  # noqa: BLE001
                    await fail(context, e)

            return grpc.unary_stream_rpc_method_handler(stream, None, handler.response_serializer)
        return handler


async def start(service: Service, host: str, port: int, tls: tuple[bytes, bytes] | None = None
                ) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """Start the gRPC server; returns (server, health servicer, bound port)."""
    limit = service.limits.max_request_bytes
    server = grpc.aio.server(interceptors=[ErrorsAndAuth(service)], options=[
        ("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", 64 * 2**20),
        ("grpc.so_reuseport", 0),
    ])
    pb_grpc.add_InferenceServicer_to_server(InferenceServicer(service), server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    addr = f"{host}:{port}"
    if tls is not None:
        key, cert = tls
        bound = server.add_secure_port(addr, grpc.ssl_server_credentials([(key, cert)]))
    else:
        bound = server.add_insecure_port(addr)
    await server.start()
    for name in ("", SERVICE_NAME):
        await hs.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, hs, bound


async def set_not_serving(hs: health.aio.HealthServicer) -> None:
    for name in ("", SERVICE_NAME):
        await hs.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
