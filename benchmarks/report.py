"""The benchmark's report: summary rows and ratios per dtype, batch-1 against its ceiling, the printed table,
docs/performance.md's tables (the newest run of each host kind), and the PNG plot.

    .venv/bin/python benchmarks/report.py --write-docs     # re-render docs/performance.md from benchmarks/results

Owns turning bench.py's phase results into numbers people read; measuring is bench.py's. Reads results of
this version (phases named <phase>_<dtype>) and older ones (one dtype, unsuffixed names) alike.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from pathlib import Path

from round_protocol import headline

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PERFORMANCE = REPO / "docs" / "performance.md"
DOCS_START = "<!-- perf-tables:start (rendered by `python benchmarks/report.py --write-docs`) -->"
DOCS_END = "<!-- perf-tables:end -->"


def _p(stats: dict | None, key: str, scale: float = 1.0) -> float | None:
    return None if not stats or stats.get(key) is None else stats[key] * scale


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def compile_note(comp: dict) -> str:
    """All schemas' compile cost for the structured table: the 2-token run with schemas minus the same run
    unconstrained (wall seconds). A difference below zero is the machine's noise, not a cost: said so, with
    both timings, instead of printed as a negative compile time."""
    cost = comp.get("all_schemas_compile_s")
    if cost is None:
        return "all schemas' compiles –"
    if cost >= 0:
        return f"all schemas' compiles {cost:.2f} s"
    return (f"all schemas' compiles below the noise (2-token runs: {_fmt(comp.get('all_schemas_2_tokens_s'), '.2f')} s "
            f"with schemas, {_fmt(comp.get('all_unconstrained_2_tokens_s'), '.2f')} s without)")


def _ok(phases: dict, name: str) -> dict | None:
    res = phases.get(name)
    return None if not res or "skipped" in res else res


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def dtypes_of(result: dict) -> list[str | None]:
    """The run's dtypes in order; [None] for an older result (one dtype, phases without the suffix)."""
    d = result["config"].get("dtype")
    return d if isinstance(d, list) else [None]


def name(base: str, dtype: str | None) -> str:
    """A per-dtype phase's name (`vllm_offline_bf16`), or the bare one in an older result."""
    return base if dtype is None else f"{base}_{dtype}"


def _label(dtype: str | None) -> str:
    return f" {dtype}" if dtype else ""


def one_line(result: dict) -> str:
    """A phase's headline, for progress output."""
    if "levels" in result:
        return "; ".join(f"C={lv['concurrency']} {lv['output_tokens_per_s']:.1f} tok/s" for lv in result["levels"])
    if "interactive_ttft_p50_ratio" in result:
        return priority_line(result)
    if "peak_flops_per_s" in result:
        by = result.get("by_dtype") or {"": result}
        mem = (result.get("mem_read") or {}).get("best_bytes_per_s")
        return (", ".join(f"{d} {r['peak_flops_per_s'] / 1e9:.0f} GFLOP/s".strip() for d, r in by.items())
                + f" ({result['square_size']}^3 matmul); read {_fmt(mem and mem / 1e9, '.1f')} GB/s")
    line = headline(result)
    if result.get("rounds"):
        line += f" (median round of {len(result['rounds'])}: {_round_range(result)})"
    if result.get("batch_size"):
        line += f" (batch size {result['batch_size']})"
    return line


def priority_line(result: dict) -> str:
    """ours_priority's figures: the interactive requests' TTFT p50 under each policy, and their ratio."""
    p50 = {k: _p((result.get(k) or {}).get("ttft_s"), "p50") for k in ("fcfs", "priority")}
    return (f"interactive TTFT p50 behind {result['batch_requests']} batch requests ({result['probes']} probes, "
            f"{result['max_tokens']} tokens, batch {result['max_rolling_batch_size']}): fcfs {_fmt(p50['fcfs'], '.2f')} s, "
            f"priority {_fmt(p50['priority'], '.2f')} s, {_fmt(result['interactive_ttft_p50_ratio'], '.1f')}x lower "
            f"(target {result['target_ratio']:g}x)")


def _row(label: str, result: dict | None, peak_rss: float | None = None, note: str = "") -> dict:
    result = result or {}
    return {"name": label, "output_tokens_per_s": result.get("output_tokens_per_s"),
            "ttft_p50_s": _p(result.get("ttft_s"), "p50"), "ttft_p99_s": _p(result.get("ttft_s"), "p99"),
            "itl_p50_ms": _p(result.get("itl_s"), "p50", 1e3), "itl_p99_ms": _p(result.get("itl_s"), "p99", 1e3),
            "peak_rss_mib": peak_rss if peak_rss is not None else (result.get("monitor") or {}).get("peak_rss_mib"),
            "other_cpu_cores_busy": (result.get("monitor") or {}).get("other_cpu_cores_busy"), "note": note}


def _round_rates(result: dict | None) -> list[float]:
    return [r["output_tokens_per_s"] for r in (result or {}).get("rounds", []) if r.get("output_tokens_per_s")]


def _round_range(result: dict) -> str:
    rates = _round_rates(result)
    return f"{min(rates):.1f}–{max(rates):.1f} tok/s" if rates else "–"


