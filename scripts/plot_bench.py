#!/usr/bin/env python3
"""Plot `epx bench --json` results.

Reads one or more bench JSON files (schema "epx-bench/1") and writes PNGs:
  latency_<op>.png    median CUDA-graph latency vs tokens per rank, one line per backend
  bandwidth_<op>.png  crossing bandwidth per rank (after per-rank dedup) vs tokens per rank
for op in dispatch, combine. Several files are merged, each line labelled with the file it came
from. Only records with status "ok" are plotted; the others are listed on stderr.

    python3 scripts/plot_bench.py bench.json [more.json ...] --out-dir plots/
"""

import argparse
import json
import os
import sys
from collections import defaultdict

OPS = ("dispatch", "combine")


def load(path):
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    schema = doc.get("schema", "")
    if not schema.startswith("epx-bench/"):
        sys.exit(f"plot_bench: {path}: schema = {schema!r}, expected an `epx bench --json` file")
    return doc


def describe(doc):
    s = doc["shape"]
    return (f"{doc['machine']['gpu_name']}, world {doc['world']['ranks']}, H {s['hidden']}, "
            f"E {s['experts']}, K {s['topk']}, {s['dtype']}, {s['layout']}, {s['routing']}")


def collect(docs, paths, mode):
    """(op, label) -> sorted [(tokens, median_us, crossing_gbps_per_rank)]."""
    distinct = len(docs) > 1
    series = defaultdict(list)
    skipped = defaultdict(set)
    for doc, path in zip(docs, paths):
        for r in doc["results"]:
            if r["mode"] != mode:
                continue
            # in-process documents carry both launch modes: plot one launch per GPU
            # (older documents and process worlds have per-rank launches only)
            if r.get("launch", "per_rank") == "per_rank" and any(
                    x.get("launch") == "one_per_gpu" for x in doc["results"]):
                continue
            if r["status"] != "ok":
                skipped[(os.path.basename(path), r["backend"], r["status"])].add(
                    r["tokens_per_rank"])
                continue
            label = r["backend"]
            if distinct:
                label += f" ({os.path.basename(path)})"
            series[(r["op"], label)].append(
                (r["tokens_per_rank"], r["median_us"], r["crossing_gbps_per_rank"]))
    for (name, backend, status), tokens in sorted(skipped.items()):
        print(f"plot_bench: {name}: {backend} {status} at tokens/rank "
              f"{', '.join(map(str, sorted(tokens)))}; not plotted", file=sys.stderr)
    return {k: sorted(v) for k, v in series.items()}


def floors(docs):
    """op -> sorted [(tokens, floor_us)] of the first file (the same for every backend)."""
    out = defaultdict(list)
    for v in docs[0].get("volumes", []):
        for op in OPS:
            out[op].append((v["tokens_per_rank"], v[op]["floor_us"]))
    return {op: sorted(v) for op, v in out.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="epx bench --json outputs")
    ap.add_argument("--out-dir", default="plots", help="folder for the PNGs (default: plots)")
    ap.add_argument("--mode", choices=("graph", "eager"), default="graph",
                    help="which timing mode to plot (default: graph)")
    args = ap.parse_args()

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        sys.exit("plot_bench: needs matplotlib (pip install matplotlib, or apt-get install "
                 "python3-matplotlib)")

    docs = [load(p) for p in args.files]
    series = collect(docs, args.files, args.mode)
    if not series:
        sys.exit(f"plot_bench: no record with status ok in mode {args.mode}; nothing to plot")
    os.makedirs(args.out_dir, exist_ok=True)
    title = describe(docs[0]) if len({describe(d) for d in docs}) == 1 else "several setups"
    floor = floors(docs)
    written = []
    for op in OPS:
        for kind, ylabel, idx in (("latency", f"median {args.mode} latency (µs)", 1),
                                  ("bandwidth", "crossing bandwidth per rank (GB/s)", 2)):
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for (sop, label), pts in sorted(series.items()):
                if sop != op:
                    continue
                ax.plot([p[0] for p in pts], [p[idx] for p in pts], marker="o", label=label)
            if kind == "latency" and floor.get(op):
                ax.plot([p[0] for p in floor[op]], [p[1] for p in floor[op]], linestyle="--",
                        color="gray", label="HBM copy floor")
            ax.set_xscale("log", base=2)
            ticks = sorted({p[0] for (sop, _), pts in series.items() if sop == op for p in pts})
            ax.set_xticks(ticks)
            ax.set_xticklabels([str(t) for t in ticks])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            if kind == "latency":
                ax.set_yscale("log")
            ax.set_xlabel("tokens per rank")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{op}: {title}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            path = os.path.join(args.out_dir, f"{kind}_{op}.png")
            fig.savefig(path, dpi=120)
            plt.close(fig)
            written.append(path)
    for p in written:
        print(p)


if __name__ == "__main__":
    main()
