"""How a control-plane wire type is bounded and checked (the messages themselves are in ``messages``).

The wire's sizes and limits, the annotated field types the codec's typed decoder enforces in C while
it parses, the construction checks every message runs in ``__post_init__`` (compiled once per class
from its field annotations: types, ranges, lengths, descriptor dicts, converting lists to tuples and
ints to their enum), the :class:`Wire` and :class:`Checked` bases of every message, and the attrs
validators of the value classes beside the messages (``handshake.HandshakeConfig``).  An instance
that constructs is an instance that encodes.
"""

from __future__ import annotations

import enum
import typing
from typing import Annotated, Any, Iterator, Union

import attrs
import msgspec
from msgspec import Meta
from msgspec.structs import force_setattr

from llmdd._base.status import LLMStatusCode, LocalUsageError

__all__ = [
    "U8_MAX", "U16_MAX", "U32_MAX", "U64_MAX", "I64_MIN", "I64_MAX", "INCARNATION_SIZE", "NONCE_MIN_SIZE",
    "NONCE_MAX_SIZE", "MAC_SIZE", "MAX_COUNT", "MAX_NAME", "MAX_TEXT", "MAX_DESCRIPTOR_DEPTH", "MAX_TAG_BYTES",
    "MAX_NOTICE_BATCH", "U8", "U16", "U32", "U64", "I64", "Name", "Text", "Incarnation", "Nonce", "Mac",
    "Descriptor", "int_in", "u16", "u64", "bytes_len", "tuple_of", "InvalidMessage", "InvalidMessageType",
    "check_descriptor", "Wire", "Checked", "descriptor_dicts",
]

U8_MAX = 2**8 - 1
U16_MAX = 2**16 - 1
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
I64_MIN = -(2**63)
I64_MAX = 2**63 - 1

INCARNATION_SIZE = 16
NONCE_MIN_SIZE = 16
NONCE_MAX_SIZE = 64
MAC_SIZE = 32  # HMAC-SHA256
MAX_COUNT = 1 << 20          # elements in any one list / dict
MAX_NAME = 4096              # characters in a name (host ids, transport names, request ops)
MAX_TEXT = 64 * 1024         # characters in a reason / error message
MAX_DESCRIPTOR_DEPTH = 16    # nesting of a descriptor dict (the top-level dict counts as 1)
MAX_TAG_BYTES = 256          # a transfer's tag (the connector extensions' opaque request id)
MAX_NOTICE_BATCH = 1024      # transfer-done notices in one PushDone


# --------------------------------------------------------------------------- wire field types
# The typed decoder enforces these in C.  msgspec cannot state an upper bound beyond int64, and
# MessagePack carries no integer above 2**64-1, so u64 is "ge=0"; an unconstrained int is the full
# wire range -2**63 .. 2**64-1 (BlocksCacheKey.model_id is only checked to be an int upstream).