def _offline_row(label: str, result: dict) -> dict:
    """An offline phase's row: its median round's figures, every round's tok/s, the range in the note."""
    rates = _round_rates(result)
    note = f"median of {len(rates)} rounds; range {_round_range(result)}" if len(rates) > 1 else ""
    return {**_row(label, result, note=note), "round_tokens_per_s": rates}


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


def read_bandwidth(phases: dict) -> dict:
    """The run's read-bandwidth probes: start, end (bytes/s, None when not measured) and the best, which the
    ceilings use (the highest ceiling, so the fractions are the conservative ones)."""
    out = {p: ((_ok(phases, p) or {}).get("mem_read") or {}).get("best_bytes_per_s") for p in ("peak_start", "peak_end")}
    out["best"] = max((v for v in out.values() if v), default=None)
    return out


def batch1_rows(result: dict) -> list[dict]:
    """Batch-1 decode per engine and weight format, each with the weight bytes one token reads, the
    ceiling read bandwidth / bytes gives and the fraction of it reached (None where unknown)."""
    ph, bw = result["phases"], read_bandwidth(result["phases"])["best"]
    wbytes = result.get("weight_bytes_per_token") or {}
    rows = []

    def add(label: str, weights: str, rate: float | None, nbytes: int | None, rounds: list[float], note: str = "",
            res: dict | None = None):
        ceiling = bw / nbytes if bw and nbytes else None
        own = _own_minute_fractions(res, nbytes)
        own_median = statistics.median_low(own) if own else None
        if own:
            note += (f"; against a read probe just before each round: {', '.join(f'{f:.2f}' for f in own)}, "
                     f"median {own_median:.2f}")
        rows.append({"name": label, "weights": weights, "decode_tokens_per_s": rate, "bytes_per_token": nbytes,
                     "ceiling_tokens_per_s": ceiling, "fraction_of_ceiling": _ratio(rate, ceiling),
                     "fraction_of_own_minute_ceiling": own_median,
                     "round_tokens_per_s": rounds, "note": note})

    after = "after the offline rounds, one request alone"
    for dtype in dtypes_of(result):
        for base, label in (("ours_offline", "ours"), ("vllm_offline", "vLLM CPU")):
            res = _ok(ph, name(base, dtype))
            alone = _ok(ph, name("ours_batch1", dtype)) if base == "ours_offline" else None
            if not (res or alone):
                continue
            weights = dtype or "fp32"
            nbytes = (wbytes.get(weights) or {}).get("bytes")
            single = ((res or {}).get("batch1") or {}).get("decode_tokens_per_s")
            if alone:   # batch-1 in rounds beside the batch-1 peers: the median round is the row's figure
                note = _rounds_note(alone) + (f"; {after}: {single:.1f} tok/s" if single else "")
                add(f"{label}{_label(dtype)}", weights, alone.get("output_tokens_per_s"), nbytes, _round_rates(alone), note,
                    alone)
            else:
                add(f"{label}{_label(dtype)}", weights, single, nbytes, [], after)
    for q in result["config"].get("quantize") or []:
        for dtype in dtypes_of(result):
            if res := _ok(ph, f"ours_batch1_{q}_{dtype}"):
                add(f"ours {q}, activations {dtype}", q, res.get("output_tokens_per_s"),
                    (wbytes.get(q) or {}).get("bytes"), _round_rates(res), _rounds_note(res), res)
    if res := _ok(ph, "llamacpp_batch1"):
        extra = res.get("extra_buffer_types")
        note = _rounds_note(res) + ("" if not extra or extra.get("used") else
                                    f"; extra weight buffer types off: {extra.get('reason')}")
        add("llama.cpp (llama-cpp-python)", "GGUF " + (res.get("description") or "?"), res.get("output_tokens_per_s"),
            res.get("model_bytes"), _round_rates(res), note)
    return rows


def _own_minute_fractions(res: dict | None, nbytes: int | None) -> list[float]:
    """Each batch-1 round's decode tok/s over the ceiling of the read probe run just before it (workers.py
    read_probe_before_round): read bytes/s / weight bytes per token. [] where the rounds carry no probe."""
    out = []
    for r in (res or {}).get("rounds", []):
        rate, read = r.get("output_tokens_per_s"), r.get("read_bytes_per_s")
        if rate and read and nbytes:
            out.append(rate / (read / nbytes))
    return out


def _rounds_note(res: dict) -> str:
    n = len(_round_rates(res))
    return f"median of {n} rounds, range {_round_range(res)}" if n > 1 else ""


