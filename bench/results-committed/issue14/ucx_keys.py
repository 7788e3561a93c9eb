"""What a linked ucx peer can reach with the owner's NIXL metadata (issue 14, item 4).

Run: python bench/results-committed/issue14/ucx_keys.py (output: ucx_keys.txt).  Two processes on one
host: the owner registers a remote-accessible region, a region that is NOT remote-accessible, and keeps
a buffer it never registers; the "attacker" connects with what every linked peer receives (the owner's describe() and
both regions' descriptors, their keys loaded into NIXL) and then calls NIXL itself, going around the llmdd channel's checks.  Last, the
llmdd channel is asked for the non-accessible region (it must refuse).
"""
import multiprocessing as mp, time, sys, os
import numpy as np

SIZE = 1 << 16

def owner(conn):
    from llmdd.lowlevel import MemRegion
    from llmdd_ucx import UcxTransport
    ep = UcxTransport({}).open_endpoint()
    rng = np.random.default_rng(14)
    bufs = {n: rng.integers(0, 256, SIZE, dtype=np.uint8) for n in ("acc", "noacc", "unreg")}
    d_acc = ep.register(MemRegion(region_id=1, addr=bufs["acc"].ctypes.data, size=SIZE, remote_accessible=True, placement=0))
    d_no = ep.register(MemRegion(region_id=2, addr=bufs["noacc"].ctypes.data, size=SIZE, remote_accessible=False, placement=0))
    conn.send({"desc": ep.describe(), "acc": d_acc, "noacc": d_no, "unreg_addr": bufs["unreg"].ctypes.data,
               "want": {k: v[:64].tobytes() for k, v in bufs.items()}})
    conn.recv()
    ep.close()

def attacker(conn):
    from llmdd.lowlevel import MemRegion
    from llmdd_ucx import UcxTransport
    info = conn.recv()
    ep = UcxTransport({}).open_endpoint()
    dst = np.zeros(SIZE, np.uint8)
    ep.register(MemRegion(region_id=9, addr=dst.ctypes.data, size=SIZE, remote_accessible=False, placement=0))
    ch = ep.connect(info["desc"], timeout=10)
    agent, peer = ep.agent, ch.peer_name
    # everything a linked peer is sent: the description above and both regions' descriptors, whose
    # remote keys (where present) are loaded into NIXL as the channel would
    from llmdd_ucx import region_fields
    fields = {k: region_fields(info[k]) for k in ("acc", "noacc")}
    for d in fields.values():
        if d.metadata:
            agent.add_remote_agent(d.metadata)
    out_keys = {"key sent for the remote-accessible region": bool(fields["acc"].metadata),
                "key sent for the region NOT remote-accessible": bool(fields["noacc"].metadata)}
    out = dict(out_keys)
    for what, addr in (("remote-accessible region", fields["acc"].addr), ("region NOT remote-accessible", fields["noacc"].addr),
                       ("memory never registered", info["unreg_addr"])):
        dst[:] = 0
        try:
            l = agent.get_xfer_descs(np.array([[dst.ctypes.data, 64, 0]], dtype=np.uint64), "DRAM")
            r = agent.get_xfer_descs(np.array([[addr, 64, 0]], dtype=np.uint64), "DRAM")
            h = agent.initialize_xfer("READ", l, r, peer)
            st = agent.transfer(h)
            t0 = time.monotonic()
            while st == "PROC" and time.monotonic() - t0 < 10:
                st = agent.check_xfer_state(h); time.sleep(0.001)
            agent.release_xfer_handle(h)
            key = {"remote-accessible region": "acc", "region NOT remote-accessible": "noacc", "memory never registered": "unreg"}[what]
            out[what] = f"state {st}, bytes match owner: {dst[:64].tobytes() == info['want'][key]}"
        except Exception as exc:
            out[what] = f"refused by NIXL: {type(exc).__name__}: {str(exc)[:120]}"
    # the llmdd channel itself, given the non-accessible region's descriptor
    from llmdd.lowlevel import make_ops
    try:
        ch.add_remote_region(2, SIZE, info["noacc"])
        # the seam's one refusal path (issue 17): the refusal is the completion's error, never raised
        c = ch.read(make_ops(9, 0, 2, 0, 64), deadline=time.monotonic() + 5); c.wait(10)
        err = c.error
        out["llmdd channel, region NOT remote-accessible"] = (f"refused: {type(err).__name__}: {err}" if err is not None
                                                              else f"moved, bytes: {dst[:64].tobytes().hex()}")
    except Exception as exc:
        out["llmdd channel, region NOT remote-accessible"] = f"raised: {type(exc).__name__}: {exc}"
    out["ucx tls"] = os.environ.get("UCX_TLS", "(default)")
    conn.send(out)
    ch.close(); ep.close()

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    a1, a2 = ctx.Pipe(); b1, b2 = ctx.Pipe()
    po = ctx.Process(target=owner, args=(a2,)); pa = ctx.Process(target=attacker, args=(b2,))
    po.start(); pa.start()
    info = a1.recv(); b1.send(info)
    res = b1.recv()
    for k, v in res.items(): print(f"{k}: {v}")
    a1.send("done"); po.join(30); pa.join(30)
