from specd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NextTokenKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NEXT_TOKEN_KIND_UNSPECIFIED: _ClassVar[NextTokenKind]
    NEXT_TOKEN_KIND_BONUS: _ClassVar[NextTokenKind]
    NEXT_TOKEN_KIND_RECOVERED: _ClassVar[NextTokenKind]
NEXT_TOKEN_KIND_UNSPECIFIED: NextTokenKind
NEXT_TOKEN_KIND_BONUS: NextTokenKind
NEXT_TOKEN_KIND_RECOVERED: NextTokenKind

class TargetPrefillRequest(_message.Message):
    __slots__ = ("session_id", "committed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    committed: _common_pb2.CommittedTokens
    def __init__(self, session_id: _Optional[str] = ..., committed: _Optional[_Union[_common_pb2.CommittedTokens, _Mapping]] = ...) -> None: ...

class TargetPrefillResponse(_message.Message):
    __slots__ = ("cached_tokens", "forward_ms")
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    forward_ms: float
    def __init__(self, cached_tokens: _Optional[int] = ..., forward_ms: _Optional[float] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "committed", "draft_tokens", "draft_probs", "sampling", "return_logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    committed: _common_pb2.CommittedTokens
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    sampling: _common_pb2.SamplingParams
    return_logprobs: bool
    def __init__(self, session_id: _Optional[str] = ..., committed: _Optional[_Union[_common_pb2.CommittedTokens, _Mapping]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., return_logprobs: _Optional[bool] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted", "next_token", "next_token_kind", "logprobs", "forward_ms", "cached_tokens")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_KIND_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    next_token: int
    next_token_kind: NextTokenKind
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    forward_ms: float
    cached_tokens: int
    def __init__(self, accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., next_token_kind: _Optional[_Union[NextTokenKind, str]] = ..., logprobs: _Optional[_Iterable[float]] = ..., forward_ms: _Optional[float] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class VerifyChoice(_message.Message):
    __slots__ = ("accepted", "next_token", "verify")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    next_token: int
    verify: VerifyRequest
    def __init__(self, accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., verify: _Optional[_Union[VerifyRequest, _Mapping]] = ...) -> None: ...

class VerifyAfterRequest(_message.Message):
    __slots__ = ("session_id", "after", "choices")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    after: int
    choices: _containers.RepeatedCompositeFieldContainer[VerifyChoice]
    def __init__(self, session_id: _Optional[str] = ..., after: _Optional[int] = ..., choices: _Optional[_Iterable[_Union[VerifyChoice, _Mapping]]] = ...) -> None: ...

class VerifyAfterResponse(_message.Message):
    __slots__ = ("matched", "verify")
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    matched: bool
    verify: VerifyResponse
    def __init__(self, matched: _Optional[bool] = ..., verify: _Optional[_Union[VerifyResponse, _Mapping]] = ...) -> None: ...

class TargetEndSessionRequest(_message.Message):
    __slots__ = ("session_id", "retire_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RETIRE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    retire_id: bool
    def __init__(self, session_id: _Optional[str] = ..., retire_id: _Optional[bool] = ...) -> None: ...

class TargetEndSessionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class TargetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "context_length", "eos_token_ids", "default_sampling", "dtype", "device", "tensor_parallel", "tokenizer_fingerprint", "max_sessions", "tokenizer", "backend", "fast_paths")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    FAST_PATHS_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    context_length: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    default_sampling: _common_pb2.SamplingParams
    dtype: str
    device: str
    tensor_parallel: int
    tokenizer_fingerprint: str
    max_sessions: int
    tokenizer: _common_pb2.TokenizerSpec
    backend: str
    fast_paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., context_length: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., default_sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., tensor_parallel: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., max_sessions: _Optional[int] = ..., tokenizer: _Optional[_Union[_common_pb2.TokenizerSpec, _Mapping]] = ..., backend: _Optional[str] = ..., fast_paths: _Optional[_Iterable[str]] = ...) -> None: ...
