"""Metrics sinks: what TensorBoard, ``metrics.jsonl`` and W&B (offline) hold after logging, the
disabled logger, ``trainer.logger`` name errors and the missing-wandb error. No network."""

from __future__ import annotations

import json
import math
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from ragen_jax.metrics import (
    SINKS,
    WANDB_MISSING,
    JsonlSink,
    MetricsLogger,
    MetricsSink,
    TensorBoardSink,
    WandbSink,
    device_memory,
    make_sinks,
    read_jsonl,
)


def _tb_scalars(tb_dir: Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` from the TFRecord event files (tensorboardX's protobuf)."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, dict[int, float]] = {}
    files = sorted(tb_dir.glob("events.out.tfevents.*"))
    assert files, f"no event file in {tb_dir}"
    for path in files:
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            ev = Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in ev.summary.value:
                out.setdefault(v.tag, {})[ev.step] = v.simple_value
    return out


class ListSink:
    def __init__(self):
        self.calls, self.closed = [], False

    def log(self, step, metrics):
        self.calls.append((step, dict(metrics)))

    def close(self):
        self.closed = True


def test_default_logger_writes_tensorboard_and_jsonl_and_a_resumed_run_appends(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=3, progress=False)
    log.log(0, {"val-env/Bandit/success": 0.25})
    log.log(1, {"train/Bandit/success": np.float32(0.5), "actor/entropy": float("nan"),
                "rollout/len": np.array(3), "note": "text", "hist": np.ones(4), "flag": True})
    log.close()
    log = MetricsLogger(tmp_path, total_steps=3, start_step=1, progress=False)  # resumed
    log.log(1, {"train/Bandit/success": 0.75})
    log.log(2, {"train/Bandit/success": 1.0, "timing_s/step": 2.5})
    log.close()

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 1, 2]
    m = read_jsonl(tmp_path / "metrics.jsonl")
    assert m[0] == {"val-env/Bandit/success": 0.25}
    assert m[1]["train/Bandit/success"] == 0.75 and m[1]["rollout/len"] == 3.0 and m[1]["flag"] == 1.0
    assert math.isnan(m[1]["actor/entropy"]) and "note" not in m[1] and "hist" not in m[1]
    assert m[2] == {"train/Bandit/success": 1.0, "timing_s/step": 2.5}

    tb = _tb_scalars(tmp_path / "tb")
    assert tb["train/Bandit/success"] == {1: 0.75, 2: 1.0}  # the resumed run's value is later
    assert tb["val-env/Bandit/success"] == {0: 0.25} and tb["rollout/len"] == {1: 3.0}
    assert "actor/entropy" not in tb and "note" not in tb and "hist" not in tb  # NaN skipped


def test_rewind_drops_the_rows_a_resumed_run_plays_again(tmp_path):
    """Resumed from the checkpoint of step 1, a run logs steps 2 on anew: the earlier
    process's rows of those steps (and its cut-off last line, killed mid-write) go, the rows
    up to step 1 stay, and the new rows follow them, one row a step."""
    log = MetricsLogger(tmp_path, total_steps=3, progress=False)
    for step in range(4):
        log.log(step, {"x": float(step)})
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "x"')  # no newline: the process died here
    log = MetricsLogger(tmp_path, total_steps=3, start_step=1, progress=False)
    log.rewind(1)
    log.log(2, {"x": 20.0})
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"step": 0, "x": 0.0}, {"step": 1, "x": 1.0},
                                              {"step": 2, "x": 20.0}]
    assert read_jsonl(tmp_path / "metrics.jsonl") == {0: {"x": 0.0}, 1: {"x": 1.0}, 2: {"x": 20.0}}
    log = MetricsLogger(tmp_path, total_steps=3, progress=False)
    log.rewind(-1)  # a fresh start plays every step again
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_logger_fans_out_floats_to_given_sinks_and_closes_them(tmp_path, capsys):
    a, b = ListSink(), ListSink()
    assert isinstance(a, MetricsSink)
    log = MetricsLogger(tmp_path / "run", sinks=[a, b], total_steps=2, progress=False)
    log.log(3, {"x": np.int64(2), "s": "no"})
    log.print("hello")
    log.advance(3, "info")
    log.close()
    assert a.calls == b.calls == [(3, {"x": 2.0})] and type(a.calls[0][1]["x"]) is float
    assert a.closed and b.closed
    assert not (tmp_path / "run").exists()  # the given sinks write nothing here
    assert "hello" in capsys.readouterr().out


def test_trainer_call_with_progress_bar_still_works(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=2, start_step=0, enabled=True, progress=True)
    log.log(1, {"train/T/success": 1.0})
    log.advance(1, "success 1.00")
    log.print("step 1")
    log.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == {1: {"train/T/success": 1.0}}


def test_disabled_logger_creates_nothing(tmp_path, capsys):
    out, sink = tmp_path / "run", ListSink()
    for sinks in (None, [sink]):
        log = MetricsLogger(out, sinks=sinks, total_steps=2, enabled=False, progress=True)
        log.log(1, {"x": 1.0})
        log.advance(1, "x")
        log.print("quiet")
        log.close()
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert sink.calls == [] and capsys.readouterr().out == ""


def test_make_sinks_names(tmp_path):
    assert SINKS == ("tensorboard", "jsonl", "wandb")
    assert make_sinks(["console"], tmp_path / "a", project="p", name="n", config={}) == []
    assert not (tmp_path / "a").exists()
    sinks = make_sinks(["console", "jsonl", "tensorboard", "jsonl"], tmp_path / "b", project="p",
                       name="n", config={})
    assert [type(s) for s in sinks] == [JsonlSink, TensorBoardSink]
    log = MetricsLogger(tmp_path / "b", sinks=sinks, total_steps=1, progress=False)
    log.log(1, {"x": 1.0})
    log.close()
    assert read_jsonl(tmp_path / "b" / "metrics.jsonl") == {1: {"x": 1.0}}
    assert _tb_scalars(tmp_path / "b" / "tb") == {"x": {1: 1.0}}


def test_unknown_sink_is_a_one_line_error_naming_trainer_logger(tmp_path):
    with pytest.raises(ValueError) as e:
        make_sinks(["tensorboard", "mlflow"], tmp_path / "run", project="p", name="n", config={})
    assert str(e.value) == "trainer.logger: unknown sink 'mlflow'; choose from tensorboard, jsonl, wandb"
    assert not (tmp_path / "run").exists()  # checked before anything is created


def test_missing_wandb_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    for make in (lambda: make_sinks(["tensorboard", "wandb"], tmp_path / "run", project="p",
                                    name="n", config={}),
                 lambda: WandbSink(tmp_path / "run", project="p", name="n", config={})):
        with pytest.raises(ImportError) as e:
            make()
        assert isinstance(e.value, ValueError)  # config validation catching ValueError sees it
        assert str(e.value) == WANDB_MISSING and "\n" not in str(e.value)
        assert "pip install 'ragen_jax[wandb]'" in str(e.value)
    assert not (tmp_path / "run").exists()


# --- W&B, offline --------------------------------------------------------------------------

def _wandb_records(run_dir: Path):
    """The protobuf records of an offline run's ``.wandb`` file (LevelDB-style log: 32 KiB
    blocks of ``crc32 | length u16 | type u8`` chunks after a 7-byte ``:W&B`` header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("*.wandb")
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, buf, recs = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:  # block padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # full, last
            recs.append(pb.Record.FromString(buf))
            buf = b""
    return recs


def _finished_records(run_dir: Path, timeout_s: float = 30.0):
    """The records once the run's ``exit`` record is on disk: wandb-core writes the file
    asynchronously and may still be flushing it when ``finish()`` has returned."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            recs = _wandb_records(run_dir)
            if recs and recs[-1].WhichOneof("record_type") == "exit":
                return recs
        except (ValueError, AssertionError, struct.error, DecodeError):
            pass  # not created or half written yet
        assert time.monotonic() < deadline, f"no exit record in {run_dir} after {timeout_s} s"
        time.sleep(0.1)


def _items(items) -> dict[str, float]:
    return {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in items}


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    home = tmp_path / "wandb_home"
    for var, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                       "WANDB_DIR": str(home), "WANDB_CONFIG_DIR": str(home / "config"),
                       "WANDB_CACHE_DIR": str(home / "cache"), "WANDB_DATA_DIR": str(home / "data")
                       }.items():
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    monkeypatch.delenv("WANDB_RESUME", raising=False)
    yield tmp_path / "run"
    # wandb's service connection and its threads (an asyncio loop, a queue publisher) would
    # otherwise live on in this xdist worker under every later test's XLA compiles.
    wandb.teardown()


def test_wandb_offline_logs_history_and_a_resumed_run_reuses_the_id(wandb_offline):
    out, t0 = wandb_offline, time.monotonic()
    sinks = make_sinks(["console", "jsonl", "wandb"], out, project="ragen_jax-test", name="bandit",
                       config={"trainer": {"total_steps": 3}, "out": out})
    wb = sinks[1]
    assert isinstance(wb, WandbSink) and isinstance(wb, MetricsSink)
    run_id = (out / "wandb_run_id").read_text().strip()
    assert run_id and wb.run.id == run_id
    log = MetricsLogger(out, sinks=sinks, total_steps=3, progress=False)
    for step in range(3):
        log.log(step, {"train/Bandit/success": step / 2, "actor/entropy": 1.0 - step / 4, "s": "x"})
    log.close()

    (run_dir,) = (out / "wandb").glob(f"offline-run-*-{run_id}")
    recs = _finished_records(run_dir)
    history = [_items(r.history.item) for r in recs if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == [0, 1, 2]
    assert [h["train/Bandit/success"] for h in history] == [0.0, 0.5, 1.0]
    assert history[-1]["actor/entropy"] == 0.5 and all("s" not in h for h in history)
    summary: dict[str, float] = {}
    for r in recs:
        if r.WhichOneof("record_type") == "summary":
            summary |= _items(r.summary.update)
    assert summary["train/Bandit/success"] == 1.0
    config = [r.config for r in recs if r.WhichOneof("record_type") == "config"]
    run = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
    assert run and run[0].run_id == run_id and run[0].display_name == "bandit"
    assert run[0].project == "ragen_jax-test"
    assert any("trainer" in _items(c.update) for c in config + [r.config for r in run])
    summary_file = run_dir / "files" / "wandb-summary.json"
    if summary_file.exists():  # written by some wandb versions in offline mode too
        assert json.loads(summary_file.read_text())["train/Bandit/success"] == 1.0

    # The resumed run: offline folders are named by the second, so start it in a later one.
    time.sleep(max(0.0, 1.1 - (time.monotonic() - t0)))
    again = WandbSink(out, project="ragen_jax-test", name="bandit", config={})
    assert again.run_id == run_id and again.run.id == run_id
    again.log(3, {"train/Bandit/success": 0.0})
    again.close()
    (resumed_dir,) = set((out / "wandb").glob(f"offline-run-*-{run_id}")) - {run_dir}
    resumed = [_items(r.history.item) for r in _finished_records(resumed_dir)
               if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["train/Bandit/success"]) for h in resumed] == [(3, 0.0)]
    assert (out / "wandb_run_id").read_text().strip() == run_id
    assert read_jsonl(out / "metrics.jsonl")[2]["train/Bandit/success"] == 1.0


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_device_memory_reports_the_largest_peak_and_the_smallest_limit():
    gib = 1024 ** 3
    devices = [_Device({"peak_bytes_in_use": 3 * gib, "bytes_in_use": gib, "bytes_limit": 80 * gib}),
               _Device({"peak_bytes_in_use": 5 * gib, "bytes_in_use": 2 * gib, "bytes_limit": 79 * gib})]
    assert device_memory(devices) == {"perf/max_memory_allocated_gib": 5.0,
                                      "perf/memory_in_use_gib": 2.0, "perf/memory_limit_gib": 79.0}


def test_device_memory_is_empty_where_the_backend_keeps_no_statistics():
    assert device_memory([_Device(None)]) == {}
    assert device_memory() == {}  # XLA:CPU, the test machines
