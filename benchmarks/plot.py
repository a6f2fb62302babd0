"""TFLOP/s against seqlen, one panel per (head dim, causal), as the FlashAttention-3 paper draws it.

Reads the rows bench_attention.py measures (or writes with --json); matplotlib is an optional
extra (`pip install matplotlib`), needed only here.
"""

from __future__ import annotations


def plot_rows(rows, path: str, title: str = "") -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    head_dims = sorted({r["head_dim"] for r in rows})
    causals = sorted({r["causal"] for r in rows})
    runners = list(dict.fromkeys(name for r in rows for name in r["results"]))
    fig, axes = plt.subplots(len(causals), len(head_dims), squeeze=False, sharey=True,
                             figsize=(3.6 * len(head_dims), 2.9 * len(causals)))
    for i, causal in enumerate(causals):
        for j, d in enumerate(head_dims):
            ax = axes[i][j]
            cell = sorted((r for r in rows if r["head_dim"] == d and r["causal"] == causal),
                          key=lambda r: r["seqlen"])
            seqlens = [r["seqlen"] for r in cell]
            for name in runners:
                points = [(k, r["results"].get(name, {}).get("tflops")) for k, r in enumerate(cell)]
                points = [(k, t) for k, t in points if t]
                if points:
                    fa3 = not name.startswith(("sdpa", "fa4"))
                    ax.plot(*zip(*points), marker="o", markersize=3, label=name,
                            linewidth=1.8 if fa3 else 1.2, linestyle="-" if fa3 else "--")
            ax.set_xticks(range(len(seqlens)), [f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
            ax.set_title(f"d={d}, {'causal' if causal else 'non-causal'}", fontsize=9)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("TFLOP/s")
            if i == len(causals) - 1:
                ax.set_xlabel("seqlen")
    axes[0][0].legend(fontsize=7, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
