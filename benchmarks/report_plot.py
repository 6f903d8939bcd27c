"""The benchmark's PNG: throughput per engine and dtype (a dot per round), batch-1 against its bandwidth
ceiling, and the servers' TTFT and ITL against concurrency.

Owns the drawing only; the numbers come from report.add_summary (result["rows"], result["batch1"]).
"""
from __future__ import annotations

from pathlib import Path


def _color(label: str) -> str:
    if label.startswith("compute"):
        return "tab:gray"
    if "vLLM" in label:
        return "tab:orange"
    if "llama.cpp" in label:
        return "tab:purple"
    return "tab:green" if "transformers" in label else "tab:blue"


def _bars(ax, rows: list[dict], key: str, title: str, xlabel: str) -> None:
    """Horizontal bars of rows[i][key], a black dot per round (the bar is the median round)."""
    bars = ax.barh([r["name"] for r in rows], [r[key] for r in rows], color=[_color(r["name"]) for r in rows])
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    for y, r in enumerate(rows):
        rates = r.get("round_tokens_per_s") or []
        ax.plot(rates, [y] * len(rates), "k.", markersize=5)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.tick_params(axis="y", labelsize=8)
    ax.set_title(title, fontsize=10)


def plot(result: dict, path: Path) -> None:
    """Write the four panels to `path` (PNG, matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from report import _ok, _p

    fig, axes = plt.subplots(2, 2, figsize=(18, 11), gridspec_kw={"width_ratios": [2.2, 1]})
    rows = [r for r in result["rows"] if r["output_tokens_per_s"]]
    _bars(axes[0][0], rows, "output_tokens_per_s", "Throughput (dots: the rounds, bar: the median round)",
          "output tokens / s")
    b1 = [r for r in result.get("batch1") or [] if r["decode_tokens_per_s"]]
    _bars(axes[1][0], b1, "decode_tokens_per_s", "Batch-1 decode (x: the read-bandwidth ceiling, same run)",
          "decode tokens / s")
    for y, r in enumerate(b1):
        if r["ceiling_tokens_per_s"]:
            axes[1][0].plot([r["ceiling_tokens_per_s"]], [y], "rx", markersize=9)
    for server, label, color in (("ours_server", "ours", "tab:blue"), ("vllm_server", "vLLM", "tab:orange")):
        levels = (_ok(result["phases"], server) or {}).get("levels", [])
        cs = [lv["concurrency"] for lv in levels]
        axes[0][1].plot(cs, [_p(lv["ttft_s"], "p50") for lv in levels], "o-", color=color, label=label)
        axes[1][1].plot(cs, [_p(lv["itl_s"], "p50", 1e3) for lv in levels], "o-", color=color, label=label)
    for ax, title in ((axes[0][1], "Servers: TTFT p50 (s)"), (axes[1][1], "Servers: ITL p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title, fontsize=10)
        ax.legend()
    w, m, c = result["workload"], result["machine"], result["config"]
    cpu = m["cpu"]["model"] if isinstance(m.get("cpu"), dict) else m.get("cpu")
    dtype = ",".join(c["dtype"]) if isinstance(c["dtype"], list) else c["dtype"]
    fig.suptitle(f"{w['num_prompts']} MT-bench prompts × {w['max_new_tokens']} greedy tokens (EOS ignored), dtype "
                 f"{dtype}; {cpu}, {m['affinity_cpus']} CPUs, {c['threads']} threads, {result['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
