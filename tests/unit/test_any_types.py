"""Parameters and attributes of llmdd typed ``Any`` (issue 37: every collaborator gets its real type).

A collaborator (a link, a channel, an endpoint, a cache record, a manager, a registry, a task) is
typed by its class or by a Protocol where a layer must not import the other's module.  What is
still ``Any`` is listed in :data:`ALLOWED` with the reason it stays so; the scan of llmdd's source
(annotations of parameters, of attributes and of module or class variables; not of a function's
local variables) must find exactly that list.  A new ``Any`` fails here: type it, or add it with
its reason.  One typed since fails too: take it off the list, so the count only goes down.
"""

from __future__ import annotations

import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------------------- the reasons
FORWARDED = ("star arguments passed on as they came (to a callable, an exception, a format string, a "
             "log call, an event's info): their types are the callee's")
USER_VALUE = ("a caller's argument before its check: any value may arrive, and refusing a wrong one "
              "with the contract's error is what the function does")
PEER_VALUE = ("a value a peer sent, before its check (typed and bounded here, docs/security.md): any "
              "value may arrive")
WIRE_VALUE = "a decoded wire value checked against its message's schema: any value may arrive"
VALIDATOR_INSTANCE = "an attrs validator's instance argument (the object being built; never read)"
ANNOTATION = ("a type annotation being compiled into a check (a type, an Annotated[...], a Union...): "
              "typing has no type for 'any annotation'")
CHECKED_TYPES = "the class or classes an upstream-compatible check is asked about (a type, or a list of types)"
LOGGED = "a log call's message and fields: a logger takes any value (structlog's and the stdlib's)"
STRUCTLOG = "structlog's logger objects, which structlog itself types Any (WrappedLogger, get_logger())"
JSON = "JSON data (parsed from a file, an option or a pipe): any JSON value"
PAYLOAD = ("a payload carried as it is: a vendor's descriptor payload, a value pickled to or from a "
           "peer process, what a test's helper returns")
LAZY_NUMPY = ("the lazy numpy module (llmdd._base.lazy): numpy is imported at its first use; typing it "
              "as the numpy module would import numpy wherever it is named")
ARRAY_INPUT = ("an int or an array as the caller gives it (anything numpy takes); numpy's arrays reach "
               "mypy as Any through the lazy module, so no narrowing would hold")
FILEOBJ = ("the link simulator's (llmdd/testing/_linksim.py) selector file object: what the engine hands "
           "its runtime to watch (the real runtime types it as typeshed's FileDescriptorLike, "
           "llmdd/testing/sim as its own sockets, net.Watchable)")
SOCKET_DATA = "what a simulated socket's send takes: any buffer, as socket.send"
STORED = ("a value kept or recorded as it is, whatever its type: an attribute of a worker-local object "
          "(threading.local's), what a simulated API call returned (the simulator's record of the call)")

