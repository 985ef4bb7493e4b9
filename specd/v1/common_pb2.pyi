from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "repetition_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    repetition_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class CommittedTokens(_message.Message):
    __slots__ = ("start", "token_ids", "reserve_tokens")
    START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    start: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    reserve_tokens: int
    def __init__(self, start: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., reserve_tokens: _Optional[int] = ...) -> None: ...

class TokenizerSpec(_message.Message):
    __slots__ = ("tokenizer_json", "chat_template", "template_variables_json", "clean_up_tokenization_spaces", "probes", "split_special_tokens")
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_VARIABLES_JSON_FIELD_NUMBER: _ClassVar[int]
    CLEAN_UP_TOKENIZATION_SPACES_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    SPLIT_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokenizer_json: str
    chat_template: str
    template_variables_json: str
    clean_up_tokenization_spaces: bool
    probes: _containers.RepeatedCompositeFieldContainer[TokenizerProbe]
    split_special_tokens: bool
    def __init__(self, tokenizer_json: _Optional[str] = ..., chat_template: _Optional[str] = ..., template_variables_json: _Optional[str] = ..., clean_up_tokenization_spaces: _Optional[bool] = ..., probes: _Optional[_Iterable[_Union[TokenizerProbe, _Mapping]]] = ..., split_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizerProbe(_message.Message):
    __slots__ = ("text", "chat_json", "token_ids", "decoded")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_JSON_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODED_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat_json: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    decoded: str
    def __init__(self, text: _Optional[str] = ..., chat_json: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., decoded: _Optional[str] = ...) -> None: ...
