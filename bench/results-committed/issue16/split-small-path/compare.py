import glob, json, os, statistics, sys
root = sys.argv[1]
runs = {}
for path in sorted(glob.glob(os.path.join(root, "small-*", "results.json"))):
    tree = os.path.basename(os.path.dirname(path)).split("-")[1]
    d = json.load(open(path))
    for p, rows in d["summary"].items():
        for row, v in rows.items():
            runs.setdefault((p, row), {}).setdefault(tree, []).extend(v["ratios"])
print("| path | row | base 51dbb05: median of 6 ratios | split HEAD: median of 6 ratios | split / base |")
print("|---|---|---|---|---|")
for (p, row), t in sorted(runs.items()):
    a, b = statistics.median(t["orig"]), statistics.median(t["head"])
    print(f"| {p} | {row} | {a:.2f}x | {b:.2f}x | {b / a:.3f} |")