ALLOWED: dict[tuple[str, str, str], str] = {
    ('llmdd/_api/cache_manager.py', '_tensor_addrs', 'addrs'): USER_VALUE,
    ('llmdd/_api/cache_manager.py', '_tensor_like', 'a'): USER_VALUE,
    ('llmdd/_api/v1/offsets.py', 'allocate_device', '**kwargs'): FORWARDED,
    ('llmdd/_base/lazy.py', '<module>', 'np'): LAZY_NUMPY,
    ('llmdd/_base/log.py', '_Logger.__init__', 'self._real'): STRUCTLOG,
    ('llmdd/_base/log.py', '_Logger.bind', '**kw'): FORWARDED,
    ('llmdd/_base/log.py', '_Logger.critical', '**kw'): FORWARDED,
    ('llmdd/_base/log.py', '_Logger.critical', '*args'): FORWARDED,
    ('llmdd/_base/log.py', '_Logger.critical', 'event'): LOGGED,
    ('llmdd/_base/log.py', '_Logger.debug', '**kw'): FORWARDED,
    ('llmdd/_base/log.py', '_Logger.debug', '*args'): FORWARDED,
    ('llmdd/_base/log.py', '_Logger.debug', 'event'): LOGGED,
    ('llmdd/_base/log.py', '_Logger.error', '**kw'): FORWARDED,
    ('llmdd/_base/log.py', '_Logger.error', '*args'): FORWARDED,
    ('llmdd/_base/log.py', '_Logger.error', 'event'): LOGGED,
    ('llmdd/_base/log.py', '_Logger.exception', '**kw'): FORWARDED,
    ('llmdd/_base/log.py', '_Logger.exception', '*args'): FORWARDED,
    ('llmdd/_base/log.py', '_Logger.exception', 'event'): LOGGED,
    ('llmdd/_base/log.py', '_Logger.info', '**kw'): FORWARDED,
    ('llmdd/_base/log.py', '_Logger.info', '*args'): FORWARDED,
    ('llmdd/_base/log.py', '_Logger.info', 'event'): LOGGED,
    ('llmdd/_base/log.py', '_Logger.log', '**kw'): FORWARDED,
    ('llmdd/_base/log.py', '_Logger.log', '*args'): FORWARDED,
    ('llmdd/_base/log.py', '_Logger.log', 'event'): LOGGED,
    ('llmdd/_base/log.py', '_Logger.new', '**kw'): FORWARDED,
    ('llmdd/_base/log.py', '_Logger.warning', '**kw'): FORWARDED,
    ('llmdd/_base/log.py', '_Logger.warning', '*args'): FORWARDED,
    ('llmdd/_base/log.py', '_Logger.warning', 'event'): LOGGED,
    ('llmdd/_base/log.py', '_render', '_logger'): STRUCTLOG,
    ('llmdd/_base/log.py', 'get_logger', '**initial'): FORWARDED,
    ('llmdd/_base/ranktable.py', '_digits', 'value'): JSON,
    ('llmdd/_base/ranktable.py', '_ip', 'value'): JSON,
    ('llmdd/_base/status.py', 'LLMException.__init__', '*args'): FORWARDED,
    ('llmdd/_base/status.py', 'raise_if_false', '**kwargs'): FORWARDED,
    ('llmdd/_base/status.py', 'raise_if_false', '*args'): FORWARDED,
    ('llmdd/_base/status.py', 'raise_if_true', '**kwargs'): FORWARDED,
    ('llmdd/_base/status.py', 'raise_if_true', '*args'): FORWARDED,
    ('llmdd/_base/validation.py', '_as_list', 'classes'): CHECKED_TYPES,
    ('llmdd/_base/validation.py', 'check_dict', 'arg_value'): USER_VALUE,
    ('llmdd/_base/validation.py', 'check_dict', 'k_class'): CHECKED_TYPES,
    ('llmdd/_base/validation.py', 'check_dict', 'v_class'): CHECKED_TYPES,
    ('llmdd/_base/validation.py', 'check_dict', 'v_inner_class'): CHECKED_TYPES,
    ('llmdd/_base/validation.py', 'check_inner', 'arg_value'): USER_VALUE,
    ('llmdd/_base/validation.py', 'check_inner', 'inner_class'): CHECKED_TYPES,
    ('llmdd/_base/validation.py', 'check_int', 'value'): USER_VALUE,
    ('llmdd/_base/validation.py', 'check_int32', 'value'): USER_VALUE,
    ('llmdd/_base/validation.py', 'check_int64', 'value'): USER_VALUE,
    ('llmdd/_base/validation.py', 'check_isinstance', 'arg_value'): USER_VALUE,
    ('llmdd/_base/validation.py', 'check_isinstance', 'classes'): CHECKED_TYPES,
    ('llmdd/_base/validation.py', 'check_isinstance', 'inner_class'): CHECKED_TYPES,
    ('llmdd/_base/validation.py', 'check_positive_or_set_default', 'value'): USER_VALUE,
    ('llmdd/_base/validation.py', 'check_uint16', 'value'): USER_VALUE,
    ('llmdd/_base/validation.py', 'check_uint32', 'value'): USER_VALUE,
    ('llmdd/_base/validation.py', 'check_uint64', 'value'): USER_VALUE,
    ('llmdd/_base/validation.py', 'check_uint8', 'value'): USER_VALUE,
    ('llmdd/_control/endpoints.py', 'Registrar._run_marked', '*args'): FORWARDED,
    ('llmdd/_control/endpoints.py', 'Registrar.call', '*args'): FORWARDED,
    ('llmdd/_control/endpoints.py', 'Registrar.post', '*args'): FORWARDED,
    ('llmdd/_control/exchange.py', 'LinkExchange._reply', '*args'): FORWARDED,
    ('llmdd/_control/linking.py', 'LinkHost.submit', '*args'): FORWARDED,
    ('llmdd/_control/manager.py', 'LinkManager.submit', '*args'): FORWARDED,
    ('llmdd/_data/notices.py', '_bounds', 'blocks'): USER_VALUE,
    ('llmdd/_data/notices.py', 'block_spans', 'blocks'): USER_VALUE,
    ('llmdd/_data/owner.py', 'OwnerSide._block_spans', 'spans'): PEER_VALUE,
    ('llmdd/_data/owner.py', 'OwnerSide._cache_event', '**info'): FORWARDED,
    ('llmdd/_data/owner.py', 'OwnerSide._consumed', 'cache_id'): PEER_VALUE,
    ('llmdd/_data/owner.py', 'OwnerSide._guard', 'args'): PEER_VALUE,
    ('llmdd/_data/fence.py', 'BlockFence.from_dict', 'value'): USER_VALUE,
    ('llmdd/_data/fence.py', 'FenceTable.serve_check', 'args'): PEER_VALUE,
    ('llmdd/_data/owner.py', 'OwnerSide._serve_consume_key', 'args'): PEER_VALUE,
    ('llmdd/_data/owner.py', 'OwnerSide._serve_fence_check', 'args'): PEER_VALUE,
    ('llmdd/_data/owner.py', 'OwnerSide._serve_peer_note', 'args'): PEER_VALUE,
    ('llmdd/_data/owner.py', 'OwnerSide._serve_reserve_key', 'args'): PEER_VALUE,
    ('llmdd/_data/owner.py', 'OwnerSide._served_record', 'cache_id'): PEER_VALUE,
    ('llmdd/_data/peer_input.py', 'peer_bool', 'value'): PEER_VALUE,
    ('llmdd/_data/peer_input.py', 'peer_bounds', 'bounds'): PEER_VALUE,
    ('llmdd/_data/peer_input.py', 'peer_int', 'value'): PEER_VALUE,
    ('llmdd/_data/peer_input.py', 'peer_key_index', 'args'): PEER_VALUE,
    ('llmdd/_data/peer_input.py', 'peer_range', 'value'): PEER_VALUE,
    ('llmdd/_data/peer_input.py', 'peer_spans', 'spans'): PEER_VALUE,
    ('llmdd/_data/planner.py', '_check_local', 'local'): USER_VALUE,
    ('llmdd/_data/planner.py', '_check_pair', 'dst_tensors'): USER_VALUE,
    ('llmdd/_data/planner.py', '_check_pair', 'src_tensors'): USER_VALUE,
    ('llmdd/_data/planner.py', '_check_tensors', 'tensors'): USER_VALUE,
    ('llmdd/_data/planner.py', '_check_unit', 'unit'): USER_VALUE,
    ('llmdd/_data/planner.py', '_emit', 'dst_off'): ARRAY_INPUT,
    ('llmdd/_data/planner.py', '_emit', 'length'): ARRAY_INPUT,
    ('llmdd/_data/planner.py', '_emit', 'src_off'): ARRAY_INPUT,
    ('llmdd/_data/planner.py', '_int', 'value'): USER_VALUE,
    ('llmdd/_data/planner.py', '_raw_dst', 'dst'): USER_VALUE,
    ('llmdd/_data/planner.py', '_region_ids', 'value'): USER_VALUE,
    ('llmdd/_data/planner.py', 'plan_to_addresses', 'dst'): USER_VALUE,
    ('llmdd/_extension/dispatch.py', 'ContainedCalls._contain.contained', '**kwargs'): FORWARDED,
    ('llmdd/_extension/dispatch.py', 'ContainedCalls._contain.contained', '*args'): FORWARDED,
    ('llmdd/_lifecycle/machines.py', 'Lifecycle.create', '**info'): FORWARDED,
    ('llmdd/_lifecycle/machines.py', 'Tracked.fire', '**info'): FORWARDED,
    ('llmdd/_lifecycle/machines.py', 'Tracked.offer', '**info'): FORWARDED,
    ('llmdd/_lifecycle/machines.py', 'Tracked.offer_first', '**info'): FORWARDED,
    ('llmdd/_memory/manager.py', '_publishes.wrapper', '**kwargs'): FORWARDED,
    ('llmdd/_memory/manager.py', '_publishes.wrapper', '*args'): FORWARDED,
    ('llmdd/_protocol/codec.py', 'LocalProtocolError.__init__', '*args'): FORWARDED,
    ('llmdd/_protocol/codec.py', 'ProtocolError.__init__', '*args'): FORWARDED,
    ('llmdd/_protocol/handshake.py', '_secret_converter', 'value'): USER_VALUE,
    ('llmdd/_protocol/wire.py', 'InvalidMessage.__init__', '*args'): FORWARDED,
    ('llmdd/_protocol/wire.py', '_check_value', 'v'): WIRE_VALUE,
    ('llmdd/_protocol/wire.py', '_compile', 'tp'): ANNOTATION,
    ('llmdd/_protocol/wire.py', '_compile.check_dict', 'v'): WIRE_VALUE,
    ('llmdd/_protocol/wire.py', '_compile.check_enum', 'v'): WIRE_VALUE,
    ('llmdd/_protocol/wire.py', '_compile.check_exact', 'v'): WIRE_VALUE,
    ('llmdd/_protocol/wire.py', '_compile.check_int', 'v'): WIRE_VALUE,
    ('llmdd/_protocol/wire.py', '_compile.check_sized', 'v'): WIRE_VALUE,
    ('llmdd/_protocol/wire.py', '_compile.check_struct', 'v'): WIRE_VALUE,
    ('llmdd/_protocol/wire.py', '_compile.check_tuple', 'v'): WIRE_VALUE,
    ('llmdd/_protocol/wire.py', '_compile.fast', 'v'): WIRE_VALUE,
    ('llmdd/_protocol/wire.py', '_meta_of', 'tp'): ANNOTATION,
    ('llmdd/_protocol/wire.py', 'bytes_len.check', '_inst'): VALIDATOR_INSTANCE,
    ('llmdd/_protocol/wire.py', 'bytes_len.check', 'value'): WIRE_VALUE,
    ('llmdd/_protocol/wire.py', 'check_descriptor', 'value'): WIRE_VALUE,
    ('llmdd/_protocol/wire.py', 'int_in.check', '_inst'): VALIDATOR_INSTANCE,
    ('llmdd/_protocol/wire.py', 'int_in.check', 'value'): WIRE_VALUE,
    ('llmdd/_runtime/ioloop.py', 'IoLoop._call', '*args'): FORWARDED,
    ('llmdd/_runtime/ioloop.py', 'IoLoop.call_later', '*args'): FORWARDED,
    ('llmdd/_runtime/ioloop.py', 'IoLoop.call_soon', '*args'): FORWARDED,
    ('llmdd/_runtime/runtime.py', 'Executor.submit', '*args'): FORWARDED,
    ('llmdd/_runtime/runtime.py', 'Runtime.call_later', '*args'): FORWARDED,
    ('llmdd/_runtime/runtime.py', 'Runtime.call_soon', '*args'): FORWARDED,
    ('llmdd/_seam/abc.py', '_capability', 'value'): USER_VALUE,
    ('llmdd/_seam/abc.py', '_name', 'value'): USER_VALUE,
    ('llmdd/_seam/abc.py', '_payload', 'value'): USER_VALUE,
    ('llmdd/_seam/abc.py', '_u32', 'value'): USER_VALUE,
    ('llmdd/_seam/completions.py', 'submitted', '*args'): FORWARDED,
    ('llmdd/_seam/errors.py', '_TypedTransportError.__init__', '*args'): FORWARDED,
    ('llmdd/_seam/ops.py', 'as_ops', 'ops'): ARRAY_INPUT,
    ('llmdd/_seam/payload.py', 'encode_payload', 'fields'): PAYLOAD,
    ('llmdd/_tools/bench/runner.py', 'Peer.call', '**kwargs'): FORWARDED,
    ('llmdd/_tools/bench/runner.py', 'Peer.send', '**kwargs'): FORWARDED,
    ('llmdd/_tools/bench/targets.py', 'lookup', 'results'): JSON,
    ('llmdd/_tools/cli/doctor.py', '_fmt_limit', 'value'): JSON,
    ('llmdd/_tools/demo/runner.py', '_Child.call', '**args'): FORWARDED,
    ('llmdd/_tools/demo/runner.py', '_Child.send', '**args'): FORWARDED,
    ('llmdd/_tools/doctor/child.py', '_decode', 'value'): JSON,
    ('llmdd/_tools/doctor/child.py', '_encode', 'value'): JSON,
    ('llmdd/_tools/doctor/report.py', '_jsonable', 'value'): JSON,
    ('llmdd/testing/_calls.py', '_CallPickler.reducer_override', 'obj'): PAYLOAD,
    ('llmdd/testing/_conformance.py', 'check_two_processes.remote', 'arg'): PAYLOAD,
    ('llmdd/testing/_harness.py', 'Cluster.__exit__', '*exc_info'): FORWARDED,
    ('llmdd/testing/_harness.py', 'PeerFuture.__init__', 'self._value'): PAYLOAD,
    ('llmdd/testing/_harness.py', 'PeerFuture._set_result', 'value'): PAYLOAD,
    ('llmdd/testing/_harness.py', 'PeerHandle.__exit__', '*exc_info'): FORWARDED,
    ('llmdd/testing/_harness.py', 'PeerHandle.call', '**kwargs'): FORWARDED,
    ('llmdd/testing/_harness.py', 'PeerHandle.call', '*args'): FORWARDED,
    ('llmdd/testing/_harness.py', 'PeerHandle.call_async', '**kwargs'): FORWARDED,
    ('llmdd/testing/_harness.py', 'PeerHandle.call_async', '*args'): FORWARDED,
    ('llmdd/testing/_linksim.py', 'SimLoop.call_later', '*args'): FORWARDED,
    ('llmdd/testing/_linksim.py', 'SimLoop.call_soon', '*args'): FORWARDED,
    ('llmdd/testing/_linksim.py', 'SimLoop.forget', 'fileobj'): FILEOBJ,
    ('llmdd/testing/_linksim.py', 'SimLoop.set_events', 'fileobj'): FILEOBJ,
    ('llmdd/testing/_linksim.py', 'SimPool.submit', '*args'): FORWARDED,
    ('llmdd/testing/_linksim.py', 'SimSocket.send', 'data'): SOCKET_DATA,
    ('llmdd/testing/_linksim.py', 'SimSocket.sendall', 'data'): SOCKET_DATA,
    ('llmdd/testing/_linksim.py', 'SimSocket.setsockopt', '*args'): FORWARDED,
    ('llmdd/testing/_linksim.py', 'World.unwatch', 'fileobj'): FILEOBJ,
    ('llmdd/testing/_linksim.py', 'World.watch', 'fileobj'): FILEOBJ,
    ('llmdd/testing/_linksim.py', 'World.watched_by', 'fileobjs'): FILEOBJ,
    ('llmdd/testing/_proxy.py', 'LoopbackProxy.__exit__', '*exc_info'): FORWARDED,
    ('llmdd/utils/log.py', 'error', '**kwargs'): FORWARDED,
    ('llmdd/utils/log.py', 'error', '*args'): FORWARDED,
    ('llmdd/utils/log.py', 'error', 'msg'): LOGGED,
    ('llmdd/utils/log.py', 'info', '**kwargs'): FORWARDED,
    ('llmdd/utils/log.py', 'info', '*args'): FORWARDED,
    ('llmdd/utils/log.py', 'info', 'msg'): LOGGED,
    ('llmdd/utils/log.py', 'warn', '**kwargs'): FORWARDED,
    ('llmdd/utils/log.py', 'warn', '*args'): FORWARDED,
    ('llmdd/utils/log.py', 'warn', 'msg'): LOGGED,
    # issue 38's runtime seam (llmdd/_runtime) and its simulators (llmdd/testing/sim, llmdd/testing/_linksim)
    ('llmdd/_runtime/runtime.py', 'Condition.__exit__', '*exc'): FORWARDED,
    ('llmdd/_runtime/runtime.py', 'Lock.__exit__', '*exc'): FORWARDED,
    ('llmdd/_runtime/runtime.py', 'Threads.start_worker', '*args'): FORWARDED,
    ('llmdd/_runtime/threads.py', 'Pool.submit', '*args'): FORWARDED,
    ('llmdd/_runtime/threads.py', 'Strand.submit', '*args'): FORWARDED,
    ('llmdd/_runtime/threads.py', 'SystemThreads.start_worker', '*args'): FORWARDED,
    ('llmdd/_seam/completions.py', 'CompletionThreads.start_worker', '*args'): FORWARDED,
    ('llmdd/lowlevel.py', 'ThreadCompletion.__init__', '**kwargs'): FORWARDED,
    ('llmdd/testing/_linksim.py', 'SimLoop.start_worker', '*args'): FORWARDED,
    ('llmdd/testing/sim/invariants.py', 'Call', 'result'): STORED,
    ('llmdd/testing/sim/net.py', 'SimSocket.setsockopt', '*args'): FORWARDED,
    ('llmdd/testing/sim/primitives.py', 'SimCondition.__exit__', '*exc'): FORWARDED,
    ('llmdd/testing/sim/primitives.py', 'SimLocal.__setattr__', 'value'): STORED,
    ('llmdd/testing/sim/primitives.py', 'SimLock.__exit__', '*exc'): FORWARDED,
    ('llmdd/testing/sim/runtime.py', 'SimPool.submit', '*args'): FORWARDED,
    ('llmdd/testing/sim/runtime.py', 'SimRuntime.call_later', '*args'): FORWARDED,
    ('llmdd/testing/sim/runtime.py', 'SimRuntime.call_soon', '*args'): FORWARDED,
    ('llmdd/testing/sim/runtime.py', 'SimRuntime.start_worker', '*args'): FORWARDED,
    ('llmdd/testing/sim/simbackend.py', 'WorldClock.call_later', '*args'): FORWARDED,
    ('llmdd/testing/sim/world.py', 'World.spawn', '*args'): FORWARDED,
}

