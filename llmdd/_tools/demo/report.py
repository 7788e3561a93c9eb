"""The text report of a demo run (returned as lines; the CLI prints them)."""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from llmdd._tools.demo.runner import DemoResult

__all__ = ["format_report", "VERIFIED_LINE", "MISMATCH_LINE"]

#: the line a successful run ends with (tests look for it)
VERIFIED_LINE = "VERIFIED: disaggregated tokens and pulled KV equal the single-process reference bit for bit"
MISMATCH_LINE = "MISMATCH: the disaggregated run differs from the single-process reference"

MiB = 1024 * 1024


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.3f} s"


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "n/a"


def _short(seq: list, n: int = 8) -> str:
    return "[" + ", ".join(map(str, seq[:n])) + (", ..." if len(seq) > n else "") + "]"


def format_report(r: DemoResult) -> list[str]:
    out: list[str] = []
    m, o = r.model, r.options
    tensor_block = m["block_size"] * m["n_kv_heads"] * m["head_dim"] * 4
    out.append("llmdd demo: disaggregated prefill/decode on this machine")
    out.append(f"  model     {m['n_layers']} layers, d_model {m['d_model']}, {m['n_heads']} heads / "
               f"{m['n_kv_heads']} KV heads x {m['head_dim']}, MLP {m['d_ff']}, vocab {m['vocab_size']}, "
               f"float32, seed {m['seed']} (random weights)")
    out.append(f"  prompt    {r.prompt_len} tokens -> KV {r.kv_bytes / MiB:.1f} MiB = {r.prompt_blocks} blocks of "
               f"{m['block_size']} tokens x {2 * m['n_layers']} tensors x {tensor_block // 1024} KiB "
               f"(one blocks cache of {2 * m['n_layers']} tensors, {r.num_blocks} blocks each)")
    out.append(f"  run       mode {o['mode']}, {o['decoders']} decoder(s), transport {o['transport']}, "
               f"faults {o['faults']}, {o['tokens']} tokens, sync_kv_timeout {o['sync_kv_timeout_ms']} ms")
    if o.get("transport_note"):
        out.append(f"  note      {o['transport_note']}")
    ref = r.reference
    out.append(f"  reference one process: prefill {_ms(ref['prefill_s'])}, first decode step "
               f"{_ms(ref['first_step_s'])}, {len(ref['tokens'])} tokens in {_ms(ref['decode_s'])}")
    for p in r.prompts:
        out.append(f"  {p['label']:<9} pid {p['pid']}, cluster 1, listening on {p['listen'][0]}:{p['listen'][1]}")
    pre = r.prefill
    if pre:
        out.append(f"  prefill   {_ms(pre['prefill_s'])} on {pre['prompt']}, written at shuffled blocks "
                   f"{_short(pre['src_blocks'])}")
    for d in r.decoders:
        link = (d.get("links") or [{}])[-1]
        out.append(f"  {d['label']:<9} pid {d['pid']}, cluster {d['cluster_id']}, linked in "
                   f"{_ms(link.get('link_s', 0.0))}, own shuffled blocks {_short(d['table'])}")
    if r.transport:
        out.append(f"  transport {r.transport['name']}: {r.transport['reason']}")

    if r.fault is not None:
        f = r.fault
        out.append("")
        out.append(f"fault: {f['action']}")
        if f.get("cleaned"):
            out.append(f"  removed {len(f['cleaned'])} shared-memory segment(s) the killed prompt left in /dev/shm")
        for d in f["decoders"]:
            if d["failed"]:
                err = d["error"]
                out.append(f"  {d['label']}: pull_blocks(layers {f['after_layers']}..{f['layers'] - 1}) raised "
                           f"{err['type']} status_code={err['status_code']} after {_ms(d['after_s'])}: "
                           f"{err['message']}")
                if d.get("link"):
                    out.append(f"    link state then: {d['link']['state']} (last error: {d['link']['last_error']})")
            else:
                out.append(f"  {d['label']}: the rest of the pull still succeeded in {_ms(d['transfer_s'])} "
                           f"(no framework-visible error: {_why_no_error(f, r)})")
    if r.recovery is not None:
        out.append("recovery:")
        for s in r.recovery["steps"]:
            out.append(f"  - {s}")
        out.append(f"  recovered: {'yes' if r.recovery['recovered'] else 'NO'}")

    out.append("")
    out.append("time to first token (per decoder):")
    for d in r.decoders:
        out.extend("  " + line for line in _ttft_lines(r, d))

    out.append("")
    out.append("tokens:")
    out.append(f"  reference  {_short(ref['tokens'], 16)}")
    for d in r.decoders:
        toks = (d.get("decode") or {}).get("tokens")
        if toks is not None:
            out.append(f"  {d['label']:<10} {_short(toks, 16)} ({len(toks)} generated)")

    out.append("")
    out.append("lifecycle events seen by the hook subscriber (link/task/cache transitions):")
    for label, events in r.events.items():
        counts = Counter(f"{e['machine']}.{e['trigger']}" + ("!" if e["error"] else "") for e in events)
        out.append(f"  {label}: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
    out.append("  link events in order:")
    out.extend("    " + line for line in _link_timeline(r.events.items()))
    if r.fault is not None and r.fault["kind"] == "kill":
        out.append("    (the killed prompt's own events died with it)")

    out.append("")
    if r.corrupted:
        c = r.corrupted
        out.append(f"self-test: flipped byte {c['byte']} of layer {c['layer']} {c['kv']}, token {c['token']}, head "
                   f"{c['head']}, dim {c['dim']} (block {c['block']}) in {c['decoder']}'s pulled KV: "
                   f"0x{c['old']:02x} -> 0x{c['new']:02x}")
    for v in r.verified:
        kv = v["kv"]
        if v["kv_equal"]:
            kv_text = f"KV {kv['bytes'] / MiB:.1f} MiB bit-identical"
        elif kv.get("first"):
            loc = kv["first"]
            kv_text = (f"KV differs in {kv['differing_bytes']} byte(s), first at layer {loc['layer']} {loc['kv']}, "
                       f"token {loc['token']}, head {loc['head']}, dim {loc['dim']}, byte {loc['byte']}")
        else:
            kv_text = f"KV not checked ({kv.get('why', 'no result')})"
        if v["tokens_equal"]:
            tok_text = f"tokens identical ({len(ref['tokens'])}/{len(ref['tokens'])})"
        else:
            tok_text = f"tokens differ from token {v['first_token_diff']} on"
        out.append(f"check {v['decoder']}: {kv_text}; {tok_text}")
    out.append(f"wall time {r.wall_s:.1f} s")
    out.append(VERIFIED_LINE if r.ok else MISMATCH_LINE)
    return out


def _why_no_error(fault: dict, r: DemoResult) -> str:
    if fault["kind"] == "stall" and r.transport.get("name") == "shm":
        return "shm reads a stopped process's memory directly (process_vm_readv); use --transport tcp to see the stall"
    return "the transfer did not need the stopped prompt"


def _ttft_lines(r: DemoResult, d: dict) -> list[str]:
    pre = r.prefill
    decode = d.get("decode") or {}
    first = decode.get("first_step_s", 0.0)
    lines = []
    if "push" in d:
        push = d["push"]
        exposed = max(0.0, push["done_at"] - pre["prefill_end"])
        ttft = pre["prefill_s"] + exposed + first
        lines.append(f"{d['label']}: {_ms(ttft)} = prefill {_ms(pre['prefill_s'])} + transfer not hidden by the "
                     f"prefill {_ms(exposed)} + first decode step {_ms(first)}")
        lines.append(f"  pushed layer by layer with transfer_cache_async while later layers computed: "
                     f"{push['bytes'] / MiB:.1f} MiB ({push['bytes']} B), transfer busy {_ms(push['busy_s'])} "
                     f"-> {_gbps(push['bytes'], push['busy_s'])}; task {push['status']}")
    elif d.get("pull"):
        pull = d["pull"]
        ttft = pre["prefill_s"] + pull["transfer_s"] + first
        lines.append(f"{d['label']}: {_ms(ttft)} = prefill {_ms(pre['prefill_s'])} + transfer (pull_blocks) "
                     f"{_ms(pull['transfer_s'])} + first decode step {_ms(first)}")
        lines.append(f"  moved {pull['bytes'] / MiB:.1f} MiB ({pull['bytes']} B) in {_ms(pull['transfer_s'])} "
                     f"-> {_gbps(pull['bytes'], pull['transfer_s'])}")
    if decode.get("first_token_at") and pre.get("prefill_start"):
        e2e = decode["first_token_at"] - pre["prefill_start"]
        lines.append(f"  end to end, control messages included: {_ms(e2e)}; "
                     f"{len(decode.get('tokens', []))} tokens decoded in {_ms(decode['decode_s'])}")
    return lines


def _link_timeline(items: Iterable) -> list[str]:
    rows = []
    for label, events in items:
        for e in events:
            if e["machine"] == "link":
                rows.append((e["at"], label, e))
    rows.sort(key=lambda x: x[0])
    if not rows:
        return ["(none)"]
    t0 = rows[0][0]
    out = []
    for at, label, e in rows:
        peer = e["info"].get("peer", e["id"])
        extra = ""
        if e["info"].get("transport"):
            extra += f" transport={e['info']['transport']}"
        if e["error"]:
            extra += f" error={e['error']}"
        out.append(f"+{(at - t0) * 1000:8.1f} ms  {label:<10} peer {peer}: {e['source']} -> {e['dest']} "
                   f"({e['trigger']}){extra}")
    return out
