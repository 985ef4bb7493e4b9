"""Hypothesis strategies for any specd.v1 request message, built from its descriptor.

Every field gets values of its wire type, from plausible to hostile: extremes of each integer
type, NaN and infinities for floats, over-long strings, enum numbers no name has. Fields whose
meaning the workers check get a share of values near the valid ones as well (a few session ids,
token ids inside the tiny vocabulary, small positions and sizes), so that a fuzzed call reaches
past the first check often enough to exercise the ones behind it.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

VOCAB = 384  # tests/tiny_models.build_tokenizer
SESSION_IDS = ["fuzz-a", "fuzz-b"]
LONG_TEXT = "x" * 300  # past every id-length bound (256 bytes)

_INT32 = st.one_of(st.integers(-2, VOCAB + 1), st.sampled_from([-(2**31), 2**31 - 1]), st.integers(-(2**31), 2**31 - 1))
_UINT32 = st.one_of(st.integers(0, 40), st.sampled_from([2**32 - 1]), st.integers(0, 2**32 - 1))
_FLOAT = st.one_of(st.sampled_from([0.0, 0.01, 0.5, 1.0, 1e-38, -0.0]), st.floats(width=32))
_SMALL_OR_HUGE = st.one_of(st.integers(0, 12), st.sampled_from([2**32 - 1]))

# Name -> values, where a field's meaning gives plausible values beyond its wire type's.
_BY_NAME = {
    "session_id": st.one_of(st.sampled_from(SESSION_IDS), st.just(""), st.just(LONG_TEXT)),
    "request_id": st.one_of(st.text(max_size=12), st.just(LONG_TEXT)),
    "prompt": st.text(max_size=120),
    "role": st.one_of(st.sampled_from(["user", "system", "assistant", ""]), st.text(max_size=8)),
    "content": st.text(max_size=60),
    "start": _SMALL_OR_HUGE,
    "after": _SMALL_OR_HUGE,
    "num_tokens": st.one_of(st.integers(0, 40), st.sampled_from([2**32 - 1])),
    "max_support": st.one_of(st.integers(0, 100), st.sampled_from([2**32 - 1])),
    "max_new_tokens": st.one_of(st.integers(-3, 12), st.sampled_from([0, 4097, 2**31 - 1, -(2**31)])),
    "num_speculative_tokens": st.one_of(st.integers(0, 8), st.sampled_from([33, 2**32 - 1])),
    "top_k": st.one_of(st.integers(-2, 50), st.sampled_from([-(2**31), 2**31 - 1])),
    "seed": st.one_of(st.integers(0, 10), st.just(2**64 - 1)),
}
_REPEATED_BY_NAME = {
    "stop": st.lists(st.text(max_size=4), max_size=3),
    "fanout": st.lists(st.one_of(st.integers(0, 80), st.just(2**32 - 1)), max_size=6),
    # A prompt of the tiny context's size or longer now and then.
    "ids": st.one_of(st.lists(_INT32, max_size=10), st.sampled_from([[5] * 511, [5] * 512, [5] * 600])),
}


def _scalar(field: FieldDescriptor) -> st.SearchStrategy:
    kind = field.type
    if kind == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.text(max_size=12), st.just(LONG_TEXT))
    if kind in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        return _INT32
    if kind in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return _UINT32
    if kind in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64):
        return st.integers(-(2**63), 2**63 - 1)
    if kind in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return st.integers(0, 2**64 - 1)
    if kind == FieldDescriptor.TYPE_FLOAT:
        return _FLOAT
    if kind == FieldDescriptor.TYPE_DOUBLE:
        return st.floats()
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_ENUM:
        named = [value.number for value in field.enum_type.values]
        return st.one_of(st.sampled_from(named), st.integers(-1, 12))
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=16)
    raise TypeError(f"no strategy for field {field.full_name} of type {kind}")


def _field(field: FieldDescriptor, depth: int) -> st.SearchStrategy:
    """Values for one field; None leaves it unset."""
    if field.is_repeated:
        if field.name in _REPEATED_BY_NAME:
            return _REPEATED_BY_NAME[field.name]
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            return st.lists(message_values(field.message_type, depth + 1), max_size=3 if depth < 3 else 1)
        return st.lists(_BY_NAME.get(field.name, _scalar(field)), max_size=6)
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return st.one_of(st.none(), message_values(field.message_type, depth + 1))
    return st.one_of(st.none(), _BY_NAME.get(field.name, _scalar(field)))


def message_values(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy:
    """A dict of field name -> value for `descriptor`'s message; at most one field per oneof."""
    if depth > 4:
        return st.just({})
    members = {f.name: f.containing_oneof.name for f in descriptor.fields if f.containing_oneof and len(f.containing_oneof.fields) > 1}
    plain = {f.name: _field(f, depth) for f in descriptor.fields if f.name not in members}
    choices = {}
    for oneof in {name for name in members.values()}:
        fields = [f for f in descriptor.fields if members.get(f.name) == oneof]
        choices[oneof] = st.one_of(st.none(), *[st.tuples(st.just(f.name), _field(f, depth)) for f in fields])
    return st.builds(_merge, st.fixed_dictionaries(plain), st.fixed_dictionaries(choices))


def _merge(plain: dict, choices: dict) -> dict:
    values = {name: value for name, value in plain.items() if value is not None}
    for chosen in choices.values():
        if chosen is not None and chosen[1] is not None:
            values[chosen[0]] = chosen[1]
    return values


def build(message_class, values: dict):
    """The message `values` (from message_values) describe."""
    message = message_class()
    _fill(message, values)
    return message


def _fill(message, values: dict) -> None:
    for name, value in values.items():
        field = message.DESCRIPTOR.fields_by_name[name]
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.is_repeated:
                for item in value:
                    _fill(getattr(message, name).add(), item)
            else:
                getattr(message, name).SetInParent()
                _fill(getattr(message, name), value)
        elif field.is_repeated:
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)


def requests(message_class) -> st.SearchStrategy:
    """Messages of `message_class`, from plausible to hostile."""
    return message_values(message_class.DESCRIPTOR).map(lambda values: build(message_class, values))


def mutations(base: st.SearchStrategy, message_class, most: int = 3) -> st.SearchStrategy:
    """Messages from `base` with up to `most` of their fields replaced by fuzzed values (or
    cleared): each gets past the checks its other fields would fail, to the ones behind."""
    names = [field.name for field in message_class.DESCRIPTOR.fields]
    if not names:
        return base
    return st.builds(
        _mutate, base, message_values(message_class.DESCRIPTOR), st.sets(st.sampled_from(names), max_size=most)
    )


def _mutate(message, values: dict, replaced: set):
    mutated = type(message)()
    mutated.CopyFrom(message)
    for name in replaced:
        mutated.ClearField(name)
        if name in values:
            _fill(mutated, {name: values[name]})
    return mutated
