"""labkit.long.ctx: the configurations, a training step with each, labkit vs sdpa in one run, the
longest-sequence search and what stops it, the command line; GPU tests for the real sizes."""
from __future__ import annotations

import math

import pytest
import torch

from labkit.models import gpt2, rope
from labkit.long import ctx as longctx, memory as longmem

CPU = dict(size="tiny", device="cpu", dtype=torch.float32, chunk_size=32)


def test_configs_map_to_the_memory_model():
    for name, cfg in longctx.CONFIGS.items():
        kwargs = cfg.memory_kwargs()
        assert kwargs["attention"] == ("standard" if name == "eager" else "flash")
        longmem.memory_model(longmem.model_shape(gpt2.gpt2_config("small")), batch=1, seq_len=4096,
                             **kwargs)  # every configuration is one the model covers
    assert all(cfg.attention == "labkit" for name, cfg in longctx.CONFIGS.items() if name != "eager")


@pytest.mark.parametrize("name", list(longctx.CONFIGS))
def test_every_configuration_trains(name):
    step, model = longctx.train_step(longctx.CONFIGS[name], "tiny", 96, device="cpu", dtype=torch.float32,
                                     chunk_size=32)
    losses = [step() for _ in range(3)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert step(40) > 0  # a prefix (the search's warm-up)
    assert isinstance(model.transformer.wpe, rope.NoPositions) == longctx.CONFIGS[name].rope


def test_levers_do_not_change_the_first_loss():
    """Same weights, same tokens: every lever computes the same function (fp32 round-off apart)."""
    first = {name: longctx.train_step(cfg, "tiny", 96, device="cpu", dtype=torch.float32, chunk_size=32)[0]()
             for name, cfg in longctx.CONFIGS.items() if not cfg.rope}
    for name, loss in first.items():
        assert loss == pytest.approx(first["eager"], rel=1e-5), name


def test_compare_attention_same_loss_and_a_ratio():
    df = longctx.compare_attention([64, 128], rounds=2, **CPU)
    assert list(df.implementation) == ["sdpa", "labkit"] * 2 and (df.tokens_per_s > 0).all()
    for _, g in df.groupby("N"):
        assert g.loss.iloc[0] == pytest.approx(g.loss.iloc[1], rel=1e-5)  # same weights, same tokens
        assert g.vs_sdpa.iloc[0] == 1.0 and g.vs_sdpa.iloc[1] == g.tokens_per_s.iloc[1] / g.tokens_per_s.iloc[0]
    assert df.backend.iloc[1].startswith("labkit:") and df.peak_gib.isna().all()


def test_compare_attention_reads_oom_and_skips_longer_n(monkeypatch):
    real = longctx.train_step

    def small_gpu(cfg, size, n, **kw):
        if n > 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 786.00 MiB.")
        return real(cfg, size, n, **kw)

    monkeypatch.setattr(longctx, "train_step", small_gpu)
    df = longctx.compare_attention([64, 128, 256], rounds=1, **CPU)
    assert list(df.status) == ["ok"] * 2 + ["oom"] * 2 + ["skipped"] * 2
    assert (df.tokens_per_s[:2] > 0).all() and df.tokens_per_s[2:].isna().all() and df.vs_sdpa[2:].isna().all()


def test_longest_sequence_stops_at_max_len_and_reports_it():
    df = longctx.longest_sequence(["eager", "rope+ckpt+chunked+mlp+offload"], start=32, max_len=64, progress=False,
                                  **CPU)
    assert list(df.N) == [32, 64, 128] * 2 and list(df.status) == ["ok", "ok", "skipped"] * 2
    assert list(df.stopped_by) == ["", "", "max_len"] * 2
    assert df.attention.iloc[3].startswith("labkit:")  # auto, resolved once to a named backend
    ok = df[df.status == "ok"]
    assert (ok.tokens_per_s > 0).all() and ok.peak_gib.isna().all() and (ok.predicted_gib > 0).all()
    assert (df[df.config != "eager"].host_gib > 0).all()
    assert list(longctx.summary(df).longest_N) == [64, 64]


def test_longest_sequence_stops_before_a_step_over_the_time_limit():
    df = longctx.longest_sequence(["flash+ckpt+chunked"], start=32, max_len=10**6, max_step_s=1e-6, progress=False,
                                  **CPU)
    assert list(df.status) == ["ok"] and df.stopped_by.iloc[-1] == "time"  # measured over the limit


def test_time_prediction_uses_the_growth_of_the_last_two_steps():
    rows = [dict(N=1000, step_s=1.0), dict(N=2000, step_s=2.0)]  # linear so far
    assert longctx._stop_before(rows, 4000, None, 4.5) == ""
    assert longctx._stop_before(rows[:1], 2000, None, 3.0) == "time"  # one step: assume N^2
    quadratic = [dict(N=1000, step_s=1.0), dict(N=2000, step_s=4.0)]
    assert longctx._stop_before(quadratic, 4000, None, 15.0) == "time"
    assert longctx._stop_before(quadratic, 4000, 3000, 100.0) == "max_len"


def test_longest_sequence_errors():
    with pytest.raises(ValueError, match="configs"):
        longctx.longest_sequence(["fast"], size="tiny", max_len=64)
    with pytest.raises(ValueError, match="max_len"):
        longctx.longest_sequence(["flash"], size="tiny", device="cpu")


def test_command_line_writes_csv(tmp_path, capsys):  # also as python -m labkit longctx
    assert longctx.main(["search", "--configs", "flash+ckpt+chunked", "--start", "32", "--max-len", "32", "--size",
                         "tiny", "--chunk-size", "16", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "stopped_by" in out and (tmp_path / "search.csv").exists()
    from labkit.__main__ import main as python_m_labkit

    assert python_m_labkit(["longctx", "compare", "--seq-lens", "32", "--rounds", "1", "--size", "tiny", "--out",
                            str(tmp_path)]) == 0, "python -m labkit longctx compare ..."
    assert "vs_sdpa" in capsys.readouterr().out and (tmp_path / "compare.csv").exists()



@pytest.mark.parametrize("argv, rule", [
    (["search", "--attention", "sdpa", "--max-len", "64"], "RoPE (a rope+ configuration) runs in labkit's attention"),
    (["search", "--configs", "flash,rope+ckpt+chunked+mlp+offload", "--attention", "eager", "--max-len", "64"], "RoPE"),
    (["compare", "--config", "rope+ckpt+chunked+mlp+offload", "--implementations", "labkit,sdpa"], "RoPE"),
    (["search", "--start", "4096", "--max-len", "2048"], "argument --max-len: must be at least --start (4096)"),
    (["compare", "--seq-lens", "0"], "argument --seq-lens: expected comma-separated integers >= 2"),
    (["search", "--configs", "flash,fast", "--max-len", "64"], "unknown config(s) ['fast']"),
])
def test_command_line_refuses_bad_input_before_any_work(argv, rule, tmp_path, capsys):
    """A RoPE model under sdpa or eager would train with no positions at all (only labkit's attention
    rotates q and k): refused up front, like every other bad option (argparse's line, exit status 2)."""
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as info:
        longctx.main([*argv, "--size", "tiny", "--out", str(out)])
    assert info.value.code == 2 and rule in capsys.readouterr().err.strip().splitlines()[-1]
    assert not out.exists()


def test_command_line_search_on_a_cpu_needs_max_len(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(longctx, "default_device", lambda: torch.device("cpu"))
    with pytest.raises(SystemExit) as info:
        longctx.main(["search", "--start", "32", "--size", "tiny", "--out", str(tmp_path)])
    assert info.value.code == 2
    assert "argument --max-len: must be at least --start (32), and a CPU needs one; got None, e.g. 64" in (
        capsys.readouterr().err)

# ----------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("config, n", [("flash+ckpt+chunked", 32768), ("flash+ckpt+chunked+mlp+offload", 65536),
                                       ("rope+ckpt+chunked+mlp+offload", 131072)])
def test_memory_model_matches_measured_peak(config, n):
    df = longctx.longest_sequence([config], start=n, max_len=n, progress=False)
    row = df.iloc[0]
    assert row.status == "ok", row.status
    assert row.peak_gib == pytest.approx(row.predicted_gib, rel=0.15), df.to_string()


@pytest.mark.gpu
def test_measured_peak_does_not_count_what_the_process_already_holds():
    def peak():
        return longctx.longest_sequence(["flash+ckpt+chunked"], start=16384, max_len=16384, progress=False).iloc[0].peak_gib

    alone = peak()
    ballast = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")  # e.g. an earlier notebook cell's tensors
    with_ballast = peak()
    del ballast
    assert with_ballast == pytest.approx(alone, abs=0.05), (alone, with_ballast)


@pytest.mark.gpu
def test_labkit_attention_trains_as_fast_as_sdpa_with_the_same_loss():
    df = longctx.compare_attention([32768], rounds=3)
    sdpa, labkit = df.iloc[0], df.iloc[1]
    assert labkit.loss == pytest.approx(sdpa.loss, rel=1e-2), df.to_string()  # bf16 kernels, same weights
    assert labkit.vs_sdpa >= 0.95, df.to_string()  # the goal with FlashAttention-4 is >= 1.10 (issue 12)


@pytest.mark.gpu
def test_gpt2_small_trains_a_quarter_million_tokens_in_one_sequence():
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    if total < 70:
        pytest.skip(f"the claim is for an 80 GB GPU; this one has {total:.0f} GiB")
    df = longctx.longest_sequence(["rope+ckpt+chunked+mlp+offload"], start=262144, max_len=262144, progress=False)
    assert df.iloc[0].status == "ok" and df.iloc[0].peak_gib < 40, df.to_string()
