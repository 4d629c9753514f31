from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParameters(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "repetition_penalty", "seed", "max_new_tokens", "min_tokens", "ignore_eos", "stop", "logprobs", "trace", "min_p", "presence_penalty", "frequency_penalty", "logit_bias", "prompt_logprobs", "response_format", "speculate")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    seed: int
    max_new_tokens: int
    min_tokens: int
    ignore_eos: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: int
    trace: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    prompt_logprobs: int
    response_format: str
    speculate: bool
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[int] = ..., trace: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_logprobs: _Optional[int] = ..., response_format: _Optional[str] = ..., speculate: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_ids", "sampling", "request_id", "messages", "n")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParameters
    request_id: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    n: int
    def __init__(self, prompt: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParameters, _Mapping]] = ..., request_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., n: _Optional[int] = ...) -> None: ...

class Candidate(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "prob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    prob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., prob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[Candidate]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ...) -> None: ...

class TraceStep(_message.Message):
    __slots__ = ("after_temperature", "after_top_k", "after_top_p", "kept_top_k", "kept_top_p", "mass_top_k", "mass_top_p", "entropy", "after_penalties", "after_min_p", "kept_min_p", "mass_min_p", "draft_token_id", "draft_token")
    AFTER_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    AFTER_TOP_K_FIELD_NUMBER: _ClassVar[int]
    AFTER_TOP_P_FIELD_NUMBER: _ClassVar[int]
    KEPT_TOP_K_FIELD_NUMBER: _ClassVar[int]
    KEPT_TOP_P_FIELD_NUMBER: _ClassVar[int]
    MASS_TOP_K_FIELD_NUMBER: _ClassVar[int]
    MASS_TOP_P_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    AFTER_PENALTIES_FIELD_NUMBER: _ClassVar[int]
    AFTER_MIN_P_FIELD_NUMBER: _ClassVar[int]
    KEPT_MIN_P_FIELD_NUMBER: _ClassVar[int]
    MASS_MIN_P_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    after_temperature: _containers.RepeatedCompositeFieldContainer[Candidate]
    after_top_k: _containers.RepeatedCompositeFieldContainer[Candidate]
    after_top_p: _containers.RepeatedCompositeFieldContainer[Candidate]
    kept_top_k: int
    kept_top_p: int
    mass_top_k: float
    mass_top_p: float
    entropy: float
    after_penalties: _containers.RepeatedCompositeFieldContainer[Candidate]
    after_min_p: _containers.RepeatedCompositeFieldContainer[Candidate]
    kept_min_p: int
    mass_min_p: float
    draft_token_id: int
    draft_token: str
    def __init__(self, after_temperature: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ..., after_top_k: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ..., after_top_p: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ..., kept_top_k: _Optional[int] = ..., kept_top_p: _Optional[int] = ..., mass_top_k: _Optional[float] = ..., mass_top_p: _Optional[float] = ..., entropy: _Optional[float] = ..., after_penalties: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ..., after_min_p: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ..., kept_min_p: _Optional[int] = ..., mass_min_p: _Optional[float] = ..., draft_token_id: _Optional[int] = ..., draft_token: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class EngineMemory(_message.Message):
    __slots__ = ("weight_bytes", "kv_capacity_bytes", "kv_used_bytes", "kv_block_size", "running", "queued", "kv_cached_bytes", "prefix_cache", "prefix_hit_tokens", "prefix_queried_tokens", "prefix_evictions", "preemptions", "recomputed_tokens", "speculated_tokens", "accepted_tokens", "draft_weight_bytes", "draft_kv_capacity_bytes")
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    KV_CACHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KV_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    weight_bytes: int
    kv_capacity_bytes: int
    kv_used_bytes: int
    kv_block_size: int
    running: int
    queued: int
    kv_cached_bytes: int
    prefix_cache: bool
    prefix_hit_tokens: int
    prefix_queried_tokens: int
    prefix_evictions: int
    preemptions: int
    recomputed_tokens: int
    speculated_tokens: int
    accepted_tokens: int
    draft_weight_bytes: int
    draft_kv_capacity_bytes: int
    def __init__(self, weight_bytes: _Optional[int] = ..., kv_capacity_bytes: _Optional[int] = ..., kv_used_bytes: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., kv_cached_bytes: _Optional[int] = ..., prefix_cache: _Optional[bool] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_queried_tokens: _Optional[int] = ..., prefix_evictions: _Optional[int] = ..., preemptions: _Optional[int] = ..., recomputed_tokens: _Optional[int] = ..., speculated_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., draft_weight_bytes: _Optional[int] = ..., draft_kv_capacity_bytes: _Optional[int] = ...) -> None: ...

class MemoryAccounting(_message.Message):
    __slots__ = ("kv_bytes_per_token", "kv_blocks_reserved", "kv_bytes_reserved", "kv_bytes_used", "activation_peak_bytes", "attention", "engine", "kv_bytes_shared", "kv_bytes_own", "prompt_tokens_cached", "kv_dtype", "preemptions", "recomputed_tokens", "speculated_tokens", "accepted_tokens", "kv_bytes_speculative", "kv_bytes_draft")
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RESERVED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SHARED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_OWN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_CACHED_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_DRAFT_FIELD_NUMBER: _ClassVar[int]
    kv_bytes_per_token: int
    kv_blocks_reserved: int
    kv_bytes_reserved: int
    kv_bytes_used: int
    activation_peak_bytes: int
    attention: str
    engine: EngineMemory
    kv_bytes_shared: int
    kv_bytes_own: int
    prompt_tokens_cached: int
    kv_dtype: str
    preemptions: int
    recomputed_tokens: int
    speculated_tokens: int
    accepted_tokens: int
    kv_bytes_speculative: int
    kv_bytes_draft: int
    def __init__(self, kv_bytes_per_token: _Optional[int] = ..., kv_blocks_reserved: _Optional[int] = ..., kv_bytes_reserved: _Optional[int] = ..., kv_bytes_used: _Optional[int] = ..., activation_peak_bytes: _Optional[int] = ..., attention: _Optional[str] = ..., engine: _Optional[_Union[EngineMemory, _Mapping]] = ..., kv_bytes_shared: _Optional[int] = ..., kv_bytes_own: _Optional[int] = ..., prompt_tokens_cached: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., preemptions: _Optional[int] = ..., recomputed_tokens: _Optional[int] = ..., speculated_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., kv_bytes_speculative: _Optional[int] = ..., kv_bytes_draft: _Optional[int] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("finish_reason", "stop", "seed", "usage", "memory", "ttft_s", "duration_s")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    stop: str
    seed: int
    usage: Usage
    memory: MemoryAccounting
    ttft_s: float
    duration_s: float
    def __init__(self, finish_reason: _Optional[str] = ..., stop: _Optional[str] = ..., seed: _Optional[int] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., memory: _Optional[_Union[MemoryAccounting, _Mapping]] = ..., ttft_s: _Optional[float] = ..., duration_s: _Optional[float] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("index", "text", "token_ids", "logprobs", "trace", "final", "prompt_logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    trace: _containers.RepeatedCompositeFieldContainer[TraceStep]
    final: Final
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., trace: _Optional[_Iterable[_Union[TraceStep, _Mapping]]] = ..., final: _Optional[_Union[Final, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "logprobs", "trace", "final", "choices", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    trace: _containers.RepeatedCompositeFieldContainer[TraceStep]
    final: Final
    choices: _containers.RepeatedCompositeFieldContainer[Choice]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., trace: _Optional[_Iterable[_Union[TraceStep, _Mapping]]] = ..., final: _Optional[_Union[Final, _Mapping]] = ..., choices: _Optional[_Iterable[_Union[Choice, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("request_id", "seed", "text", "token_ids", "logprobs", "trace", "final", "index", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seed: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    trace: _containers.RepeatedCompositeFieldContainer[TraceStep]
    final: Final
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., seed: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., trace: _Optional[_Iterable[_Union[TraceStep, _Mapping]]] = ..., final: _Optional[_Union[Final, _Mapping]] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("model", "scheme", "dtype", "device", "attention", "context_length", "vocab_size", "kv_bytes_per_token", "memory", "glue_ops", "max_new_tokens_limit", "max_prompt_tokens", "embeddings", "kernels", "speculation")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    GLUE_OPS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    model: str
    scheme: str
    dtype: str
    device: str
    attention: str
    context_length: int
    vocab_size: int
    kv_bytes_per_token: int
    memory: EngineMemory
    glue_ops: str
    max_new_tokens_limit: int
    max_prompt_tokens: int
    embeddings: str
    kernels: _containers.RepeatedScalarFieldContainer[str]
    speculation: str
    def __init__(self, model: _Optional[str] = ..., scheme: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., attention: _Optional[str] = ..., context_length: _Optional[int] = ..., vocab_size: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., memory: _Optional[_Union[EngineMemory, _Mapping]] = ..., glue_ops: _Optional[str] = ..., max_new_tokens_limit: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., embeddings: _Optional[str] = ..., kernels: _Optional[_Iterable[str]] = ..., speculation: _Optional[str] = ...) -> None: ...

class RequestShape(_message.Message):
    __slots__ = ("prompt_tokens", "max_new_tokens", "count", "n", "expected_new_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    max_new_tokens: int
    count: int
    n: int
    expected_new_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., count: _Optional[int] = ..., n: _Optional[int] = ..., expected_new_tokens: _Optional[int] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestShape]
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestShape, _Mapping]]] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("code", "message", "param")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    param: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., param: _Optional[str] = ...) -> None: ...

class ShapePlan(_message.Message):
    __slots__ = ("shape", "kv_blocks", "kv_bytes_reserved", "activation_peak_bytes", "fit_now", "fit_now_limited_by", "fit_empty", "fit_empty_limited_by", "admitted", "queued", "refused", "refusal", "kv_blocks_shared", "kv_blocks_admission", "kv_blocks_expected", "fit_expected", "fit_expected_limited_by")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RESERVED_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIT_NOW_FIELD_NUMBER: _ClassVar[int]
    FIT_NOW_LIMITED_BY_FIELD_NUMBER: _ClassVar[int]
    FIT_EMPTY_FIELD_NUMBER: _ClassVar[int]
    FIT_EMPTY_LIMITED_BY_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_SHARED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_ADMISSION_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_EXPECTED_FIELD_NUMBER: _ClassVar[int]
    FIT_EXPECTED_FIELD_NUMBER: _ClassVar[int]
    FIT_EXPECTED_LIMITED_BY_FIELD_NUMBER: _ClassVar[int]
    shape: RequestShape
    kv_blocks: int
    kv_bytes_reserved: int
    activation_peak_bytes: int
    fit_now: int
    fit_now_limited_by: str
    fit_empty: int
    fit_empty_limited_by: str
    admitted: int
    queued: int
    refused: int
    refusal: Refusal
    kv_blocks_shared: int
    kv_blocks_admission: int
    kv_blocks_expected: int
    fit_expected: int
    fit_expected_limited_by: str
    def __init__(self, shape: _Optional[_Union[RequestShape, _Mapping]] = ..., kv_blocks: _Optional[int] = ..., kv_bytes_reserved: _Optional[int] = ..., activation_peak_bytes: _Optional[int] = ..., fit_now: _Optional[int] = ..., fit_now_limited_by: _Optional[str] = ..., fit_empty: _Optional[int] = ..., fit_empty_limited_by: _Optional[str] = ..., admitted: _Optional[int] = ..., queued: _Optional[int] = ..., refused: _Optional[int] = ..., refusal: _Optional[_Union[Refusal, _Mapping]] = ..., kv_blocks_shared: _Optional[int] = ..., kv_blocks_admission: _Optional[int] = ..., kv_blocks_expected: _Optional[int] = ..., fit_expected: _Optional[int] = ..., fit_expected_limited_by: _Optional[str] = ...) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ("shapes", "engine", "kv_bytes_per_token", "kv_capacity_blocks", "kv_free_blocks", "max_batch", "max_queue", "max_prefill_tokens", "attention", "kv_admission", "kv_dtype")
    SHAPES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    MAX_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    KV_ADMISSION_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    shapes: _containers.RepeatedCompositeFieldContainer[ShapePlan]
    engine: EngineMemory
    kv_bytes_per_token: int
    kv_capacity_blocks: int
    kv_free_blocks: int
    max_batch: int
    max_queue: int
    max_prefill_tokens: int
    attention: str
    kv_admission: str
    kv_dtype: str
    def __init__(self, shapes: _Optional[_Iterable[_Union[ShapePlan, _Mapping]]] = ..., engine: _Optional[_Union[EngineMemory, _Mapping]] = ..., kv_bytes_per_token: _Optional[int] = ..., kv_capacity_blocks: _Optional[int] = ..., kv_free_blocks: _Optional[int] = ..., max_batch: _Optional[int] = ..., max_queue: _Optional[int] = ..., max_prefill_tokens: _Optional[int] = ..., attention: _Optional[str] = ..., kv_admission: _Optional[str] = ..., kv_dtype: _Optional[str] = ...) -> None: ...
