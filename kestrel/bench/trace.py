"""What the device ran during a torch-profiler window, and where it sat idle: kernel and copy
time by name, the union of busy time, and the longest idle gaps with the host calls that ran
during each (a synchronisation there says the host made the device wait)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cuda_runtime", "cuda_driver", "cpu_op", "python_function")


def device_timeline(prof, trace_path: Path, steps: int = 1, gap_us: float = 20.0) -> dict:
    """Summarise `prof` (exported to `trace_path` as a Chrome trace), per step where times
    are totals: span, busy and idle milliseconds, the top kernels, the ten longest gaps."""
    prof.export_chrome_trace(str(trace_path))
    events = json.loads(trace_path.read_text())["traceEvents"]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    if not device:
        return {"device_events": 0}
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES and "dur" in e]
    busy, gaps, busy_until = 0.0, [], device[0]["ts"]
    for event in device:
        start, end = event["ts"], event["ts"] + event["dur"]
        if start - busy_until > gap_us:
            gaps.append((start - busy_until, busy_until, start))
        busy += max(0.0, end - max(start, busy_until))
        busy_until = max(busy_until, end)
    span = busy_until - device[0]["ts"]
    totals = Counter()
    for event in device:
        totals[event["name"][:70]] += event["dur"]
    longest = sorted(gaps, reverse=True)[:10]
    return {
        "device_events": len(device),
        "steps": steps,
        "span_ms_per_step": span / steps / 1e3,
        "busy_ms_per_step": busy / steps / 1e3,
        "idle_ms_per_step": (span - busy) / steps / 1e3,
        "gaps_per_step": len(gaps) / steps,
        "kernels_ms_per_step": {name: us / steps / 1e3 for name, us in totals.most_common(20)},
        "longest_gaps": [
            {
                "us": length,
                "at_us": begin - device[0]["ts"],
                "host": host_calls_between(host, begin, end),
            }
            for length, begin, end in longest
        ],
    }


def host_calls_between(host: list[dict], begin: float, end: float, top: int = 6) -> dict[str, float]:
    """Microseconds of each host call (by name) inside [begin, end], the largest first."""
    inside = Counter()
    for event in host:
        overlap = min(end, event["ts"] + event["dur"]) - max(begin, event["ts"])
        if overlap > 0:
            inside[event["name"][:60]] += overlap
    return dict(inside.most_common(top))
