"""Per-pull CPU / context switches / syscalls of prompt and decoder threads during one-block tcp pulls."""
import multiprocessing as mp, os, sys, time, subprocess, json
from llmdd._bench.common import KiB, MiB
from llmdd._bench.runner import DECODER, NUM_TENSORS, PROMPT, SALT_PROMPT, close_all, start_peers
BB = 64 * KiB
HZ = os.sysconf("SC_CLK_TCK")

def snap(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            st = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            status = open(f"/proc/{pid}/task/{tid}/status").read()
            v = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
            nv = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
            out[tid] = (comm, (int(st[11]) + int(st[12])) / HZ, v, nv)
        except (OSError, IndexError):
            pass
    return out

def diff(a, b, n):
    rows = []
    for tid, (comm, cpu, v, nv) in b.items():
        c0, v0, nv0 = (a[tid][1:] if tid in a else (0, 0, 0))
        d = (cpu - c0, v - v0, nv - nv0)
        if any(d):
            rows.append(f"   {tid:>7} {comm:<16} cpu/pull {d[0] / n * 1e6:7.1f} us  vcs/pull {d[1] / n:5.2f}  nvcs/pull {d[2] / n:5.2f}")
    return rows

def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    strace = len(sys.argv) > 2 and sys.argv[2] == "strace"
    kv = 64 * MiB
    nb = kv // NUM_TENSORS // BB
    spawn = mp.get_context("spawn")
    prompt, dec = start_peers(spawn, ["tcp-prompt", "tcp-decoder"], 300)
    try:
        pinfo = prompt.call("init", role="PROMPT", cluster_id=PROMPT, transport="tcp", listen=True)
        dinfo = dec.call("init", role="DECODER", cluster_id=DECODER, transport="tcp")
        for p in (prompt, dec):
            p.call("alloc", nbytes=kv)
            p.call("register_blocks", model_id=10, num_tensors=NUM_TENSORS, num_blocks=nb, block_bytes=BB)
        prompt.call("fill", salt=SALT_PROMPT)
        link = dec.call("link", remote=PROMPT, port=pinfo["port"])
        assert link["status"] == "LLM_SUCCESS", link
        dec.call("latency_pull", remote=PROMPT, model_id=10, remote_model_id=10, num_blocks=nb, n=200, warmup=10)
        pids = {"prompt": pinfo["pid"], "decoder": dinfo["pid"]}
        procs = []
        if strace:
            for name, pid in pids.items():
                procs.append(subprocess.Popen(["strace", "-c", "-f", "-q", "-o", f"/tmp/ab2/strace_{name}.txt", "-p", str(pid)]))
            time.sleep(1.0)
        s0 = {k: snap(p) for k, p in pids.items()}
        r = dec.call("latency_pull", remote=PROMPT, model_id=10, remote_model_id=10, num_blocks=nb, n=n, warmup=0)
        s1 = {k: snap(p) for k, p in pids.items()}
        for p in procs:
            p.send_signal(2); p.wait()
        print(f"min {r['min']:.1f} p50 {r['p50']:.1f} us  p99 {r['p99']:.1f} us  load {open('/proc/loadavg').read().split()[:3]}")
        for k in pids:
            rows = diff(s0[k], s1[k], n)
            tot = sum(float(x.split('cpu/pull')[1].split()[0]) for x in rows)
            print(f" {k}: total cpu/pull {tot:.1f} us")
            print("\n".join(rows))
    finally:
        close_all([dec, prompt])

if __name__ == "__main__":
    main()
