"""What a compiled program runs and what a profile of it shows: the kernels of an optimized
HLO module and summaries of a Perfetto trace (``jax.profiler.trace``), as markdown lines.

Pure text and JSON work, no JAX: ``bench_decode`` counts its decode loop's kernels and
summarises its traced calls with these, ``bench_accelerator`` its traced train step.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from pathlib import Path

FREE_OPS = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all",
            "add-dependency", "opt-barrier", "domain", "async-update", "async-done"}
ANNOTATION = "bench_decode_"


# ----------------------------------------------------------------------------------------------
# optimized HLO: kernels of the decode loop (pure text, no JAX)
# ----------------------------------------------------------------------------------------------

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_INSTR = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def _opcode(rhs: str) -> str:
    """The opcode of an instruction's right-hand side ``shape opcode(operands), attrs``."""
    rest = rhs
    if rhs.startswith("("):  # a tuple shape: skip to its closing parenthesis
        depth = 0
        for i, ch in enumerate(rhs):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                rest = rhs[i + 1:]
                break
    else:
        rest = rhs.split(" ", 1)[1] if " " in rhs else ""
    m = re.match(r"\s*([\w\-]+)\(", rest)
    return m.group(1) if m else "?"


def hlo_computations(text: str) -> dict[str, list[tuple[str, str, str]]]:
    """Computation name -> its instructions as ``(name, opcode, right-hand side)``."""
    comps: dict[str, list[tuple[str, str, str]]] = {}
    current = None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(2)
                comps[current] = []
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            comps[current].append((m.group(1), _opcode(m.group(2)), m.group(2)))
    return comps