#: keys found more than once (nested functions of one name in one scope)
REPEATED = {("llmdd/_protocol/wire.py", "_compile.fast", "v"): 3}


def _is_any(annotation: ast.expr) -> bool:
    return ((isinstance(annotation, ast.Name) and annotation.id == "Any")
            or (isinstance(annotation, ast.Attribute) and annotation.attr == "Any")
            or (isinstance(annotation, ast.Constant) and annotation.value == "Any"))


def scan(tree: ast.Module) -> list[tuple[str, str]]:
    """(qualified scope, name) of each ``Any`` annotation of a parameter (``*args``, ``**kw`` with their
    stars), an attribute (``self.x: Any``) or a module or class variable in ``tree``."""
    found: list[tuple[str, str]] = []

    def visit(node: ast.AST, scope: list[str], in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, scope + [child.name], False)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = ".".join(scope + [child.name])
                args = child.args
                for arg in args.posonlyargs + args.args + args.kwonlyargs:
                    if arg.annotation is not None and _is_any(arg.annotation):
                        found.append((name, arg.arg))
                for arg, star in ((args.vararg, "*"), (args.kwarg, "**")):
                    if arg is not None and arg.annotation is not None and _is_any(arg.annotation):
                        found.append((name, star + arg.arg))
                visit(child, scope + [child.name], True)
            elif isinstance(child, ast.AnnAssign) and _is_any(child.annotation):
                if not (in_function and isinstance(child.target, ast.Name)):   # a local variable
                    found.append((".".join(scope) or "<module>", ast.unparse(child.target)))
            else:
                visit(child, scope, in_function)

    visit(tree, [], False)
    return found


