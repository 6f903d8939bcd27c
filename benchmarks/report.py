"""The benchmark's report: summary rows and ratios, the printed/README table, and the PNG plot.

Owns turning bench.py's phase results into numbers people read; measuring is bench.py's.
"""
from __future__ import annotations

import re
import statistics
from pathlib import Path

README = Path(__file__).resolve().parent / "README.md"
TABLE_START, TABLE_END = "<!-- bench-table:start (bench.py --write-readme) -->", "<!-- bench-table:end -->"


def _p(stats: dict | None, key: str, scale: float = 1.0) -> float | None:
    return None if not stats or stats.get(key) is None else stats[key] * scale


def one_line(result: dict) -> str:
    """A phase's headline, for progress output."""
    if "levels" in result:
        return "; ".join(f"C={lv['concurrency']} {lv['output_tokens_per_s']:.1f} tok/s" for lv in result["levels"])
    if "peak_flops_per_s" in result:
        return f"{result['peak_flops_per_s'] / 1e9:.0f} GFLOP/s ({result['square_size']}^3 matmul), " \
               f"decode-shaped GEMM {result['decode_shape_flops_per_s'] / 1e9:.0f} GFLOP/s"
    line = f"{result.get('output_tokens', 0)} tokens in {result.get('wall_s', 0):.1f} s = " \
           f"{result.get('output_tokens_per_s', 0):.1f} tok/s"
    if result.get("rounds"):
        line += f" (median round of {len(result['rounds'])}: {_round_range(result)})"
    if result.get("batch_size"):
        line += f" (batch size {result['batch_size']})"
    return line


def _row(name: str, result: dict | None, peak_rss: float | None = None, note: str = "") -> dict:
    result = result or {}
    return {"name": name, "output_tokens_per_s": result.get("output_tokens_per_s"),
            "ttft_p50_s": _p(result.get("ttft_s"), "p50"), "ttft_p99_s": _p(result.get("ttft_s"), "p99"),
            "itl_p50_ms": _p(result.get("itl_s"), "p50", 1e3), "itl_p99_ms": _p(result.get("itl_s"), "p99", 1e3),
            "peak_rss_mib": peak_rss if peak_rss is not None else (result.get("monitor") or {}).get("peak_rss_mib"),
            "other_cpu_cores_busy": (result.get("monitor") or {}).get("other_cpu_cores_busy"), "note": note}


def _round_rates(result: dict | None) -> list[float]:
    return [r["output_tokens_per_s"] for r in (result or {}).get("rounds", [])]


def _round_range(result: dict) -> str:
    rates = _round_rates(result)
    return f"{min(rates):.1f}–{max(rates):.1f} tok/s" if rates else "–"


def _offline_row(name: str, result: dict) -> dict:
    """An offline phase's row: its median round's figures, every round's tok/s, the range in the note."""
    rates = _round_rates(result)
    note = f"median of {len(rates)} rounds; range {_round_range(result)}" if len(rates) > 1 else ""
    return {**_row(name, result, note=note), "round_tokens_per_s": rates}


def _ok(phases: dict, name: str) -> dict | None:
    res = phases.get(name)
    return None if not res or "skipped" in res else res


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def round_ratios(phases: dict, a: str = "ours_offline", b: str = "vllm_offline") -> dict | None:
    """Phase `a`'s output tok/s over phase `b`'s, round by round (the same round number of each, so the
    two ran minutes apart at most): the per-round ratios, their median (statistics.median: of an even
    number, the mean of the middle two), min, max and count. None unless both have a round in common."""
    rates_a = {r["round"]: r["output_tokens_per_s"] for r in (_ok(phases, a) or {}).get("rounds", [])}
    rates_b = {r["round"]: r["output_tokens_per_s"] for r in (_ok(phases, b) or {}).get("rounds", [])}
    per_round = [_ratio(rates_a[k], rates_b[k]) for k in sorted(rates_a.keys() & rates_b.keys())]
    per_round = [x for x in per_round if x is not None]
    if not per_round:
        return None
    return {"median": statistics.median(per_round), "min": min(per_round), "max": max(per_round),
            "num_rounds": len(per_round), "per_round": per_round}