U8 = Annotated[int, Meta(ge=0, le=U8_MAX)]
U16 = Annotated[int, Meta(ge=0, le=U16_MAX)]
U32 = Annotated[int, Meta(ge=0, le=U32_MAX)]
U64 = Annotated[int, Meta(ge=0)]
I64 = Annotated[int, Meta(ge=I64_MIN, le=I64_MAX)]
Name = Annotated[str, Meta(max_length=MAX_NAME)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
Incarnation = Annotated[bytes, Meta(min_length=INCARNATION_SIZE, max_length=INCARNATION_SIZE)]
Nonce = Annotated[bytes, Meta(min_length=NONCE_MIN_SIZE, max_length=NONCE_MAX_SIZE)]
Mac = Annotated[bytes, Meta(min_length=MAC_SIZE, max_length=MAC_SIZE)]
Descriptor = dict[str, Any]


# --------------------------------------------------------------------------- attrs validators
# (for the attrs classes beside the messages, e.g. handshake.HandshakeConfig)

def int_in(lo: int, hi: int):
    def check(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidMessageType(f"{attribute.name} must be an int, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise InvalidMessage(f"{attribute.name} out of range [{lo}, {hi}]: {value}")

    return check


u16 = int_in(0, U16_MAX)
u64 = int_in(0, U64_MAX)


def bytes_len(lo: int, hi: int):
    def check(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, bytes):
            raise InvalidMessageType(f"{attribute.name} must be bytes, got {type(value).__name__}")
        if not lo <= len(value) <= hi:
            raise InvalidMessage(f"{attribute.name} must be {lo}..{hi} bytes long, got {len(value)}")

    return check


def tuple_of(cls: type, elem_check=None):
    member = attrs.validators.instance_of(cls) if elem_check is None else elem_check
    return attrs.validators.deep_iterable(member_validator=member,
                                          iterable_validator=attrs.validators.instance_of(tuple))


# --------------------------------------------------------------------------- construction checks

class InvalidMessage(LocalUsageError, ValueError):
    """A message built with a value the wire cannot carry (``LLM_PARAM_INVALID``; also a ValueError,
    which is what msgspec turns into a ValidationError, hence a ProtocolError, while decoding)."""

    def __init__(self, *args: Any, status_code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID) -> None:
        super().__init__(*args, status_code=status_code)


class InvalidMessageType(InvalidMessage, TypeError):
    """A message built with a value of the wrong type (see :class:`InvalidMessage`)."""


def check_descriptor(value: Any, name: str, depth: int = 1, max_depth: int = MAX_DESCRIPTOR_DEPTH) -> None:
    """A descriptor dict: str keys, the value types the wire carries, at most ``max_depth`` deep and
    :data:`MAX_COUNT` entries per container (ValueError/TypeError otherwise)."""
    if type(value) is not dict:
        raise InvalidMessageType(f"{name} must be a dict, got {type(value).__name__}")
    if depth > max_depth:
        raise InvalidMessage(f"{name}: descriptor nesting deeper than {max_depth}")
    if len(value) > MAX_COUNT:
        raise InvalidMessage(f"{name}: {len(value)} entries exceed {MAX_COUNT}")
    for k, v in value.items():
        if type(k) is not str:
            raise InvalidMessageType(f"{name} keys must be str, got {type(k).__name__}")
        _check_value(v, name, depth, max_depth)


def _check_value(v: Any, name: str, depth: int, max_depth: int) -> None:
    t = type(v)
    if v is None or t is bool or t is float or t is str or t is bytes:
        return
    if t is int:
        if not I64_MIN <= v <= U64_MAX:
            raise InvalidMessage(f"{name}: integer {v} outside the 64-bit range")
        return
    if t is dict:
        check_descriptor(v, name, depth + 1, max_depth)
        return
    if t is list or t is tuple:
        if depth + 1 > max_depth:
            raise InvalidMessage(f"{name}: descriptor nesting deeper than {max_depth}")
        if len(v) > MAX_COUNT:
            raise InvalidMessage(f"{name}: {len(v)} elements exceed {MAX_COUNT}")
        for item in v:
            _check_value(item, name, depth + 1, max_depth)
        return
    if t is bytearray or t is memoryview:
        return
    raise InvalidMessageType(f"{name}: descriptor values cannot be {t.__name__}")


def _meta_of(tp: Any) -> tuple[Any, Any]:
    """(base type, msgspec.Meta or None) of an annotation."""
    if getattr(tp, "__metadata__", None):
        metas = [x for x in tp.__metadata__ if isinstance(x, Meta)]
        return tp.__origin__, (metas[0] if metas else None)
    return tp, None


def _compile(tp: Any):
    """A checker ``(value, name) -> value`` (possibly converted) for one field annotation."""
    base, meta = _meta_of(tp)
    origin = getattr(base, "__origin__", None)
    if base is int:
        lo = I64_MIN if meta is None or meta.ge is None else meta.ge
        hi = U64_MAX if meta is None or meta.le is None else meta.le

        def check_int(v: Any, name: str) -> Any:
            if type(v) is not int:
                if isinstance(v, int) and not isinstance(v, bool):
                    v = int(v)   # an IntEnum member or another int subclass: its value
                else:
                    raise InvalidMessageType(f"{name} must be an int, got {type(v).__name__}")
            if not lo <= v <= hi:
                raise InvalidMessage(f"{name} out of range [{lo}, {hi}]: {v}")
            return v

        return check_int
    if base is bool or base is float:
        def check_exact(v: Any, name: str) -> Any:
            if type(v) is not base:
                raise InvalidMessageType(f"{name} must be a {base.__name__}, got {type(v).__name__}")
            return v

        return check_exact
    if base is str or base is bytes:
        lo = 0 if meta is None or meta.min_length is None else meta.min_length
        hi = None if meta is None else meta.max_length

        def check_sized(v: Any, name: str) -> Any:
            if type(v) is not base:
                raise InvalidMessageType(f"{name} must be {base.__name__}, got {type(v).__name__}")
            if len(v) < lo or (hi is not None and len(v) > hi):
                raise InvalidMessage(f"{name} must be {lo}..{hi} long, got {len(v)}")
            return v

        return check_sized
    if isinstance(base, type) and issubclass(base, enum.Enum):
        def check_enum(v: Any, name: str) -> Any:
            if type(v) is base:
                return v
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidMessageType(f"{name} must be a {base.__name__}, got {type(v).__name__}")
            try:
                return base(v)
            except ValueError:
                raise InvalidMessage(f"{name}: {v} is not a {base.__name__}") from None

        return check_enum
    if isinstance(base, type) and issubclass(base, msgspec.Struct):
        def check_struct(v: Any, name: str) -> Any:
            if type(v) is not base:
                raise InvalidMessageType(f"{name} must be a {base.__name__}, got {type(v).__name__}")
            return v

        return check_struct
    if origin is Union:
        (inner,) = [a for a in base.__args__ if a is not type(None)]
        check_inner = _compile(inner)
        return lambda v, name: None if v is None else check_inner(v, name)
    if origin is tuple:
        elem = base.__args__[0]
        check_elem = _compile(elem)
        cap = MAX_COUNT if meta is None or meta.max_length is None else meta.max_length
        elem_base, elem_meta = _meta_of(elem)
        # fast paths (builtins, no Python call per element) for the common element types
        if elem_base is int:
            lo = I64_MIN if elem_meta is None or elem_meta.ge is None else elem_meta.ge
            hi = U64_MAX if elem_meta is None or elem_meta.le is None else elem_meta.le

            def fast(v: Any) -> bool:
                return all(type(x) is int for x in v) and lo <= min(v) and max(v) <= hi
        elif isinstance(elem_base, type) and issubclass(elem_base, msgspec.Struct):
            def fast(v: Any) -> bool:
                return all(type(x) is elem_base for x in v)
        else:
            def fast(v: Any) -> bool:
                return False

        def check_tuple(v: Any, name: str) -> Any:
            if type(v) is not tuple and type(v) is not list:
                raise InvalidMessageType(f"{name} must be a tuple, got {type(v).__name__}")
            if len(v) > cap:
                raise InvalidMessage(f"{name}: {len(v)} elements exceed {cap}")
            if not v or fast(v):
                return v if type(v) is tuple else tuple(v)
            out = tuple(check_elem(x, name) for x in v)
            return v if type(v) is tuple and all(a is b for a, b in zip(out, v)) else out

        return check_tuple
    if origin is dict:
        def check_dict(v: Any, name: str) -> Any:
            check_descriptor(v, name)
            return v

        return check_dict
    raise RuntimeError(f"no construction check for the annotation {tp!r}")


_CHECKS: dict[type, tuple] = {}


def _checks_of(cls: type[msgspec.Struct]) -> tuple:
    checks = _CHECKS.get(cls)
    if checks is None:  # first construction of each class
        hints = typing.get_type_hints(cls, include_extras=True)
        checks = _CHECKS[cls] = tuple((f, _compile(hints[f])) for f in cls.__struct_fields__)
    return checks


# Every subclass restates frozen=True: msgspec inherits it anyway, but a type checker reading the
# dataclass_transform does not, and would take the subclass for a mutable one.
class Wire(msgspec.Struct, frozen=True, kw_only=True, array_like=True, forbid_unknown_fields=True):
    """Base of every wire type: immutable, keyword-built, a MessagePack array of its fields."""


class Checked(Wire, frozen=True, kw_only=True):
    """A wire type whose construction (and decoding) runs the field checks and :meth:`_check`."""

    def __post_init__(self) -> None:
        for name, check in _checks_of(type(self)):
            v = getattr(self, name)
            nv = check(v, name)
            if nv is not v:
                force_setattr(self, name, nv)
        self._check()

    def _check(self) -> None:
        """Cross-field rules of a message (after the field checks)."""


def descriptor_dicts(msg: msgspec.Struct) -> Iterator[dict]:
    """Every descriptor dict inside ``msg`` (for a connection with a tighter nesting limit)."""
    for name in msg.__struct_fields__:
        v = getattr(msg, name)
        if type(v) is dict:
            yield v
        elif isinstance(v, msgspec.Struct):
            yield from descriptor_dicts(v)
        elif type(v) is tuple and v and isinstance(v[0], msgspec.Struct):
            for item in v:
                yield from descriptor_dicts(item)
