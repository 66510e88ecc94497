"""Tests for labkit.longctx: data, the passkey task, checkpointing, chunked cross-entropy, RoPE,
the memory model and its measurements (GPU tests compare it with measured peaks)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from labkit import gpt2, longctx
from labkit.perfmodel import MemoryCoefficients, ModelShape, training_memory

SMALL = ModelShape.gpt2("small")


def tiny(attn="sdpa", **overrides):
    """A 2-layer byte-level GPT-2 in training mode (random init, no dropout)."""
    return gpt2.build_model("tiny", attn_implementation=attn, **overrides).train()


# ----------------------------------------------------------------------------- corpus

@pytest.fixture
def text_root(tmp_path):
    for i in range(30):
        (tmp_path / f"mod{i:02d}.py").write_bytes(f"# file {i}\n".encode() * (50 + i))
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_bytes(b"x" * 10_000)  # excluded folder
    return tmp_path


def test_corpus_split_by_file_is_deterministic(text_root):
    a = longctx.stdlib_corpus(root=text_root, min_file_bytes=100, val_every=3)
    b = longctx.stdlib_corpus(root=text_root, min_file_bytes=100, val_every=3)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.train.dtype == torch.uint8 and a.files == 30
    docs = lambda t: set(bytes(t.tolist()).split(bytes([longctx.DOC_SEPARATOR])))  # noqa: E731
    assert not docs(a.train) & docs(a.val), "a document is in both train and val"
    assert len(docs(a.train)) + len(docs(a.val)) == 30 and b"x" * 100 not in bytes(a.train.tolist())


def test_corpus_respects_max_bytes_and_errors(text_root, tmp_path_factory):
    small = longctx.stdlib_corpus(root=text_root, min_file_bytes=100, val_every=3, max_bytes=2000)
    assert small.files < 30
    with pytest.raises(FileNotFoundError, match="min_file_bytes"):
        longctx.stdlib_corpus(root=tmp_path_factory.mktemp("empty"))


def test_stdlib_corpus_is_real_python():
    corpus = longctx.stdlib_corpus(max_bytes=2**20)
    assert corpus.files >= 10 and corpus.val.numel() > 10_000
    assert b"def " in bytes(corpus.train[:200_000].tolist())


def test_windows():
    data = torch.arange(100, dtype=torch.uint8)
    w = longctx.random_windows(data, 4, 10, generator=torch.Generator().manual_seed(0))
    assert w.shape == (4, 10) and w.dtype == torch.int64
    assert torch.equal(w[:, 1:] - w[:, :-1], torch.ones(4, 9, dtype=torch.int64))  # contiguous slices
    e = longctx.eval_windows(data, 10, 5)
    assert torch.equal(e, longctx.eval_windows(data, 10, 5)) and e[0, 0] == 0
    with pytest.raises(ValueError, match="longer than seq_len"):
        longctx.random_windows(data, 1, 100)


# ----------------------------------------------------------------------------- passkey task

@pytest.mark.parametrize("repeats", [1, 4])
def test_passkey_key_is_far_from_the_question(repeats):
    n, d, k = 40, 20, 5
    ids, answer = longctx.passkey_batch(256, n, min_distance=d, n_keys=k, repeats=repeats, vocab=30,
                                        generator=torch.Generator().manual_seed(0))
    assert ids.shape == (256, n) and answer.shape == (256,)
    assert (ids[:, -1] == k).all() and ((ids[:, :-1] > k) | (ids[:, :-1] == answer[:, None])).all()
    is_key = ids < k
    assert torch.equal(is_key.sum(1), torch.full((256,), repeats))
    last_key = n - 1 - torch.where(is_key, torch.arange(n), -1).amax(1)  # distance of the nearest key
    assert last_key.min() == d, "keys must be >= min_distance back, and the bound should be reached"
    assert len(set(answer.tolist())) == k and ids.max() < 30


def test_passkey_errors():
    with pytest.raises(ValueError, match="min_distance"):
        longctx.passkey_batch(2, 10, min_distance=8, repeats=3)
    with pytest.raises(ValueError, match="vocab"):
        longctx.passkey_batch(2, 10, min_distance=3, n_keys=8, vocab=9)


# ----------------------------------------------------------------------------- checkpointing

def _mlp_stack(wrap: bool) -> torch.nn.Sequential:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)) for _ in range(3)]
    return torch.nn.Sequential(*[longctx.Checkpointed(b) if wrap else b for b in blocks])


def test_checkpointed_same_gradients_fewer_saved_bytes(randn):
    x = randn(8, 16, seed=1).requires_grad_()
    grads, saved = [], []
    for wrap in (False, True):
        model = _mlp_stack(wrap)
        saved.append(longctx.saved_tensor_bytes(lambda: model(x).square().sum().backward(),
                                                exclude=model.parameters()))
        grads.append([p.grad for p in model.parameters()] + [x.grad.clone()])
        x.grad = None
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # recomputation gives the same numbers
    assert saved[1] < saved[0] / 2


def test_checkpointed_is_plain_in_eval_and_no_grad(randn):
    model = _mlp_stack(True).eval()
    x = randn(4, 16, seed=2)
    torch.testing.assert_close(model(x), _mlp_stack(False)(x))


def test_hf_checkpointing_is_non_reentrant_and_keeps_layer_inputs_only():
    # (same gradients with and without: tests/test_gpt2.py)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    saved = []
    for ckpt in (False, True):
        model = tiny(n_positions=64)
        if ckpt:
            gpt2.enable_checkpointing(model)
            assert model.transformer._gradient_checkpointing_func.keywords == {"use_reentrant": False}
        saved.append(longctx.saved_tensor_bytes(lambda: longctx.lm_loss(model, ids), exclude=model.parameters()))
    assert saved[1] < saved[0] * 0.7


# ----------------------------------------------------------------------------- chunked cross-entropy

class MaxNumel(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


@pytest.mark.parametrize("chunk", [1, 7, 37, 1000])
def test_chunked_ce_matches_full_fp64(randn, chunk):
    h = randn(2, 37, 16, seed=0, dtype=torch.float64).requires_grad_()
    w = randn(50, 16, seed=1, dtype=torch.float64).requires_grad_()
    t = torch.randint(0, 50, (2, 37), generator=torch.Generator().manual_seed(0))
    t[0, :5] = -100
    loss = longctx.chunked_cross_entropy(h, w, t, chunk_size=chunk)
    ref = F.cross_entropy((h @ w.T).reshape(-1, 50), t.reshape(-1))
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)  # same sum, float64: round-off only
    for a, b in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(ref, (h, w))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_chunked_ce_gradcheck(randn):
    h = randn(11, 6, seed=3, dtype=torch.float64).requires_grad_()
    w = randn(9, 6, seed=4, dtype=torch.float64).requires_grad_()
    t = torch.randint(0, 9, (11,), generator=torch.Generator().manual_seed(1))
    assert torch.autograd.gradcheck(lambda h, w: longctx.chunked_cross_entropy(h, w, t, chunk_size=4), (h, w))


def test_chunked_ce_never_holds_full_logits(randn):
    n, v, c = 256, 300, 32
    h, w = randn(n, 8, seed=0).requires_grad_(), randn(v, 8, seed=1).requires_grad_()
    t = torch.randint(0, v, (n,))
    with MaxNumel() as mode:
        longctx.chunked_cross_entropy(h, w, t, chunk_size=c).backward()
    assert mode.max_numel <= c * v, f"a tensor of {mode.max_numel} elements > one chunk of logits ({c * v})"


def test_chunked_ce_under_autocast_matches_lm_head_path():
    # Under bf16 autocast both compute bf16 logits and an fp32 softmax: the losses agree to fp32
    # round-off of the same bf16 numbers; the gradients go through bf16 matmuls in both.
    gen = torch.Generator().manual_seed(0)
    h, w = torch.randn(64, 32, generator=gen).requires_grad_(), torch.randn(100, 32, generator=gen).requires_grad_()
    t = torch.randint(0, 100, (64,), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = longctx.chunked_cross_entropy(h, w, t, chunk_size=16)
        ref = F.cross_entropy((h @ w.T).float(), t)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-5)
    for a, b in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(ref, (h, w))):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)  # bf16 matmul outputs, 8-bit mantissa


def test_chunked_ce_errors(randn):
    with pytest.raises(ValueError, match="shapes"):
        longctx.chunked_cross_entropy(randn(4, 8, seed=0), randn(10, 7, seed=1), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        longctx.chunked_cross_entropy(randn(4, 8, seed=0), randn(10, 8, seed=1), torch.zeros(4, dtype=torch.long),
                                      chunk_size=0)


def test_lm_loss_chunked_equals_full_on_gpt2():
    model = tiny(n_positions=64)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    full = longctx.lm_loss(model, ids)
    g_full = torch.autograd.grad(full, list(model.parameters()))
    chunked = longctx.lm_loss(model, ids, chunk_size=10)
    g_chunked = torch.autograd.grad(chunked, list(model.parameters()))
    torch.testing.assert_close(chunked, full, rtol=1e-6, atol=1e-6)
    for a, b in zip(g_chunked, g_full):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_loss_by_position_averages_to_the_model_loss():
    model = tiny(n_positions=64).eval()
    ids = torch.randint(0, 256, (6, 40), generator=torch.Generator().manual_seed(0))
    per_pos = longctx.loss_by_position(model, ids, batch_size=4)
    assert per_pos.shape == (39,)
    with torch.no_grad():
        torch.testing.assert_close(per_pos.mean(), longctx.lm_loss(model, ids), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- RoPE

def test_rope_rotates_pairs_like_complex_numbers(randn):
    b, h, n, d = 2, 3, 17, 8
    x = randn(b, h, n, d, seed=0, dtype=torch.float64)
    cos, sin = longctx.rope_cache(n, d, base=100.0, dtype=torch.float64)
    out = longctx.apply_rope(x, cos, sin)
    # independent formulation: channel pair (i, i + d/2) is the complex number x_i + j x_{i+d/2}
    theta = 100.0 ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * torch.polar(torch.ones(n, d // 2, dtype=torch.float64),
                                                                        torch.arange(n)[:, None] * theta)
    torch.testing.assert_close(out, torch.cat([z.real, z.imag], -1), rtol=0, atol=1e-12)
    torch.testing.assert_close(out[..., 0, :], x[..., 0, :])  # position 0: no rotation
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))  # a rotation keeps norms


def test_rope_scores_depend_only_on_relative_position(randn):
    d, n = 16, 64
    q, k = randn(d, seed=1, dtype=torch.float64), randn(d, seed=2, dtype=torch.float64)
    cos, sin = longctx.rope_cache(n, d, dtype=torch.float64)
    qr = longctx.apply_rope(q.expand(n, d), cos, sin)  # the same vector at every position
    kr = longctx.apply_rope(k.expand(n, d), cos, sin)
    s = qr @ kr.T  # s[m, n] = <R_m q, R_n k>
    for offset in (0, 3, 20):
        diag = torch.diagonal(s, offset=-offset)
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), rtol=0, atol=1e-10)


def test_rope_offset_dtype_and_errors(randn):
    cos, sin = longctx.rope_cache(20, 8)
    cos5, sin5 = longctx.rope_cache(15, 8, offset=5)
    torch.testing.assert_close(cos5, cos[5:]) and torch.testing.assert_close(sin5, sin[5:])
    x = randn(1, 2, 20, 8, seed=0, dtype=torch.bfloat16)
    assert longctx.apply_rope(x, cos, sin).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="even"):
        longctx.rope_cache(4, 7)
    with pytest.raises(ValueError, match="rope_cache"):
        longctx.apply_rope(x, cos[:10], sin[:10])


# ----------------------------------------------------------------------------- memory model

def _act(n, **kw):
    out = longctx.memory_model(SMALL, batch=1, seq_len=n, **kw)
    return sum(out[k] for k in longctx.ACTIVATION_KEYS)


def test_memory_model_structure():
    coef = MemoryCoefficients()
    L, h, H, V = SMALL.n_layer, SMALL.n_embd, SMALL.n_head, SMALL.vocab
    n = 8192
    eager = longctx.memory_model(SMALL, batch=2, seq_len=n, attention="standard")
    assert eager["attention"] == L * 2 * H * n * n * coef.scores  # the N^2 term, every layer
    assert eager["activations"] == L * 2 * n * h * coef.hidden
    assert eager["logits"] == 2 * n * V * coef.logits
    flash = longctx.memory_model(SMALL, batch=2, seq_len=n)
    assert flash["attention"] == L * 2 * n * H * coef.lse  # FlashAttention keeps only the LSE
    ckpt = longctx.memory_model(SMALL, batch=2, seq_len=n, checkpointing=True)
    assert ckpt["activations"] == L * 2 * n * h * coef.checkpoint + 2 * n * h * coef.hidden  # inputs + one layer
    chunked = longctx.memory_model(SMALL, batch=2, seq_len=n, chunked_loss=True, chunk_size=1024)
    assert chunked["logits"] == 12 * 1024 * V + 4 * 2 * n  # two chunks' buffers overlap (see below)
    for out in (eager, flash, ckpt, chunked):
        assert out["total"] == pytest.approx(sum(v for k, v in out.items() if k != "total"))
    assert flash == training_memory(SMALL, batch=2, seq_len=n)


def test_memory_model_scaling_in_n():
    ratio = lambda **kw: _act(16384, **kw) / _act(8192, **kw)  # noqa: E731
    assert 3.5 < ratio(attention="standard") < 4.0  # dominated by the N^2 scores
    assert ratio() == pytest.approx(2.0)  # linear without the scores
    # chunked loss: logits stop growing with N, the rest stays linear
    assert _act(65536, checkpointing=True, chunked_loss=True) < _act(65536, checkpointing=True) / 3
    with pytest.raises(ValueError, match="chunk_size"):
        longctx.memory_model(SMALL, batch=1, seq_len=8, chunked_loss=True, chunk_size=0)


@pytest.mark.parametrize("attention, ckpt, n, measured_gib", [
    ("eager", False, 8192, 69.1), ("sdpa", False, 32768, 45.3), ("sdpa", True, 65536, 41.4)])
def test_memory_model_matches_h100_anchors(attention, ckpt, n, measured_gib):
    # Peaks measured for HF GPT-2 small (bf16 autocast, fused AdamW, batch 1) on an H100 (ANCHORS.md).
    total = longctx.memory_model(SMALL, batch=1, seq_len=n, attention=attention, checkpointing=ckpt)["total"]
    assert total / 2**30 == pytest.approx(measured_gib, rel=0.1)


def _chunked(n, batch=1, chunk=4096):
    return longctx.memory_model(SMALL, batch=batch, seq_len=n, checkpointing=True, chunked_loss=True,
                                chunk_size=chunk)


def test_memory_model_chunked_loss_term():
    coef, L, h, V = MemoryCoefficients(), SMALL.n_layer, SMALL.n_embd, SMALL.vocab
    # one chunk (B*(N-1) = 2047 rows): fp32 logits + logsumexp's fp32 temporary, 8 bytes per entry
    assert _chunked(2048)["logits"] == 8 * 2047 * V + 4 * 2048
    # several chunks: the next chunk's bf16 logits + fp32 softmax while the previous chunk's fp32
    # softmax + bf16 gradient are still bound: 12 bytes per entry of ONE chunk, whatever N
    # (without checkpointing the peak stays in the loss at every N)
    for n in (16384, 65536, 262144):
        no_ckpt = longctx.memory_model(SMALL, batch=1, seq_len=n, chunked_loss=True, chunk_size=4096)
        assert no_ckpt["logits"] == 12 * 4096 * V + 4 * n  # only the per-token LSE grows with N
    assert _chunked(16384)["logits"] == 12 * 4096 * V + 4 * 16384
    assert _chunked(8192)["logits"] == 6 * (4096 + 4095) * V + 4 * 8192  # second chunk one row short
    # chunks run over the flattened B*(N-1) positions: max(8*c1, 6*(c1 + c2)) * V
    assert _chunked(2048, batch=2)["logits"] == 8 * 4094 * V + 4 * 4096               # 4094 rows: one chunk
    assert _chunked(2048, batch=3)["logits"] == 6 * (4096 + 2045) * V + 4 * 3 * 2048  # 6141 rows: two
    # what is alive with it: only lm_head's gradient and bf16 copy, the layer inputs, ln_f's tensors
    n, loss = 16384, _chunked(16384)
    assert loss["grads"] == coef.grad * V * h and loss["casts"] == coef.cast * V * h
    assert loss["activations"] == L * n * h * coef.checkpoint + 12 * n * h and loss["attention"] == 0
    assert loss["total"] == pytest.approx(sum(v for k, v in loss.items() if k != "total"))


def test_memory_model_chunked_peak_moves_to_the_layers_backward():
    # long N: the checkpointed backward of a layer outweighs the loss, whose buffers are freed by then
    for n in (65536, 262144):
        base = training_memory(SMALL, batch=1, seq_len=n, checkpointing=True)
        out = _chunked(n)
        assert out["logits"] == 0 and out["activations"] == base["activations"]
        assert out["total"] == pytest.approx(base["total"] - base["logits"])
    # the prediction is the larger of the two peaks, so it never decreases with N
    totals = [_chunked(2**k)["total"] for k in range(11, 19)]
    assert totals == sorted(totals)
    # without checkpointing every layer's activations are alive during the loss: the loss peak wins
    assert longctx.memory_model(SMALL, batch=1, seq_len=65536, chunked_loss=True)["logits"] > 0


@pytest.mark.parametrize("n, measured_gib", [(2048, 2.57), (8192, 4.40), (16384, 4.82), (32768, 5.93),
                                             (131072, 18.87), (262144, 36.13)])
def test_memory_model_chunked_matches_h200_peaks(n, measured_gib):
    # flash+ckpt+chunked peaks measured by longest_sequence (GPT-2 small, bf16, AdamW, batch 1) on an H200.
    assert _chunked(n)["total"] / 2**30 == pytest.approx(measured_gib, rel=0.15)


def test_model_shape_from_config():
    assert longctx.model_shape(gpt2.gpt2_config("small")) == SMALL


# ----------------------------------------------------------------------------- measuring saved activations

def test_saved_tensor_bytes_counts_storages_once(randn):
    lin = torch.nn.Linear(32, 16)
    x = randn(10, 32, seed=0).requires_grad_()
    assert longctx.saved_tensor_bytes(lambda: lin(x), exclude=lin.parameters()) == x.numel() * 4
    assert longctx.saved_tensor_bytes(lambda: lin(x)) == (x.numel() + lin.weight.numel()) * 4
    assert longctx.saved_tensor_bytes(lambda: x[:, :16] * x[:, 16:]) == x.numel() * 4  # two views, one storage
    with torch.no_grad():
        assert longctx.saved_tensor_bytes(lambda: lin(x)) == 0  # no graph, nothing saved


@pytest.mark.parametrize("n", [64, 128])
def test_eager_saves_the_score_matrix(n):
    # fp32 eager attention keeps its softmax output, 4 bytes per score element and layer; SDPA does not.
    ids = torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(0))
    saved = {}
    for attn in ("eager", "sdpa"):
        model = tiny(attn, n_positions=n)
        saved[attn] = longctx.saved_tensor_bytes(lambda: longctx.lm_loss(model, ids), exclude=model.parameters())
    c = model.config
    scores = c.n_layer * 2 * c.n_head * n * n
    assert (saved["eager"] - saved["sdpa"]) / scores == pytest.approx(4.0, rel=0.1)


# ----------------------------------------------------------------------------- longest sequence

def test_longest_sequence_on_cpu_runs_each_config():
    df = longctx.longest_sequence(["eager", "flash+ckpt+chunked"], size="tiny", start=32, max_len=64,
                                  device="cpu", dtype=torch.float32, chunk_size=16, progress=False)
    assert list(df["config"]) == ["eager", "eager", "flash+ckpt+chunked", "flash+ckpt+chunked"]
    assert list(df["N"]) == [32, 64, 32, 64] and (df["status"] == "ok").all()
    assert (df["tokens_per_s"] > 0).all() and df["peak_gib"].isna().all() and (df["predicted_gib"] > 0).all()
    with pytest.raises(ValueError, match="configs"):
        longctx.longest_sequence(["fast"], size="tiny")


# ----------------------------------------------------------------------------- GPU: predicted vs measured peaks

@pytest.mark.gpu
@pytest.mark.parametrize("config, n", [("eager", 4096), ("flash", 16384), ("flash+ckpt", 32768),
                                       ("flash+ckpt+chunked", 32768)])
def test_memory_model_matches_measured_peak(config, n):
    df = longctx.longest_sequence([config], size="small", start=n, max_len=n, progress=False)
    row = df.iloc[0]
    assert row.status == "ok", row.status
    assert row.peak_gib == pytest.approx(row.predicted_gib, rel=0.15), df.to_string()


@pytest.mark.gpu
def test_chunked_loss_lowers_the_peak():
    df = longctx.longest_sequence(["flash+ckpt", "flash+ckpt+chunked"], size="small", start=16384,
                                  max_len=16384, progress=False)
    peak = df.set_index("config")["peak_gib"]
    assert peak["flash+ckpt+chunked"] < 0.6 * peak["flash+ckpt"], df.to_string()


@pytest.mark.gpu
def test_gpt2_small_trains_32k_with_flash_and_checkpointing():
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    if total < 70:
        pytest.skip(f"the 32K claim is for an 80 GB GPU; this one has {total:.0f} GiB")
    df = longctx.longest_sequence(["flash+ckpt"], size="small", start=32768, max_len=32768, progress=False)
    assert df.iloc[0].status == "ok" and math.isfinite(df.iloc[0].step_ms), df.to_string()