def add_summary(result: dict) -> None:
    """Add result["rows"] (one per engine/dtype/level), result["batch1"] (batch-1 against its ceiling) and
    result["ratios"] (ours / peer and the targets)."""
    ph, dtypes = result["phases"], dtypes_of(result)
    first = dtypes[0]
    bounds = result.get("compute_bound_by_dtype") or ({first: result["compute_bound"]} if result.get("compute_bound") else {})
    rows, tps, ratios, rounds = [], {}, {}, {}
    for dtype in dtypes:
        for base, label in (("ours_offline", "ours offline{} (default, batch-invariant)"),
                            ("ours_offline_transformers", "ours offline{} (option.model_impl=transformers)"),
                            ("vllm_offline", "vLLM CPU offline{} (LLM.generate)"),
                            ("ours_offline_busy", "ours offline{}, busy cores (--busy-cores)"),
                            ("vllm_offline_busy", "vLLM CPU offline{}, busy cores (--busy-cores)")):
            if res := _ok(ph, name(base, dtype)):
                rows.append(_offline_row(label.format(_label(dtype)), res))
                tps[name(base, dtype)] = res["output_tokens_per_s"]
        if bound := bounds.get(dtype):
            rows.append({**_row(f"compute bound{_label(dtype)} (workload FLOPs / peak matmul rate)", None),
                         "output_tokens_per_s": bound["output_tokens_per_s"],
                         "note": f"{bound['peak_gflops_per_s']:.0f} GFLOP/s"})
        ours, vllm = name("ours_offline", dtype), name("vllm_offline", dtype)
        if dtype == "fp32" and (fma := result.get("fma_bound")):
            rows.append({**_row("FMA bound fp32 (workload FLOPs / the cores' float32 FMA peak)", None),
                         "output_tokens_per_s": fma["output_tokens_per_s"],
                         "note": f"{fma['peak_gflops_per_s']:.0f} GFLOP/s (probes/fmapeak.c)"})
            for k in (ours, vllm):
                ratios[f"{k}_vs_fma_bound"] = _ratio(tps.get(k), fma["output_tokens_per_s"])
        by_round = round_ratios(ph, ours, vllm)
        rounds[f"{ours}_vs_{vllm}"] = by_round
        ratios[f"{ours}_vs_{vllm}"] = by_round["median"] if by_round else _ratio(tps.get(ours), tps.get(vllm))
        busy, vllm_busy = name("ours_offline_busy", dtype), name("vllm_offline_busy", dtype)
        by_round = round_ratios(ph, busy, vllm_busy)
        ratios[f"{busy}_vs_{vllm_busy}"] = by_round["median"] if by_round else _ratio(tps.get(busy), tps.get(vllm_busy))
        ratios[f"{busy}_vs_{ours}"] = _ratio(tps.get(busy), tps.get(ours))
        b1 = {k: ((_ok(ph, k) or {}).get("batch1") or {}).get("decode_tokens_per_s") for k in (ours, vllm)}
        ratios[f"{name('ours_batch1', dtype)}_vs_{name('vllm_batch1', dtype)}"] = _ratio(b1[ours], b1[vllm])
        for k in (ours, vllm):
            ratios[f"{k}_vs_compute_bound"] = _ratio(tps.get(k), (bounds.get(dtype) or {}).get("output_tokens_per_s"))
        rss = {k: ((_ok(ph, k) or {}).get("monitor") or {}).get("peak_rss_mib") for k in (ours, vllm)}
        ratios[f"peak_rss_{ours}_vs_{vllm}"] = _ratio(rss[ours], rss[vllm])
    ours_first = tps.get(name("ours_offline", first))
    if res := _ok(ph, "batch_runner"):
        excl = res.get("output_tokens_per_s_excl_startup")
        rows.append(_row(f"ours batch file (`lmi-handler batch`){_label(first)}", res,
                         note=f"{excl:.1f} tok/s excl. start-up" if excl else "start-up included"))
        ratios["batch_runner_vs_ours_offline"] = _ratio(res["output_tokens_per_s"], ours_first)
        ratios["batch_runner_excl_startup_vs_ours_offline"] = _ratio(excl, ours_first)
    if res := _ok(ph, "ours_priority"):
        ratios["ours_priority_interactive_ttft_p50_fcfs_vs_priority"] = res["interactive_ttft_p50_ratio"]
    if res := _ok(ph, "hf"):
        rows.append(_row(f"transformers generate(){_label(first)}, static batch {res['batch_size']}", res))
        ratios["ours_offline_vs_hf"] = _ratio(ours_first, res["output_tokens_per_s"])
        ratios["ours_offline_transformers_vs_hf"] = _ratio(tps.get(name("ours_offline_transformers", first)),
                                                           res["output_tokens_per_s"])
    _server_rows(result, rows, tps, ratios, ours_first, first)
    for q in result["config"].get("quantize") or []:
        for dtype in dtypes:
            by_round = round_ratios(ph, f"ours_batch1_{q}_{dtype}", "llamacpp_batch1")
            rounds[f"ours_batch1_{q}_{dtype}_vs_llamacpp_batch1"] = by_round
            ratios[f"ours_batch1_{q}_{dtype}_vs_llamacpp_batch1"] = by_round["median"] if by_round else None
    result["structured"] = structured_summary(ph)
    for k, r in result["structured"]["ratios"].items():
        ratios[k] = r["median"] if r else None
    result["rows"] = rows
    result["batch1"] = batch1_rows(result)
    result["read_bandwidth_bytes_per_s"] = read_bandwidth(ph)
    result["offline_rounds"] = rounds
    # an older result's ids were dropped when it was written: keep the agreement it recorded then
    result["greedy_agreement_with_ours_offline"] = (greedy_agreement(ph, dtypes)
                                                    or result.get("greedy_agreement_with_ours_offline", {}))
    result["ratios"] = ratios
    result["skipped"] = {n: res["skipped"] for n, res in ph.items() if "skipped" in res}