def add_summary(result: dict) -> None:
    """Add result["rows"] (one per engine/level) and result["ratios"] (ours / peer and the targets)."""
    ph = result["phases"]
    rows, tps = [], {}
    for name, label in (("ours_offline", "ours offline (default, batch-invariant)"),
                        ("ours_offline_plain", "ours offline (option.batch_invariant=false)"),
                        ("vllm_offline", "vLLM CPU offline (LLM.generate)")):
        if res := _ok(ph, name):
            rows.append(_offline_row(label, res))
            tps[name] = res["output_tokens_per_s"]
    if res := _ok(ph, "batch_runner"):
        excl = res.get("output_tokens_per_s_excl_startup")
        rows.append(_row("ours batch file (`lmi-handler batch`)", res,
                         note=f"{excl:.1f} tok/s excl. start-up" if excl else "start-up included"))
        tps["batch_runner"] = res["output_tokens_per_s"]
        tps["batch_runner_excl_startup"] = res.get("output_tokens_per_s_excl_startup")
    if res := _ok(ph, "hf"):
        rows.append(_row(f"transformers generate(), static batch {res['batch_size']}", res))
        tps["hf"] = res["output_tokens_per_s"]
    c1 = result["workload"].get("c1_prompts")
    for server, label in (("ours_server", "ours server"), ("vllm_server", "vLLM server")):
        for lv in (_ok(ph, server) or {}).get("levels", []):
            note = f"{lv['num_requests']} prompts" if lv["concurrency"] == 1 and c1 else ""
            if lv["num_errors"]:
                note += f" {lv['num_errors']} errors"
            rows.append(_row(f"{label}, concurrency {lv['concurrency']}", lv, note=note.strip()))
            tps[f"{server}_c{lv['concurrency']}"] = lv["output_tokens_per_s"]
    bound = result.get("compute_bound")
    if bound:
        rows.append({**_row("compute bound (workload FLOPs / peak matmul rate)", None),
                     "output_tokens_per_s": bound["output_tokens_per_s"],
                     "note": f"{bound['peak_gflops_per_s']:.0f} GFLOP/s"})
    b1 = {k: ((_ok(ph, k) or {}).get("batch1") or {}).get("decode_tokens_per_s") for k in ("ours_offline", "vllm_offline")}
    rss = {k: (res.get("monitor") or {}).get("peak_rss_mib") if (res := _ok(ph, k)) else None
           for k in ("ours_offline", "vllm_offline")}
    rss.update({k: res.get("peak_rss_mib") if (res := _ok(ph, k)) else None for k in ("ours_server", "vllm_server")})
    by_round = round_ratios(ph)
    ratios = {
        # interleaved rounds: the median of the per-round ratios (a single run's ratio in older results)
        "ours_offline_vs_vllm_offline": by_round["median"] if by_round
        else _ratio(tps.get("ours_offline"), tps.get("vllm_offline")),
        "ours_offline_plain_vs_vllm_offline": _ratio(tps.get("ours_offline_plain"), tps.get("vllm_offline")),
        "ours_offline_vs_hf": _ratio(tps.get("ours_offline"), tps.get("hf")),
        "ours_default_vs_plain": _ratio(tps.get("ours_offline"), tps.get("ours_offline_plain")),
        "ours_batch1_vs_vllm_batch1": _ratio(b1["ours_offline"], b1["vllm_offline"]),
        "batch_runner_vs_ours_offline": _ratio(tps.get("batch_runner"), tps.get("ours_offline")),
        "batch_runner_excl_startup_vs_ours_offline": _ratio(tps.get("batch_runner_excl_startup"), tps.get("ours_offline")),
        "ours_offline_vs_compute_bound": _ratio(tps.get("ours_offline"), (bound or {}).get("output_tokens_per_s")),
        "vllm_offline_vs_compute_bound": _ratio(tps.get("vllm_offline"), (bound or {}).get("output_tokens_per_s")),
        "peak_rss_ours_offline_vs_vllm_offline": _ratio(rss["ours_offline"], rss["vllm_offline"]),
        "peak_rss_ours_server_vs_vllm_server": _ratio(rss["ours_server"], rss["vllm_server"]),
    }
    for key in [k for k in tps if k.startswith("ours_server_c")]:
        c = key.rsplit("_c", 1)[1]
        ratios[f"ours_server_c{c}_vs_ours_offline"] = _ratio(tps[key], tps.get("ours_offline"))
        ratios[f"ours_server_c{c}_vs_vllm_server_c{c}"] = _ratio(tps[key], tps.get(f"vllm_server_c{c}"))
    result["rows"] = rows
    result["offline_rounds"] = {"ours_offline_vs_vllm_offline": by_round,
                                "num_rounds": {k: len(_round_rates(_ok(ph, k))) for k in ("ours_offline", "vllm_offline")}}
    result["greedy_agreement_with_ours_offline"] = greedy_agreement(ph)
    result["batch1_decode_tokens_per_s"] = b1
    result["ratios"] = ratios
    result["skipped"] = {name: res["skipped"] for name, res in ph.items() if "skipped" in res}