def found_in_llmdd() -> collections.Counter:
    found: collections.Counter = collections.Counter()
    for path in sorted((ROOT / "llmdd").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for scope, name in scan(ast.parse(path.read_text(encoding="utf-8"), filename=rel)):
            found[(rel, scope, name)] += 1
    return found


def test_every_any_of_llmdd_is_listed_with_its_reason_and_nothing_else_is():
    found = found_in_llmdd()
    allowed = collections.Counter({key: REPEATED.get(key, 1) for key in ALLOWED})
    new = sorted((found - allowed).elements())
    gone = sorted((allowed - found).elements())
    assert not new, ("typed Any and not listed: give each its real type (a Protocol where a layer must not "
                     "import the other), or list it in ALLOWED with its reason:\n  " + "\n  ".join(map(repr, new)))
    assert not gone, "listed in ALLOWED but no longer Any: take them off the list:\n  " + "\n  ".join(map(repr, gone))
    assert sum(found.values()) == len(ALLOWED) + sum(n - 1 for n in REPEATED.values())


def test_no_collaborator_is_left_any():
    """No listed reason is a collaborator's: each entry names one of the reasons above."""
    reasons = {FORWARDED, USER_VALUE, PEER_VALUE, WIRE_VALUE, VALIDATOR_INSTANCE, ANNOTATION, CHECKED_TYPES,
               LOGGED, STRUCTLOG, JSON, PAYLOAD, LAZY_NUMPY, ARRAY_INPUT, FILEOBJ, SOCKET_DATA, STORED}
    assert set(ALLOWED.values()) <= reasons
    assert all(key[2].startswith("*") for key, why in ALLOWED.items() if why == FORWARDED)
    assert all(not key[2].startswith("*") for key, why in ALLOWED.items() if why != FORWARDED)


SAMPLE = '''
from typing import Any
import typing

X: Any = None

class Link:
    peer: typing.Any
    def __init__(self, channel: Any, n: int, *args: Any, **kw: "Any") -> None:
        self.channel: Any = channel
        local: Any = n
        def inner(v: Any) -> Any:
            return v
'''


def test_the_scan_finds_each_kind_of_any_and_skips_locals_and_returns():
    """The control: a planted source with every kind of annotation the scan must see (and a local and a
    return it must not)."""
    assert sorted(scan(ast.parse(SAMPLE))) == sorted([
        ("<module>", "X"), ("Link", "peer"), ("Link.__init__", "channel"), ("Link.__init__", "*args"),
        ("Link.__init__", "**kw"), ("Link.__init__", "self.channel"), ("Link.__init__.inner", "v")])
    # and the check itself fails on a new one
    found = collections.Counter({("llmdd/x.py", scope, name): 1 for scope, name in scan(ast.parse(SAMPLE))})
    assert found - collections.Counter({key: 1 for key in ALLOWED})