def _server_rows(result: dict, rows: list, tps: dict, ratios: dict, ours_first: float | None, first: str | None) -> None:
    ph, c1 = result["phases"], result["workload"].get("c1_prompts")
    for server, label in (("ours_server", "ours server"), ("vllm_server", "vLLM server")):
        for lv in (_ok(ph, server) or {}).get("levels", []):
            note = f"{lv['num_requests']} prompts" if lv["concurrency"] == 1 and c1 else ""
            if lv["num_errors"]:
                note += f" {lv['num_errors']} errors"
            rows.append(_row(f"{label}{_label(first)}, concurrency {lv['concurrency']}", lv, note=note.strip()))
            tps[f"{server}_c{lv['concurrency']}"] = lv["output_tokens_per_s"]
    for key in [k for k in tps if k.startswith("ours_server_c")]:
        c = key.rsplit("_c", 1)[1]
        ratios[f"ours_server_c{c}_vs_ours_offline"] = _ratio(tps[key], ours_first)
        ratios[f"ours_server_c{c}_vs_vllm_server_c{c}"] = _ratio(tps[key], tps.get(f"vllm_server_c{c}"))
    rss = {k: res.get("peak_rss_mib") if (res := _ok(ph, k)) else None for k in ("ours_server", "vllm_server")}
    ratios["peak_rss_ours_server_vs_vllm_server"] = _ratio(rss["ours_server"], rss["vllm_server"])


# the structured-output targets (issue 14): constrained >= 0.9x our unconstrained, ahead of vLLM's constrained
# (against both baselines: the same max_tokens with EOS honoured, and length-matched)
STRUCTURED_TARGETS = {"ours_structured_vs_ours_unconstrained": 0.9, "ours_structured_vs_ours_length_matched": 0.9,
                      "ours_structured_vs_vllm_structured": 1.0}
STRUCTURED_LABELS = {"ours_structured": "ours", "vllm_structured": "vLLM CPU"}


def _median_of(values: list[float]) -> dict | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "num_rounds": len(values),
            "per_round": values} if values else None