def greedy_agreement(phases: dict) -> dict:
    """Per engine: how many prompts got exactly our offline token ids (greedy; informational, never asserted);
    for the offline phases run in rounds, the first round's ids.

    fp32 near-ties can flip a token anywhere in 128, so a few differences are normal. Drops the token
    ids from the phases afterwards (the raw worker files keep them).
    """
    ours = (_ok(phases, "ours_offline") or {}).get("output_token_ids")
    out = {}
    for name in ("ours_offline_plain", "hf", "vllm_offline"):
        theirs = (_ok(phases, name) or {}).get("output_token_ids")
        if ours and theirs:
            out[name] = f"{sum(a == b for a, b in zip(ours, theirs, strict=False))}/{len(ours)}"
    for res in phases.values():
        res.pop("output_token_ids", None)
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def table(result: dict) -> str:
    """The results as a markdown table plus batch-1, ratio and machine-load lines."""
    lines = ["| engine | output tok/s | TTFT p50 / p99 s | ITL p50 / p99 ms | peak RSS MiB | other CPU cores busy | note |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['name']} | {_fmt(r['output_tokens_per_s'], '.1f')} | "
                     f"{_fmt(r['ttft_p50_s'], '.2f')} / {_fmt(r['ttft_p99_s'], '.2f')} | "
                     f"{_fmt(r['itl_p50_ms'], '.0f')} / {_fmt(r['itl_p99_ms'], '.0f')} | "
                     f"{_fmt(r['peak_rss_mib'], '.0f')} | {_fmt(r['other_cpu_cores_busy'], '.2f')} | {r['note']} |")
    b1 = result["batch1_decode_tokens_per_s"]
    lines.append("")
    lines.append(f"Batch-1 decode tok/s (one request, {result['workload']['max_new_tokens']} tokens): "
                 f"ours {_fmt(b1['ours_offline'], '.1f')}, vLLM {_fmt(b1['vllm_offline'], '.1f')}.")
    ratios = ", ".join(f"{k} {v:.2f}" for k, v in result["ratios"].items() if v is not None)
    lines.append(f"Ratios: {ratios or '–'}.")
    lines.extend(rounds_lines(result))
    agree = ", ".join(f"{k} {v}" for k, v in result.get("greedy_agreement_with_ours_offline", {}).items())
    lines.append(f"Prompts whose greedy tokens equal ours offline, token for token: {agree or '–'}.")
    m = result["machine"]
    threads = (_ok(result["phases"], "ours_offline") or {}).get("torch_num_threads")
    lines.append(f"Machine: {m['cpu']}, {m['affinity_cpus']} CPUs; --threads {result['config']['threads']} "
                 f"(torch threads seen in our engine: {threads if threads is not None else '–'}); load average before "
                 f"{'/'.join(f'{x:.2f}' for x in m['before']['loadavg_1_5_15'])}, after "
                 f"{'/'.join(f'{x:.2f}' for x in m['after']['loadavg_1_5_15'])}; other processes used "
                 f"{m['before']['other_cpu_cores_busy']:.2f} cores before the run.")
    for name, why in result["skipped"].items():
        lines.append(f"Skipped {name}: {why.splitlines()[0][:200]}")
    return "\n".join(lines)


def _round_cell(rnd: dict, label: str) -> str:
    """One offline round for the table: "K engine tok/s (steal % / load / other cores / idle peer cores)"."""
    m = rnd.get("machine") or {}
    during, before = m.get("during") or {}, m.get("before") or {}
    steal = during.get("steal_fraction")
    load = (before.get("loadavg_1_5_15") or [None])[0]
    return (f"{rnd['round']} {label} {_fmt(rnd['output_tokens_per_s'], '.1f')} "
            f"({_fmt(None if steal is None else 100 * steal, '.1f')} / {_fmt(load, '.2f')} / "
            f"{_fmt(during.get('other_cpu_cores_busy'), '.2f')} / {_fmt(during.get('idle_peer_cpu_cores_busy'), '.2f')})")


