"""Tests for labkit.perf.profiling: profiler wrappers, kernel tables, traces and memory snapshots."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import labkit as lk

PF = lk.profiling


# ----------------------------------------------------------------------------- profiler

@pytest.mark.parametrize("name", ["self_device_time_total", "self_cuda_time_total", "device_time_total"])
def test_device_time_reads_every_torch_spelling(name):
    """torch >= 2.4 says device_time, older versions cuda_time: both must be read."""
    evt = SimpleNamespace(**{name: 1234.0})
    assert PF._device_us(evt) == 1234.0
    assert PF._device_us(SimpleNamespace(self_cpu_time_total=5.0)) == 0.0


SOFTMAX = "softmax & elementwise"


@pytest.mark.parametrize("name, cat", [
    ("aten::bmm", "matmul"), ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "matmul"),
    ("nvjet_tst_128x256_64x4", "matmul"),
    ("flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", "fused attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "fused attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "fused attention"),
    ("fmha_cutlassF_bf16_aligned", "fused attention"),
    ("Memcpy DtoD (Device -> Device)", "memory"), ("aten::_to_copy", "memory"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>", "memory"),
    ("void at::native::vectorized_elementwise_kernel<4, exp_kernel_cuda>", SOFTMAX),
    ("void at::native::reduce_kernel<512, 1, ReduceOp<float, MaxOps<float>>>", SOFTMAX),
    ("aten::_softmax", SOFTMAX), ("aten::exp_", SOFTMAX), ("aten::sub", SOFTMAX), ("aten::transpose", "other")])
def test_category(name, cat):
    assert PF.category(name) == cat


@pytest.fixture(scope="module")
def cpu_profiles():
    # N = 256, d = 32: the fused kernel is ~94% of the fused run's self time; at N = 64, d = 16 it was ~70%, and
    # on a loaded CPU a small op (an empty or a copy) now and then came first
    q, k, v = lk.bench.attention_inputs(1, 2, 256, 32, dtype=torch.float32)
    out = {}
    with torch.no_grad():
        for backend in ("reference", "sdpa_flash"):
            out[backend] = PF.profile_fn(lambda: lk.attention.attention(q, k, v, backend=backend, nan_policy="ignore"),
                                         reps=3, warmup=1, device="cpu", label="attn")
    return out


def test_kernel_table_on_cpu(cpu_profiles):
    ref = PF.kernel_table(cpu_profiles["reference"], top=None)
    fused = PF.kernel_table(cpu_profiles["sdpa_flash"], top=None)
    assert list(ref.columns) == ["name", "category", "calls", "self_ms", "share"]
    assert ref.attrs["source"] == "cpu" and ref.attrs["total_ms"] > 0
    assert ref["share"].sum() == pytest.approx(1.0)
    assert ref["self_ms"].is_monotonic_decreasing
    assert "attn" not in set(ref["name"]), "the record_function label is a wrapper, not an operator"
    # counts are per profiled call: the reference does two matmuls per call
    assert ref.loc[ref["name"] == "aten::bmm", "calls"].sum() == pytest.approx(2.0)
    assert ref.attrs["launches"] > fused.attrs["launches"], "materialized attention runs more operators"
    assert fused.iloc[0]["category"] == "fused attention"
    assert len(PF.kernel_table(cpu_profiles["reference"], top=3)) == 3


def test_sort_key_works_with_table(cpu_profiles):
    prof = cpu_profiles["reference"]
    key = PF.sort_key(prof)
    assert key == "self_cpu_time_total"
    assert "aten::bmm" in prof.key_averages().table(sort_by=key, row_limit=20)


def test_profile_fn_rejects_zero_reps():
    with pytest.raises(ValueError, match="reps"):
        PF.profile_fn(lambda: None, reps=0, device="cpu")


def test_export_trace_and_counts(cpu_profiles, tmp_path):
    path = PF.export_trace(cpu_profiles["reference"], tmp_path / "sub" / "trace.json")
    assert path.exists()
    json.loads(path.read_text())  # valid JSON for Perfetto / chrome://tracing
    counts = PF.trace_counts(path).set_index("category")["events"]
    assert counts["cpu_op"] > 0


def test_export_trace_beside_the_notebook_returns_an_absolute_path(tmp_path, monkeypatch):
    """A notebook writes traces/ relative to its own folder (the kernel's working directory) and prints
    the absolute path the call returns."""
    monkeypatch.chdir(tmp_path)
    a = torch.ones(8, 8)
    prof = PF.profile_fn(lambda: a @ a, reps=1, warmup=0, device="cpu")  # a trace can be saved once per profile
    path = PF.export_trace(prof, "traces/trace_reference.json")
    assert path.is_absolute() and path == (tmp_path / "traces" / "trace_reference.json").resolve()
    assert path.exists() and path.relative_to(Path.cwd()) == Path("traces/trace_reference.json")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_memory_snapshot_explains_on_cpu(tmp_path):
    with pytest.raises(RuntimeError, match="GPU"):
        PF.memory_snapshot(lambda: None, tmp_path / "s.pickle")


def test_snapshot_allocations_on_a_synthetic_snapshot(tmp_path):
    frames_user = [{"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "softmax"},
                   {"filename": "/home/me/lab.py", "line": 42, "name": "attend"}]
    trace = [dict(action="alloc", size=64 * 2**20, frames=frames_user),
             dict(action="free_completed", size=64 * 2**20, frames=frames_user),
             dict(action="alloc", size=64 * 2**20, frames=frames_user),
             dict(action="alloc", size=2**20, frames=[{"filename": "??", "line": 0, "name": "?"}])]
    snap = {"segments": [], "device_traces": [trace]}
    df = PF.snapshot_allocations(snap)
    assert df.iloc[0].to_dict() == {"size_mib": 64.0, "frame": "lab.py:42 attend", "count": 2}
    assert df.iloc[1]["frame"] == "(no Python frame)"
    path = tmp_path / "snap.pickle"
    path.write_bytes(__import__("pickle").dumps(snap))
    assert PF.snapshot_allocations(path, top=1).shape[0] == 1


# ----------------------------------------------------------------------------- GPU only

@pytest.mark.gpu
def test_kernel_table_counts_cuda_kernels(cuda_device):
    a = torch.randn(1024, 1024, device=cuda_device, dtype=torch.bfloat16)
    prof = PF.profile_fn(lambda: (a @ a).relu_(), reps=4, device=cuda_device)
    table = PF.kernel_table(prof, top=None)
    assert table.attrs["source"] == "device"
    assert "matmul" in set(table["category"]), table
    assert table.attrs["launches"] == pytest.approx(2, abs=1), "one GEMM and one elementwise kernel per call"
    assert PF.sort_key(prof) in ("self_device_time_total", "self_cuda_time_total")


@pytest.mark.gpu
def test_memory_snapshot_on_gpu(cuda_device, tmp_path):
    keep = []
    path = PF.memory_snapshot(lambda: keep.append(torch.empty(32 * 2**20, dtype=torch.uint8, device=cuda_device)),
                              tmp_path / "snap.pickle")
    top = PF.snapshot_allocations(path, top=3)
    assert top.iloc[0]["size_mib"] >= 32
    assert "test_profiling.py" in top.iloc[0]["frame"]