def structured_summary(phases: dict) -> dict:
    """The structured-output pair: per engine, its constrained run (the median round's), its unconstrained run
    (the median round by unconstrained tok/s), the validation counts summed over rounds, compile times and
    the backend; and the ratios, each the median of per-round ratios (the two runs of a round ran back to
    back; ours and vLLM in round k minutes apart at most), with whether the targets are met."""
    engines, ratios = {}, {}
    for key, label in STRUCTURED_LABELS.items():
        res = _ok(phases, key)
        if not res:
            continue
        rounds = res.get("rounds") or []
        plain = sorted((r["unconstrained"] for r in rounds), key=lambda u: u["output_tokens_per_s"])
        matched = sorted((r["length_matched"] for r in rounds if r.get("length_matched")),
                         key=lambda u: u["output_tokens_per_s"])
        checks = [r["validation"] for r in rounds if r.get("validation")]
        engines[key] = {
            "label": label, "constrained": {k: res.get(k) for k in ("output_tokens_per_s", "requests_per_s",
                                                                    "mean_tokens_per_request", "output_tokens", "wall_s")},
            "unconstrained": plain[(len(plain) - 1) // 2] if plain else None,
            "length_matched": matched[(len(matched) - 1) // 2] if matched else None,
            "validation": {k: sum(c[k] for c in checks) for k in ("num_outputs", "num_finished", "num_length",
                                                                  "num_valid", "num_invalid")} if checks else None,
            "invalid_examples": [x for c in checks for x in c.get("invalid", [])][:5],
            "compile": res.get("compile"),
            "backend": res.get("structured_outputs_backend_used") or res.get("grammar_backend"),
            "backend_configured": res.get("structured_outputs_backend_configured"),
            "grammar_libraries": res.get("grammar_backend"),
            "round_tokens_per_s": _round_rates(res),
            "round_unconstrained_tokens_per_s": [r["unconstrained"]["output_tokens_per_s"] for r in rounds]}
        base = key.split("_")[0]
        for other in ("unconstrained", "length_matched"):
            ratios[f"{base}_structured_vs_{base}_{other}"] = _median_of(
                [r[f"constrained_vs_{other}"] for r in rounds if r.get(f"constrained_vs_{other}")])
    ratios["ours_structured_vs_vllm_structured"] = round_ratios(phases, "ours_structured", "vllm_structured")
    met = {k: (ratios[k]["median"] >= target if ratios.get(k) else None) for k, target in STRUCTURED_TARGETS.items()}
    return {"engines": engines, "ratios": ratios, "targets": STRUCTURED_TARGETS, "targets_met": met}


def structured_table(result: dict) -> list[str]:
    """The structured-output rows as markdown lines (none when neither engine ran the phase)."""
    summary = result.get("structured") or structured_summary(result["phases"])
    if not summary["engines"]:
        return []
    lines = ["Structured output (each prompt with its JSON schema vs the same prompts unconstrained, EOS honoured, "
             f"up to {result['workload']['max_new_tokens']} tokens; median round):", "",
             "| engine | run | output tok/s | requests/s | tokens / request | ended on the grammar / valid | "
             "first compile s | note |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for eng in summary["engines"].values():
        c, u, v, comp = eng["constrained"], eng["unconstrained"] or {}, eng["validation"], eng["compile"] or {}
        backend = eng["backend"]
        if isinstance(backend, dict):   # vLLM: its configured backend, what each request resolved to, the versions
            libraries = ", ".join(f"{k} {v}" for k, v in (eng.get("grammar_libraries") or {}).items() if v)
            backend = (f"{eng.get('backend_configured')} → " + ", ".join(f"{k} ({n} requests)" for k, n in backend.items())
                       + (f"; installed {libraries}" if libraries else ""))
        checked = f"{v['num_finished']} / {v['num_valid']} of {v['num_outputs']}" if v else "–"
        lines.append(f"| {eng['label']} | JSON schema | {_fmt(c['output_tokens_per_s'], '.1f')} | "
                     f"{_fmt(c['requests_per_s'], '.2f')} | {_fmt(c['mean_tokens_per_request'], '.1f')} | {checked} | "
                     f"{_fmt(comp.get('first_compile_s'), '.2f')} | backend {backend}; {compile_note(comp)} |")
        lines.append(f"| {eng['label']} | unconstrained | {_fmt(u.get('output_tokens_per_s'), '.1f')} | "
                     f"{_fmt(u.get('requests_per_s'), '.2f')} | {_fmt(u.get('mean_tokens_per_request'), '.1f')} | – | – | |")
        m = eng.get("length_matched") or {}
        lines.append(f"| {eng['label']} | unconstrained, length-matched | {_fmt(m.get('output_tokens_per_s'), '.1f')} | "
                     f"{_fmt(m.get('requests_per_s'), '.2f')} | {_fmt(m.get('mean_tokens_per_request'), '.1f')} | – | – | "
                     "EOS ignored, each request as many tokens as its constrained answer |")
    parts = []
    for k, r in summary["ratios"].items():
        if r:
            target = summary["targets"].get(k)
            goal = "" if target is None else f" (target ≥ {target}: {'met' if summary['targets_met'][k] else 'not met'})"
            parts.append(f"{k.replace('_vs_', ' / ')} median {r['median']:.2f} (per round "
                         f"{', '.join(f'{x:.2f}' for x in r['per_round'])}){goal}")
    lines += ["", f"Structured ratios: {'; '.join(parts) or '–'}."]
    return lines


def greedy_agreement(phases: dict, dtypes: list[str | None]) -> dict:
    """Per engine: how many prompts got exactly our offline token ids in the same dtype (greedy;
    informational, never asserted; the first round's ids); HF against ours in the first dtype; the batch-1
    runs (one prompt) as the number of leading tokens equal to ours on that prompt in the first dtype.

    Near-ties can flip a token anywhere in 128 (and bf16 or int8 weights are other weights), so a few
    differences are normal. Drops the token ids from the phases afterwards (the raw worker files keep them).
    """
    out = {}
    for dtype in dtypes:
        ours = (_ok(phases, name("ours_offline", dtype)) or {}).get("output_token_ids")
        peers = [name("vllm_offline", dtype)] + (["hf"] if dtype == dtypes[0] else [])
        for peer in peers:
            theirs = (_ok(phases, peer) or {}).get("output_token_ids")
            if ours and theirs:
                out[peer] = f"{sum(a == b for a, b in zip(ours, theirs, strict=False))}/{len(ours)}"
    ours = (_ok(phases, name("ours_offline", dtypes[0])) or {}).get("output_token_ids")
    for peer in [n for n in phases if n.startswith(("ours_batch1_", "llamacpp_batch1"))]:
        theirs = (_ok(phases, peer) or {}).get("output_token_ids")
        if ours and theirs:
            a, b = ours[0], theirs[0]
            same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            out[peer] = f"first {same} of {len(a)} tokens"
    for res in phases.values():
        res.pop("output_token_ids", None)
    return out


def table(result: dict) -> str:
    """The results as markdown: the throughput table, the batch-1 table, then ratio, round, host lines."""
    lines = ["| engine | output tok/s | TTFT p50 / p99 s | ITL p50 / p99 ms | peak RSS MiB | other CPU cores busy | note |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['name']} | {_fmt(r['output_tokens_per_s'], '.1f')} | "
                     f"{_fmt(r['ttft_p50_s'], '.2f')} / {_fmt(r['ttft_p99_s'], '.2f')} | "
                     f"{_fmt(r['itl_p50_ms'], '.0f')} / {_fmt(r['itl_p99_ms'], '.0f')} | "
                     f"{_fmt(r['peak_rss_mib'], '.0f')} | {_fmt(r['other_cpu_cores_busy'], '.2f')} | {r['note']} |")
    lines += ["", *batch1_table(result), ""]
    if structured := structured_table(result):
        lines += [*structured, ""]
    ratios = ", ".join(f"{k} {v:.2f}" for k, v in result["ratios"].items() if v is not None)
    lines.append(f"Ratios: {ratios or '–'}.")
    if priority := _ok(result["phases"], "ours_priority"):
        lines.append(f"Request priority (ours_priority): {priority_line(priority)}.")
    lines.extend(rounds_lines(result))
    agree = ", ".join(f"{k} {v}" for k, v in result.get("greedy_agreement_with_ours_offline", {}).items())
    lines.append(f"Greedy tokens equal to ours offline (same dtype; batch-1: ours in the first dtype): {agree or '–'}.")
    lines.extend(host_lines(result))
    for n, why in result["skipped"].items():
        lines.append(f"Skipped {n}: {why.splitlines()[0][:200]}")
    return "\n".join(lines)


def batch1_table(result: dict) -> list[str]:
    """Batch-1 decode against the same run's bandwidth ceiling, as markdown lines."""
    n = result["workload"]["max_new_tokens"]
    bw = result.get("read_bandwidth_bytes_per_s") or read_bandwidth(result["phases"])
    lines = [f"Batch-1 decode (one request, {n} tokens, prefill excluded) against the read-bandwidth ceiling "
             f"(weight bytes per token / the run's best read bandwidth, {_fmt(bw['best'] and bw['best'] / 1e9, '.1f')} "
             f"GB/s: start {_fmt(bw['peak_start'] and bw['peak_start'] / 1e9, '.1f')}, end "
             f"{_fmt(bw['peak_end'] and bw['peak_end'] / 1e9, '.1f')}):", "",
             "| engine | weights | decode tok/s | weight MB / token | ceiling tok/s | fraction of ceiling | note |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in result.get("batch1") or []:
        mb = r["bytes_per_token"] and r["bytes_per_token"] / 1e6
        lines.append(f"| {r['name']} | {r['weights']} | {_fmt(r['decode_tokens_per_s'], '.1f')} | {_fmt(mb, '.1f')} | "
                     f"{_fmt(r['ceiling_tokens_per_s'], '.1f')} | {_fmt(r['fraction_of_ceiling'], '.2f')} | {r['note']} |")
    return lines


def host_lines(result: dict) -> list[str]:
    """The machine: CPU, flags, cores, memory, caches, huge pages, the probes, thread counts, vLLM's preload."""
    m, ph = result["machine"], result["phases"]
    cpu = m.get("cpu") if isinstance(m.get("cpu"), dict) else {"model": m.get("cpu")}
    threads = next((r.get("torch_num_threads") for r in map(lambda d: _ok(ph, name("ours_offline", d)),
                                                             dtypes_of(result)) if r), None)
    caches = m.get("caches_bytes") or {}
    l3 = caches.get("L3")
    # the model name alone can hide the generation (a VM's "AMD EPYC" was Zen 4 in one run, Zen 5 in another)
    fms = cpu.get("family_model_stepping") or []
    generation = (f" (family {fms[0]} model {fms[1]} stepping {fms[2]})"
                  if len(fms) == 3 and all(x is not None for x in fms) else "")
    small = "".join(f", {level} {caches[level] // 1024} KiB" for level in ("L1d", "L2") if caches.get(level))
    lines = [f"Machine: {cpu.get('model')}{generation}, {m['affinity_cpus']} CPUs"
             + (f" ({m['physical_cores_in_affinity']} physical cores)" if m.get("physical_cores_in_affinity") else "")
             + (f", {m['mem_total_bytes'] / 2**30:.1f} GiB" if m.get("mem_total_bytes") else "")
             + small + (f", L3 {l3 / 2**20:.0f} MiB" if l3 else "") + (f", THP {m['thp']}" if m.get("thp") else "")
             + (", a VM (hypervisor flag)" if cpu.get("hypervisor") else "")
             + (f"; flags {' '.join(cpu['flags_of_interest'])}" if cpu.get("flags_of_interest") is not None else "")
             + f"; --threads {result['config']['threads']} (torch threads seen in our engine: "
             f"{threads if threads is not None else '–'}); load average before "
             f"{'/'.join(f'{x:.2f}' for x in m['before']['loadavg_1_5_15'])}, after "
             f"{'/'.join(f'{x:.2f}' for x in m['after']['loadavg_1_5_15'])}; other processes used "
             f"{m['before']['other_cpu_cores_busy']:.2f} cores before the run."]
    for p in ("peak_start", "peak_end"):
        if res := _ok(ph, p):
            mem = res.get("mem_read") or {}
            mem_text = (f"read {mem['best_bytes_per_s'] / 1e9:.1f} GB/s (best of {mem['repeats']} passes over "
                        f"{mem['bytes'] / 2**20:.0f} MiB, {mem['threads']} threads on CPUs {mem.get('bound_cpus')}, "
                        f"{(mem.get('anon_huge_pages_bytes') or 0) / 2**20:.0f} MiB on huge pages"
                        + _cpu_share(mem) + ")"
                        if "best_bytes_per_s" in mem else f"read bandwidth not measured: {mem.get('skipped', '–')[:150]}")
            fma = res.get("fma_peak") or {}
            fma_text = (f"; float32 FMA peak {fma['best_flops_per_s'] / 1e9:.0f} GFLOP/s ({fma['threads']} threads, "
                        f"{fma['lanes']}-lane vectors)" if "best_flops_per_s" in fma else "")
            lines.append(f"Probes at {p.split('_')[1]}: {one_line(res).split(';')[0]}; {mem_text}{fma_text}.")
    if pre := result.get("vllm_preload"):
        used = pre.get("ld_preload") or "nothing"
        why = "; ".join(f"{k}: {v}" for k, v in (pre.get("why_not") or {}).items())
        lines.append(f"vLLM LD_PRELOAD: {used}" + (f" (not preloaded: {why[:300]})" if why else "") + ".")
    return lines


def _cpu_share(mem: dict) -> str:
    """The probe's CPU share in its best pass; a warning below 0.9 (the threads waited for the CPU, so the
    figure is this busy machine's share of its bandwidth and the ceilings are too low)."""
    share = mem.get("cpu_fraction")
    if share is None:
        return ""
    return f", its threads on the CPU {100 * share:.0f} % of the pass" + (
        ": a busy machine, the figure is its share, not the bandwidth" if share < 0.9 else "")


def _round_cell(rnd: dict, label: str) -> str:
    """One round for the table: "K engine tok/s (steal % / load / other cores / idle peer cores)"."""
    m = rnd.get("machine") or {}
    during, before = m.get("during") or {}, m.get("before") or {}
    steal = during.get("steal_fraction")
    load = (before.get("loadavg_1_5_15") or [None])[0]
    return (f"{rnd['round']} {label} {_fmt(rnd['output_tokens_per_s'], '.1f')} "
            f"({_fmt(None if steal is None else 100 * steal, '.1f')} / {_fmt(load, '.2f')} / "
            f"{_fmt(during.get('other_cpu_cores_busy'), '.2f')} / {_fmt(during.get('idle_peer_cpu_cores_busy'), '.2f')})")


def rounds_lines(result: dict) -> list[str]:
    """How each set of rounds ran (offline per dtype; batch-1): the per-round ratio and its spread, and the
    machine in each round."""
    ph, out = result["phases"], []
    sets = [(f"Offline{_label(d)}", [(name("ours_offline", d), "ours"), (name("vllm_offline", d), "vLLM")])
            for d in dtypes_of(result)]
    batch1 = [(n, n.removeprefix("ours_batch1_").replace("_", " ") if n.startswith("ours") else "llama.cpp")
              for n in ph if n.startswith(("ours_batch1_", "llamacpp_batch1"))]
    sets.append(("Batch-1", batch1))
    for title, engines in sets:
        engines = [(k, label) for k, label in engines if _round_rates(_ok(ph, k))]
        if not engines:
            continue
        n = max(len(_round_rates(_ok(ph, k))) for k, _ in engines)
        pairs = [(k, v) for k, v in (result.get("offline_rounds") or {}).items()
                 if v and any(k.startswith(e) for e, _ in engines)]
        if pairs:
            head = f"{title}: {n} rounds, interleaved (the engines loaded together, one running while the others wait, " \
                   "who goes first rotating each round); " + "; ".join(
                       f"{k.replace('_vs_', ' / ')} per round {', '.join(f'{x:.2f}' for x in v['per_round'])}: median "
                       f"{v['median']:.2f}, min {v['min']:.2f}, max {v['max']:.2f}" for k, v in pairs) + "."
        else:
            head = f"{title}: {n} rounds of {' and '.join(label for _, label in engines)} alone (no peer to take turns with)."
        # in the order they ran: by round, then who went first
        cells = sorted(((r["round"], (r.get("machine") or {}).get("position", 0), _round_cell(r, label))
                        for k, label in engines for r in _ok(ph, k)["rounds"]))
        out += [head, f"{title} rounds, tok/s (steal % of CPU time / load average 1 min before / other processes' "
                      f"cores / idle peers' cores): {'; '.join(cell for _, _, cell in cells)}."]
    return out


def host_kind(result: dict) -> str:
    """The kind of host a run was on: CPU model, family and model (ratios move with it; results/ keeps the
    newest run of each kind)."""
    cpu = result["machine"].get("cpu")
    if not isinstance(cpu, dict):
        return str(cpu)
    fms = cpu.get("family_model_stepping")
    return f"{cpu['model']}, family {fms[0]} model {fms[1]}" if fms else cpu["model"]


def latest_per_host_kind(results_dir: Path = RESULTS, paths: list[Path] | None = None) -> list[Path]:
    """The newest bench-*.json (by its recorded date; smoke runs left out) of each host kind in `results_dir`
    (or among `paths`), in host-kind order: the runs docs/performance.md shows."""
    newest: dict[str, tuple[str, Path]] = {}
    for path in results_dir.glob("bench-*.json") if paths is None else paths:
        if not path.name.startswith("bench-") or path.suffix != ".json" or path.name.startswith("bench-smoke-"):
            continue
        result = json.loads(path.read_text())
        cpu = result["machine"].get("cpu")
        if not isinstance(cpu, dict) or not cpu.get("family_model_stepping"):
            continue                    # older runs record no CPU family and model: no host kind
        kind = host_kind(result)
        if kind not in newest or result["date"] > newest[kind][0]:
            newest[kind] = (result["date"], path)
    return [newest[kind][1] for kind in sorted(newest)]


def _gflops(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f} GFLOP/s"


def docs_section(result: dict, json_path: str) -> str:
    """One host kind's current table for docs/performance.md: date, host, commit, ours against vLLM and
    llama.cpp, against the ceilings, and the plot beside the JSON (`json_path` relative to docs/)."""
    if "rows" not in result:
        add_summary(result)
    dtypes = [d for d in dtypes_of(result) if d]
    ratios, rows = result["ratios"], {r["name"]: r for r in result.get("batch1") or []}
    rev = result.get("source") or {}
    commit = (f"commit {rev['commit'][:12]}{' with uncommitted changes' if rev.get('dirty') else ''}"
              if rev.get("commit") else "commit not recorded")
    w, c, m = result["workload"], result["config"], result["machine"]
    offline = {d: _ok(result["phases"], f"ours_offline_{d}") for d in dtypes}
    lines = [f"### {host_kind(result)}", "",
             f"Run {result['date']} on {host_kind(result)} ({m['affinity_cpus']} CPUs, {c['threads']} threads), "
             f"{commit}: {w['num_prompts']} MT-bench prompts × {w['max_new_tokens']} greedy tokens "
             f"([`{Path(json_path).name}`]({json_path})).", "",
             "| | " + " | ".join(dtypes) + " |", "|---|" + "---:|" * len(dtypes)]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("ours offline, output tok/s", [_fmt((offline[d] or {}).get("output_tokens_per_s"), ".1f") for d in dtypes])
    row("ours / vLLM CPU, offline (median of per-round ratios)",
        [_fmt(ratios.get(f"ours_offline_{d}_vs_vllm_offline_{d}"), ".2f") for d in dtypes])
    busy = (result.get("config") or {}).get("busy_cores")
    if busy:
        row(f"ours / vLLM CPU, offline, {busy} of the cores busy (--busy-cores)",
            [_fmt(ratios.get(f"ours_offline_busy_{d}_vs_vllm_offline_busy_{d}"), ".2f") for d in dtypes])
        row(f"ours offline, {busy} of the cores busy / quiet",
            [_fmt(ratios.get(f"ours_offline_busy_{d}_vs_ours_offline_{d}"), ".2f") for d in dtypes])
    row("ours / vLLM CPU, batch-1 decode", [_fmt(ratios.get(f"ours_batch1_{d}_vs_vllm_batch1_{d}"), ".2f") for d in dtypes])
    row("ours int8 weights / llama.cpp Q4_1, batch-1 decode",
        [_fmt(ratios.get(f"ours_batch1_int8_{d}_vs_llamacpp_batch1"), ".2f") for d in dtypes])
    row("ours offline / compute bound (workload FLOPs at the peak matmul rate)",
        [_fmt(ratios.get(f"ours_offline_{d}_vs_compute_bound"), ".2f") for d in dtypes])
    row("ours batch-1 / read-bandwidth ceiling (weight bytes a token)",
        [_fmt((rows.get(f"ours {d}") or {}).get("fraction_of_ceiling"), ".2f") for d in dtypes])
    bw = result.get("read_bandwidth_bytes_per_s") or read_bandwidth(result["phases"])
    peaks = result.get("compute_bound_by_dtype") or {}
    fma = (result.get("fma_bound") or {}).get("peak_gflops_per_s")
    lines += ["", f"Ceilings, measured in the same run: read bandwidth {_fmt(bw['best'] and bw['best'] / 1e9, '.1f')} GB/s; "
              + "; ".join(f"peak matmul {d} {_gflops((peaks.get(d) or {}).get('peak_gflops_per_s'))}" for d in dtypes)
              + (f"; float32 FMA peak {_gflops(fma)}" if fma else "") + ".", "",
              f"![{host_kind(result)}]({str(Path(json_path).with_suffix('.png'))})"]
    return "\n".join(lines)


def render_docs(runs: list[Path], doc: Path = PERFORMANCE) -> str:
    """The block between the markers of `doc`: each run's section, in the order given."""
    sections = [docs_section(json.loads(run.read_text()), os.path.relpath(run, doc.parent)) for run in runs]
    return f"{DOCS_START}\n" + "\n\n".join(sections) + f"\n{DOCS_END}"


def write_docs(runs: list[Path] | None = None, doc: Path = PERFORMANCE) -> None:
    """Replace the block between the markers in `doc` with the tables of `runs` (default: the newest run of
    each host kind in benchmarks/results)."""
    block = render_docs(latest_per_host_kind() if runs is None else runs, doc)
    text = doc.read_text()
    pattern = re.compile(re.escape(DOCS_START) + ".*?" + re.escape(DOCS_END), re.S)
    if not pattern.search(text):
        raise ValueError(f"{doc} has no {DOCS_START} ... {DOCS_END} block")
    doc.write_text(pattern.sub(lambda _: block, text))


# ---- the plot --------------------------------------------------------------------------------------------

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
    """The PNG: throughput per engine and dtype (a dot per round), batch-1 against its bandwidth ceiling, and the
    servers' TTFT and ITL against concurrency; the four panels to `path` (matplotlib's Agg backend) to `path` (PNG, matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write-docs", action="store_true",
                   help="replace docs/performance.md's tables with the newest run of each host kind in benchmarks/results")
    p.add_argument("runs", nargs="*", type=Path, help="result JSONs to print the table of (default: none)")
    args = p.parse_args(argv)
    for run in args.runs:
        result = json.loads(run.read_text())
        if "rows" not in result:
            add_summary(result)
        print(table(result))
    if args.write_docs:
        write_docs()
        print(f"updated {PERFORMANCE}")
    elif not args.runs:
        p.error("nothing to do: give --write-docs or a result JSON")
    return 0


if __name__ == "__main__":
    sys.exit(main())