def _attr(rhs: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=%?([\w.\-]+)", rhs)
    return m.group(1) if m else None


def _category(op: str, rhs: str) -> str:
    """What a launched instruction is: fusion, gemm, copy, or its opcode."""
    if op == "fusion":
        if "__triton_gemm" in rhs:
            return "triton gemm fusion"
        return "cudnn fusion" if "__cudnn" in rhs else "fusion"
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', rhs)
        target = target.group(1) if target else "?"
        return "gemm (cuBLAS)" if "cublas" in target.lower() else f"custom-call {target}"
    if op in ("copy", "copy-start", "copy-done"):
        return "copy"
    return op


def count_launches(comps: dict, name: str, in_graph: bool = False) -> dict:
    """Kernels of computation ``name``: ``kernels`` (every device instruction, command
    buffers expanded), ``host_launches`` (a command buffer counted once), ``in_graph``
    (kernels inside command buffers) and ``by_kind``; a nested ``while``, plain ``call`` or
    ``async-start`` is expanded once (a loop's trip count is not known here)."""
    res = {"kernels": 0, "host_launches": 0, "in_graph": 0, "by_kind": Counter()}
    for _, op, rhs in comps.get(name, []):
        if op in FREE_OPS:
            continue
        callee = {"call": "to_apply", "while": "body", "async-start": "calls"}.get(op)
        callee = callee and _attr(rhs, callee)
        if callee is not None:
            graph = op == "call" and "command_buffer" in callee
            sub = count_launches(comps, callee, in_graph or graph)
            res["kernels"] += sub["kernels"]
            res["in_graph"] += sub["in_graph"]
            res["by_kind"] += sub["by_kind"]
            res["host_launches"] += (not in_graph) if graph else sub["host_launches"]
            continue
        res["kernels"] += 1
        res["in_graph"] += in_graph
        res["host_launches"] += not in_graph
        res["by_kind"][_category(op, rhs)] += 1
    return res


def decode_loop_kernels(text: str) -> dict:
    """Launch counts of the decode loop in optimized HLO ``text``: the ``while`` whose body
    has the most device instructions (the sampler's prefill has no loop on a GPU; where it
    has one, a ``lax.map`` over row blocks, it is the smaller)."""
    comps = hlo_computations(text)
    best = None
    for parent, instrs in comps.items():
        for _, op, rhs in instrs:
            if op != "while":
                continue
            body, cond = _attr(rhs, "body"), _attr(rhs, "condition")
            graph = "command_buffer" in parent  # the whole loop is one command buffer
            counts = count_launches(comps, body, graph)
            if best is None or counts["kernels"] > best["kernels"]:
                best = dict(counts, parent=parent, cond=count_launches(comps, cond, graph))
    if best is None:
        return {"error": "no while loop in the optimized HLO"}
    best["while_in_graph"] = "command_buffer" in best["parent"]
    best["by_kind"] = dict(best["by_kind"].most_common())
    best["cond_kernels"] = best.pop("cond")["kernels"]
    best["whiles"] = sum(op == "while" for ins in comps.values() for _, op, _ in ins)
    return best


# ----------------------------------------------------------------------------------------------
# profiler trace: Perfetto JSON summary (pure json/gzip)
# ----------------------------------------------------------------------------------------------


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals: time at least one kernel ran."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def trace_names(events: list[dict]) -> tuple[dict, dict]:
    """The trace's process names by pid and thread names by (pid, tid)."""
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") != "M":
            continue
        if e.get("name") == "process_name":
            procs[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    return procs, threads


def load_trace(trace_dir: Path) -> list[dict]:
    """The events of the newest ``perfetto_trace.json.gz`` under ``trace_dir``."""
    files = sorted(trace_dir.rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(files[-1], "rt") as f:
        data = json.load(f)
    return data.get("traceEvents", []) if isinstance(data, dict) else data


def md_cell(name: str, width: int = 90) -> str:
    """``name`` fit for a markdown table cell: one line, no pipes, at most ``width`` characters."""
    name = name.replace("|", "/").replace("\n", " ")
    return name if len(name) <= width else name[:width - 3] + "..."


def trace_summary(events: list[dict], steps: int, top: int = 15) -> list[str]:
    """Markdown lines: per token-step kernels, traced ms and GPU-busy time (the annotated
    full calls minus the 1-step call), GPU idle fraction, top kernels; without GPU kernel
    events, what the trace holds instead."""
    procs, threads = trace_names(events)
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    windows = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in spans
                     if str(e.get("name", "")).startswith(ANNOTATION))
    device = {p for p, n in procs.items() if "/device:" in n and "cpu" not in n.lower()}
    kernels = [e for e in spans if e.get("pid") in device
               and "stream" in threads.get((e.get("pid"), e.get("tid")), "").lower()]
    lines = []
    if not kernels:
        lines.append("No GPU kernel events in the trace; it holds (process / thread: events, "
                     "total ms):")
        where = Counter()
        total = Counter()
        for e in spans:
            key = f"{procs.get(e.get('pid'), e.get('pid'))} / " \
                  f"{threads.get((e.get('pid'), e.get('tid')), e.get('tid'))}"
            where[key] += 1
            total[key] += e["dur"]
        lines += [f"- {md_cell(k)}: {n}, {total[k] / 1e3:.1f}" for k, n in where.most_common(10)]
    per_window = []
    for t0, t1, name in windows:
        inside = [e for e in kernels if t0 <= e["ts"] < t1]
        busy = busy_union([(e["ts"], e["ts"] + e["dur"]) for e in inside])
        per_window.append({"name": name, "ms": (t1 - t0) / 1e3, "n": len(inside),
                           "busy_ms": busy / 1e3, "events": inside})
    full = [w for w in per_window if "full" in w["name"]]
    short = [w for w in per_window if "short" in w["name"]]
    if not full or not short:
        lines.append(f"Annotated calls not found in the trace ({len(windows)} windows).")
        return lines

    def mean(key: str) -> float:
        return sum(w[key] for w in full) / len(full)

    d = max(steps - 1, 1)
    step_ms = (mean("ms") - short[0]["ms"]) / d
    if not kernels:
        return lines + ["", f"Traced wall ms per token-step: {step_ms:.3f} (full calls "
                        f"{mean('ms'):.2f} ms each, the 1-step call {short[0]['ms']:.2f} ms)."]
    step_busy = (mean("busy_ms") - short[0]["busy_ms"]) / d
    lines += ["", "| per token-step | traced |", "|---|---:|",
              f"| wall ms (traced) | {step_ms:.3f} |",
              f"| kernels + memcpys | {(mean('n') - short[0]['n']) / d:.1f} |",
              f"| GPU busy ms | {step_busy:.3f} |",
              f"| GPU idle fraction | {1 - step_busy / step_ms if step_ms > 0 else float('nan'):.2f} |",
              "", f"Whole full calls: {mean('ms'):.2f} ms each, GPU busy "
              f"{mean('busy_ms'):.2f} ms (idle {1 - mean('busy_ms') / mean('ms'):.2f}), "
              f"{mean('n'):.0f} kernels + memcpys; the 1-step call: {short[0]['ms']:.2f} ms, "
              f"{short[0]['n']} kernels + memcpys."]
    return lines + top_kernels([e for w in full for e in w["events"]], len(full) * steps, top)


def top_kernels(events: list[dict], steps: int, top: int) -> list[str]:
    """Markdown table of the ``top`` kernel names by total time in ``events``."""
    time_by, count = Counter(), Counter()
    for e in events:
        time_by[e["name"]] += e["dur"]
        count[e["name"]] += 1
    total = sum(time_by.values()) or 1.0
    lines = ["", f"Top {top} kernels of the full calls (count per token-step: count / "
             f"{steps} steps, prefill included):", "",
             "| kernel | count | per step | total ms | share |", "|---|---:|---:|---:|---:|"]
    for name, t in time_by.most_common(top):
        lines.append(f"| `{md_cell(name)}` | {count[name]} | {count[name] / steps:.2f} | "
                     f"{t / 1e3:.2f} | {100 * t / total:.1f}% |")
    return lines


UPDATE_ANNOTATION = "bench_update_step"


def update_trace_lines(trace_dir: Path, top: int = 15) -> list[str]:
    """Markdown lines summarising the traced train step (``--trace-update``): wall and GPU-busy
    ms, kernels, kernels by kind, top kernels; on a backend without GPU kernel events, the
    traced wall ms and what the trace holds."""
    events = load_trace(trace_dir)
    procs, threads = trace_names(events)
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    window = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("name") == UPDATE_ANNOTATION]
    if not window:
        return [f"Annotation {UPDATE_ANNOTATION!r} not found in the trace ({len(spans)} spans)."]
    t0, t1 = window[0]
    device = {p for p, n in procs.items() if "/device:" in n and "cpu" not in n.lower()}
    kernels = [e for e in spans if e.get("pid") in device and t0 <= e["ts"] < t1
               and "stream" in threads.get((e.get("pid"), e.get("tid")), "").lower()]
    lines = ["", f"Traced step: wall {(t1 - t0) / 1e3:.1f} ms."]
    if not kernels:
        return lines + ["No GPU kernel events in the trace (a CPU backend)."]
    busy = busy_union([(e["ts"], e["ts"] + e["dur"]) for e in kernels]) / 1e3
    lines[-1] += (f" GPU busy {busy:.1f} ms (idle fraction {1 - busy / ((t1 - t0) / 1e3):.2f}), "
                  f"{len(kernels)} kernels + memcpys.")
    for title, key in (("kind (name without its numeric suffix)",
                        lambda n: re.sub(r"(_\d+)+$", "", n)), ("kernel", lambda n: n)):
        by_t, by_n = Counter(), Counter()
        for e in kernels:
            by_t[key(str(e["name"]))] += e["dur"]
            by_n[key(str(e["name"]))] += 1
        total = sum(by_t.values()) or 1.0
        lines += ["", f"Top {top} by time, per {title}:", "",
                  f"| {title} | count | total ms | share | mean us |", "|---|---:|---:|---:|---:|"]
        lines += [f"| `{md_cell(k)}` | {by_n[k]} | {t / 1e3:.2f} | {100 * t / total:.1f}% | "
                  f"{t / by_n[k]:.1f} |" for k, t in by_t.most_common(top)]
    return lines
