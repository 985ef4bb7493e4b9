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
    __slots__ = ("session_id", "committed", "num_tokens", "sampling", "max_support")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_SUPPORT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    committed: _common_pb2.CommittedTokens
    num_tokens: int
    sampling: _common_pb2.SamplingParams
    max_support: int
    def __init__(self, session_id: _Optional[str] = ..., committed: _Optional[_Union[_common_pb2.CommittedTokens, _Mapping]] = ..., num_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_support: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DraftEndSessionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class DraftInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "context_length", "dtype", "device", "tokenizer_fingerprint")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    context_length: int
    dtype: str
    device: str
    tokenizer_fingerprint: str
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., context_length: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ...) -> None: ...
