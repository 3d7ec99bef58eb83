"""The GPU decode-attention bench's CPU dry run, and the break-even table reading a stored
measurement: ``bench/decode_attention_gpu.py --device cpu --json`` prints rows whose fields and
KV bytes are right, and :func:`cpbook.costmodel.break_even_table` switches from the modelled
one-request KV read to a stored one (and says so in ``source``)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import cpbook.costmodel as cm
from cpbook.costmodel import break_even

BENCH = Path(__file__).resolve().parents[1] / "bench" / "decode_attention_gpu.py"
FIELDS = {
    "name",
    "kind",
    "backend",
    "context",
    "kv_heads",
    "q_heads",
    "k_width",
    "v_width",
    "dtype",
    "elem_bytes",
    "repeats",
    "inner",
    "time_s",
    "kv_bytes",
    "bytes_per_s",
    "peak_bytes_per_s",
    "hbm_fraction",
    "device",
    "date_utc",
}


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("decode_attention_gpu", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_dry_run_rows(bench, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "RESULTS", tmp_path / "out.jsonl")
    bench.main(["--device", "cpu", "--json", "--store"])
    assert not (tmp_path / "out.jsonl").exists()  # a CPU run is never stored
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[0]["name"] == "machine" and lines[0]["device"] == "cpu"
    rows = [r for r in lines if r["name"] == "decode_attention_gpu"]
    assert len(rows) == len(lines) - 1  # nothing skipped on the CPU
    shapes = {(r["kind"], r["kv_heads"], r["q_heads"], r["k_width"], r["v_width"]) for r in rows}
    assert shapes == {("gqa", h, 8 * h, 128, 128) for h in (1, 2, 4, 8)} | {
        ("mla", 1, q, 576, 512) for q in (16, 128)
    }
    for r in rows:
        assert set(r) == FIELDS
        assert r["backend"] == "sdpa_math" and r["device"] == "cpu"
        assert r["context"] in bench.CPU_CONTEXTS and r["dtype"] == "float32"
        width = r["k_width"] + r["v_width"]
        assert r["kv_bytes"] == r["context"] * r["kv_heads"] * width * r["elem_bytes"]
        assert r["elem_bytes"] == 4 and r["time_s"] > 0
        assert r["bytes_per_s"] == pytest.approx(r["kv_bytes"] / r["time_s"])
        assert r["peak_bytes_per_s"] is None and r["hbm_fraction"] is None


def test_peak_is_matched_by_device_name(bench):
    assert bench.gpu_spec("NVIDIA H200").hbm_bw_bytes_per_s == 4.8e12
    assert bench.gpu_spec("NVIDIA H100 80GB HBM3").hbm_bw_bytes_per_s == 3.35e12
    assert bench.gpu_spec("NVIDIA A10G") is None
    assert bench.kv_bytes(1 << 20, 8, 128, 128, 2) == 4 << 30  # 1M tokens, 8 KV heads: 4 GiB


def _row(**kw):
    row = {
        "name": "decode_attention_gpu",
        "kind": "mla",
        "backend": "flash_mla",
        "context": 1 << 20,
        "kv_heads": 1,
        "q_heads": 16,
        "hbm_fraction": 0.5,
        "device": "cuda:0 (NVIDIA H200)",
        "date_utc": "2027-01-02 03:04",
    }
    return {**row, **kw}


def _store(path: Path, *rows: dict) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_break_even_is_modelled_without_a_measurement(tmp_path, monkeypatch):
    monkeypatch.setattr(break_even, "KV_READ_RESULTS", tmp_path / "absent.jsonl")
    table = cm.break_even_table()
    assert {r.source for r in table} == {break_even.MODELLED}
    assert table == cm.break_even_table(measured=None)
    assert cm.headline_break_even(table).kv_read_efficiency == 0.35


def test_break_even_reads_a_stored_measurement(tmp_path, monkeypatch):
    path = tmp_path / "decode_attention_gpu.jsonl"
    _store(
        path,
        {"name": "machine", "device": "cuda:0 (NVIDIA H200)"},
        _row(),
        _row(hbm_fraction=0.3, backend="sdpa_efficient"),  # slower kernel: not the one used
        _row(context=65536, hbm_fraction=0.9),  # shorter context: not the one used
        _row(q_heads=128, hbm_fraction=0.7),  # not DeepSeek-V3's 16 heads per rank at TP 8
        _row(kind="gqa", hbm_fraction=0.6),  # GQA: not DeepSeek-V3's
        _row(device="cpu", hbm_fraction=None),
    )
    monkeypatch.setattr(break_even, "KV_READ_RESULTS", path)
    got = cm.stored_kv_read()
    assert got.efficiency == 0.5 and got.backend == "flash_mla" and got.context == 1 << 20
    table = cm.break_even_table()
    modelled = cm.break_even_table(measured=None)
    source = "measured on cuda:0 (NVIDIA H200), 2027-01-02 03:04"
    assert got.source == source
    for row, old in zip(table, modelled):
        if row.decode_model == "whole-model":
            assert row.source == source
            if row.num_reqs == 1:
                assert row.kv_read_efficiency == 0.5 != old.kv_read_efficiency
                assert row.tokens != old.tokens  # a faster KV read: a later break-even
        else:
            assert row == old  # the per-layer model's read is bandwidth-bound either way
    assert table == cm.break_even_table(measured=got)
    # an H100 row stands in for an H200 table; a short-context-only store does not count
    _store(path, _row(device="cuda:0 (NVIDIA H100 80GB HBM3)", hbm_fraction=0.45))
    assert cm.stored_kv_read().efficiency == 0.45
    _store(path, _row(context=65536))
    assert cm.stored_kv_read() is None
    assert {r.source for r in cm.break_even_table()} == {break_even.MODELLED}
