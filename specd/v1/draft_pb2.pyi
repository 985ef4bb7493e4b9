from specd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftPrefillRequest(_message.Message):
    __slots__ = ("session_id", "committed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    committed: _common_pb2.CommittedTokens
    def __init__(self, session_id: _Optional[str] = ..., committed: _Optional[_Union[_common_pb2.CommittedTokens, _Mapping]] = ...) -> None: ...

class DraftPrefillResponse(_message.Message):
    __slots__ = ("cached_tokens", "forward_ms")
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    forward_ms: float
    def __init__(self, cached_tokens: _Optional[int] = ..., forward_ms: _Optional[float] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "committed", "num_tokens", "sampling", "max_support", "saguaro")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_SUPPORT_FIELD_NUMBER: _ClassVar[int]
    SAGUARO_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    committed: _common_pb2.CommittedTokens
    num_tokens: int
    sampling: _common_pb2.SamplingParams
    max_support: int
    saguaro: SaguaroParams
    def __init__(self, session_id: _Optional[str] = ..., committed: _Optional[_Union[_common_pb2.CommittedTokens, _Mapping]] = ..., num_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_support: _Optional[int] = ..., saguaro: _Optional[_Union[SaguaroParams, _Mapping]] = ...) -> None: ...

class SaguaroParams(_message.Message):
    __slots__ = ("c", "fanout")
    C_FIELD_NUMBER: _ClassVar[int]
    FANOUT_FIELD_NUMBER: _ClassVar[int]
    c: float
    fanout: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, c: _Optional[float] = ..., fanout: _Optional[_Iterable[int]] = ...) -> None: ...

class SpeculateRequest(_message.Message):
    __slots__ = ("session_id", "committed", "draft_tokens", "num_tokens", "fanout", "sampling", "max_support", "saguaro")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FANOUT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_SUPPORT_FIELD_NUMBER: _ClassVar[int]
    SAGUARO_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    committed: _common_pb2.CommittedTokens
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    fanout: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    max_support: int
    saguaro: SaguaroParams
    def __init__(self, session_id: _Optional[str] = ..., committed: _Optional[_Union[_common_pb2.CommittedTokens, _Mapping]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., fanout: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_support: _Optional[int] = ..., saguaro: _Optional[_Union[SaguaroParams, _Mapping]] = ...) -> None: ...

class SpeculateResponse(_message.Message):
    __slots__ = ("guesses", "cache")
    GUESSES_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    guesses: SpeculationGuesses
    cache: SpeculationCache
    def __init__(self, guesses: _Optional[_Union[SpeculationGuesses, _Mapping]] = ..., cache: _Optional[_Union[SpeculationCache, _Mapping]] = ...) -> None: ...

class SpeculationCache(_message.Message):
    __slots__ = ("entries", "forward_ms")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[SpeculationEntry]
    forward_ms: float
    def __init__(self, entries: _Optional[_Iterable[_Union[SpeculationEntry, _Mapping]]] = ..., forward_ms: _Optional[float] = ...) -> None: ...

class SpeculationGuesses(_message.Message):
    __slots__ = ("accepted", "next_token")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    accepted: _containers.RepeatedScalarFieldContainer[int]
    next_token: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, accepted: _Optional[_Iterable[int]] = ..., next_token: _Optional[_Iterable[int]] = ...) -> None: ...

class SpeculationEntry(_message.Message):
    __slots__ = ("accepted", "next_token", "draft_tokens", "draft_probs")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    next_token: int
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    def __init__(self, accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("draft_tokens", "draft_probs", "forward_ms")
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    forward_ms: float
    def __init__(self, draft_tokens: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., forward_ms: _Optional[float] = ...) -> None: ...

class DraftEndSessionRequest(_message.Message):
    __slots__ = ("session_id", "retire_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RETIRE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    retire_id: bool
    def __init__(self, session_id: _Optional[str] = ..., retire_id: _Optional[bool] = ...) -> None: ...

class DraftEndSessionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class DraftInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "context_length", "dtype", "device", "tokenizer_fingerprint", "max_sessions", "backend", "fast_paths")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    FAST_PATHS_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    context_length: int
    dtype: str
    device: str
    tokenizer_fingerprint: str
    max_sessions: int
    backend: str
    fast_paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., context_length: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., max_sessions: _Optional[int] = ..., backend: _Optional[str] = ..., fast_paths: _Optional[_Iterable[str]] = ...) -> None: ...