def rounds_lines(result: dict) -> list[str]:
    """How the offline rounds ran: the per-round ratio and its spread, and the machine in each round."""
    ph = result["phases"]
    engines = [(k, label) for k, label in (("ours_offline", "ours"), ("vllm_offline", "vLLM")) if _round_rates(_ok(ph, k))]
    if not engines:
        return []
    n = max(len(_round_rates(_ok(ph, k))) for k, _ in engines)
    by_round = (result.get("offline_rounds") or {}).get("ours_offline_vs_vllm_offline")
    if by_round:
        per = ", ".join(f"{x:.2f}" for x in by_round["per_round"])
        head = (f"Offline: {n} rounds, interleaved (both engines loaded, one running while the other waits; ours "
                f"first in odd rounds, vLLM first in even ones); ours/vLLM per round {per}: median "
                f"{by_round['median']:.2f}, min {by_round['min']:.2f}, max {by_round['max']:.2f}.")
    else:
        head = f"Offline: {n} rounds of {' and '.join(label for _, label in engines)} alone (no peer to take turns with)."
    # in the order they ran: by round, then who went first
    cells = sorted(((r["round"], (r.get("machine") or {}).get("position", 0), _round_cell(r, label))
                    for k, label in engines for r in _ok(ph, k)["rounds"]))
    return [head, "Rounds, tok/s (steal % of CPU time / load average 1 min before / other processes' cores / idle "
                  f"peer engine's cores): {'; '.join(cell for _, _, cell in cells)}."]


def write_readme(result: dict, source: str, readme: Path = README) -> None:
    """Replace the block between the table markers in the README with this result's table."""
    if "rows" not in result:
        add_summary(result)
    w = result["workload"]
    block = (f"{TABLE_START}\n_Run {result['date']} (`results/{source}`): {w['num_prompts']} prompts × "
             f"{w['max_new_tokens']} tokens, dtype {result['config']['dtype']}, {result['config']['threads']} threads._\n\n"
             f"{table(result)}\n{TABLE_END}")
    text = readme.read_text()
    pattern = re.compile(re.escape(TABLE_START) + ".*?" + re.escape(TABLE_END), re.S)
    if not pattern.search(text):
        raise ValueError(f"{readme} has no {TABLE_START} ... {TABLE_END} block")
    readme.write_text(pattern.sub(lambda _: block, text))


def plot(result: dict, path: Path) -> None:
    """Throughput bars (all rows) and TTFT/ITL p50 against concurrency for both servers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["output_tokens_per_s"]]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.5), gridspec_kw={"width_ratios": [2.2, 1, 1]})
    colors = ["tab:gray" if r["name"].startswith("compute") else "tab:orange" if "vLLM" in r["name"]
              else "tab:green" if "transformers" in r["name"] else "tab:blue" for r in rows]
    bars = axes[0].barh([r["name"] for r in rows], [r["output_tokens_per_s"] for r in rows], color=colors)
    axes[0].bar_label(bars, fmt="%.1f", fontsize=8)
    for y, r in enumerate(rows):  # the offline rounds, one dot each (the bar is the median round)
        rates = r.get("round_tokens_per_s") or []
        axes[0].plot(rates, [y] * len(rates), "k.", markersize=5)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("output tokens / s")
    axes[0].tick_params(axis="y", labelsize=8)
    axes[0].set_title("Throughput (dots: the offline rounds, bar: the median round)")
    for server, label, color in (("ours_server", "ours", "tab:blue"), ("vllm_server", "vLLM", "tab:orange")):
        levels = (_ok(result["phases"], server) or {}).get("levels", [])
        cs = [lv["concurrency"] for lv in levels]
        axes[1].plot(cs, [_p(lv["ttft_s"], "p50") for lv in levels], "o-", color=color, label=label)
        axes[2].plot(cs, [_p(lv["itl_s"], "p50", 1e3) for lv in levels], "o-", color=color, label=label)
    for ax, title in ((axes[1], "TTFT p50 (s)"), (axes[2], "ITL p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.legend()
    w, m = result["workload"], result["machine"]
    fig.suptitle(f"{w['num_prompts']} MT-bench prompts × {w['max_new_tokens']} greedy tokens (EOS ignored); "
                 f"{m['affinity_cpus']} CPUs, {result['config']['threads']} threads, {result['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
