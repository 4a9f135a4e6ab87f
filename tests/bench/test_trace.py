"""The device-timeline summary of a profiler trace: busy time as the union of overlapping
device events, idle gaps, and the host calls that ran inside a gap."""

import json

import pytest

from kestrel.bench.trace import device_timeline


class RecordedTrace:
    """Stands in for a torch profiler: exports a fixed list of Chrome trace events."""

    def __init__(self, events: list[dict]) -> None:
        self.events = events

    def export_chrome_trace(self, path: str) -> None:
        with open(path, "w") as file:
            json.dump({"traceEvents": self.events}, file)


def kernel(name: str, ts: float, dur: float) -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_busy_time_is_the_union_and_gaps_name_the_host_calls_inside(tmp_path):
    events = [
        kernel("matmul", 0, 100),
        kernel("attention", 50, 100),  # overlaps the matmul: 150 us busy so far
        kernel("matmul", 400, 100),  # 250 us idle before it
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 160, "dur": 200},
        {"cat": "cpu_op", "name": "aten::copy_", "ts": 0, "dur": 10},  # before the gap
    ]
    summary = device_timeline(RecordedTrace(events), tmp_path / "trace.json", steps=2)
    assert summary["device_events"] == 3
    assert summary["span_ms_per_step"] == pytest.approx(0.25)
    assert summary["busy_ms_per_step"] == pytest.approx(0.125)
    assert summary["idle_ms_per_step"] == pytest.approx(0.125)
    assert summary["kernels_ms_per_step"] == pytest.approx({"matmul": 0.1, "attention": 0.05})
    (gap,) = summary["longest_gaps"]
    assert gap["us"] == 250 and gap["at_us"] == 150
    assert gap["host"] == {"cudaStreamSynchronize": 200}


def test_a_trace_without_device_events_says_so(tmp_path):
    assert device_timeline(RecordedTrace([]), tmp_path / "trace.json") == {"device_events": 0}
