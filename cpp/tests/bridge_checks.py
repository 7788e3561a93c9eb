"""Checks of the bridge's pure rules (no engine): status codes as uint32 (a code the header does not
name passes as it is), inclusive C++ layer ranges to half-open Python ranges, OPTION_BUF_POOL_CFG,
IPv4 and device-id rules, role refusals.  Run by ctest; exits non-zero on the first failure."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import llmdd_cpp_bridge as b  # noqa: E402
from llmdd import LLMException, LLMStatusCode  # noqa: E402


def status_of(fn, *args):
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - the code is what is checked
        return b._code(exc)
    return 0


def main() -> None:
    S = LLMStatusCode
    # statuses keep their uint32 values, named or not
    for member in S:
        got = b._code(LLMException("x", status_code=member))
        assert got == member.value & 0xFFFFFFFF, (member, got)
    assert b._code(LLMException("x", status_code=S.LLM_ENGINE_FINALIZED)) == 0x5010B006
    assert b._code(LLMException("x", status_code=S.LLM_UNKNOWN_ERROR)) == 0xFFFFFFFF
    assert b._code(TypeError()) == b._code(ValueError()) == S.LLM_PARAM_INVALID.value
    assert b._code(RuntimeError()) == 0xFFFFFFFF
    # inclusive (first, last) -> range(first, last + 1); {-1,-1} (or either side -1) -> every layer
    assert b._check_ext((0, 0), (1, 1), 2, False) == (range(0, 1), range(1, 2))
    assert b._check_ext((1, 3), (0, 2), 2, True) == (range(1, 4), range(0, 3))
    assert b._check_ext((-1, -1), (-1, -1), 2, True) == (None, None)
    assert b._check_ext((2, 2), (-1, -1), 2, False) == (None, None)
    for bad in (((2, 1), (0, 0), 2, False), ((-2, 0), (0, 0), 2, False), ((0, 0), (0, 0), 0, False),
                ((0, 1), (0, 3), 2, True), ((0, 0), (-1, -1), 2, True)):
        assert status_of(b._check_ext, *bad) == S.LLM_PARAM_INVALID.value, bad
    # OPTION_BUF_POOL_CFG
    assert b._pool_size('{"buf_pool_size": 1024}') == 1024
    assert b._pool_size('{"buf_cfg":[{"total_size":2097152,"blk_size":256,"max_buf_size":8192}]}') == 0
    for bad in ("", "{}", "[]", "{", '{"buf_pool_size": 0}', '{"buf_pool_size": true}', '{"buf_pool_size": 1.5}',
                '{"buf_pool_size": 9223372036854775808}', '{"buf_cfg": {}}', '{"buf_cfg": [1]}',
                '{"buf_cfg": [{"total_size": 1, "blk_size": 1, "max_buf_size": 1, "x": 1}]}'):
        assert status_of(b._pool_size, bad) == S.LLM_PARAM_INVALID.value, bad
    # addresses
    assert b._ipv4("10.0.0.255", "ip") == "10.0.0.255"
    for bad in ("", "1.2.3", "1.2.3.4.5", "256.1.1.1", "a.b.c.d", "localhost", " 1.2.3.4", "1.2.3.0004"):
        assert status_of(b._ipv4, bad, "ip") == S.LLM_PARAM_INVALID.value, bad
    assert b._listen("127.0.0.1:0") == "127.0.0.1:0"
    for bad in ("127.0.0.1", "127.0.0.1:", ":80", "127.0.0.1:65536", "127.0.0.1:8:8"):
        assert status_of(b._listen, bad) == S.LLM_PARAM_INVALID.value, bad
    # roles: a prompt does not pull, a decoder does not push, a mix engine does both
    prompt, decoder, mix = b.Bridge(1, 1), b.Bridge(2, 2), b.Bridge(3, 3)
    assert status_of(prompt._check_role, b._PULLERS, "PullKvBlocks") == S.LLM_PARAM_INVALID.value
    assert status_of(decoder._check_role, b._PUSHERS, "PushKvBlocks") == S.LLM_PARAM_INVALID.value
    assert status_of(mix._check_role, b._PULLERS, "PullKvBlocks") == 0
    assert status_of(mix._check_role, b._PUSHERS, "PushKvBlocks") == 0
    # before Initialize every call answers LLM_FAILED, as a (status, message, value) triple
    assert decoder.pull_blocks((1, 1, 0), 1, [0], [0], ((-1, -1), (-1, -1), 2))[0] == 0xFFFFFFFF
    print("bridge checks: passed")


if __name__ == "__main__":
    main()
