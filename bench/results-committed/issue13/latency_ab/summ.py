import json,glob,sys,statistics as st,collections,os
d=sys.argv[1]; rows=collections.defaultdict(list)
for f in sorted(glob.glob(d+'/*.json')):
    w,i=os.path.basename(f)[:-5].rsplit('_',1)
    j=json.load(open(f)); rr=j['anchors']['tcp_rr_64k']['p50']; t=j['transports']['tcp']['latency_64k']
    rows[w].append((int(i),t['p50'],rr,t['p50']/rr,t['min'],j['load_before'][0]))
for w,v in rows.items():
    v.sort()
    print(f"{w:7} p50 {[round(x[1],1) for x in v]} rr {[round(x[2],1) for x in v]} ratio {[round(x[3],2) for x in v]} load {[x[5] for x in v]}")
    print(f"{'':7} median p50 {st.median(x[1] for x in v):.1f} us, median ratio {st.median(x[3] for x in v):.2f}x, median min {st.median(x[4] for x in v):.1f}")
