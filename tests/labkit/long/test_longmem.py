"""labkit.long.memory: the memory model's structure, each lever's term, and its agreement with what
autograd saves on a CPU (exact byte counts) and with peaks measured on an H100 (within 15%)."""
from __future__ import annotations

import pytest
import torch

from labkit.models import gpt2, rope
from labkit.long import levers, memory as longmem
from labkit.perf.memory import MemoryCoefficients, ModelShape, training_memory

SMALL = ModelShape.gpt2("small")
COEF, LEVER = MemoryCoefficients(), longmem.LeverCoefficients()
GIB = 2**30


def model(n, **levers_on):
    return longmem.memory_model(SMALL, batch=1, seq_len=n, checkpointing=True, chunked_loss=True, **levers_on)


def _act(n, **kw):
    out = longmem.memory_model(SMALL, batch=1, seq_len=n, **kw)
    return sum(out[k] for k in ("activations", "attention", "logits"))


# ----------------------------------------------------------------------------- structure

def test_memory_model_without_chunked_loss_is_training_memory():
    L, h, H, V, n = SMALL.n_layer, SMALL.n_embd, SMALL.n_head, SMALL.vocab, 8192
    eager = longmem.memory_model(SMALL, batch=2, seq_len=n, attention="standard")
    assert eager["attention"] == L * 2 * H * n * n * COEF.scores  # the N^2 term, every layer
    assert eager["activations"] == L * 2 * n * h * COEF.hidden and eager["logits"] == 2 * n * V * COEF.logits
    flash = longmem.memory_model(SMALL, batch=2, seq_len=n)
    assert flash["attention"] == L * 2 * n * H * COEF.lse  # FlashAttention keeps only the LSE
    ckpt = longmem.memory_model(SMALL, batch=2, seq_len=n, checkpointing=True)
    assert ckpt["activations"] == L * 2 * n * h * COEF.checkpoint + 2 * n * h * COEF.hidden  # inputs + one layer
    for out in (eager, flash, ckpt):
        assert out["total"] == pytest.approx(sum(v for k, v in out.items() if k not in ("total", "host")))
    assert {k: v for k, v in flash.items() if k != "host"} == training_memory(SMALL, batch=2, seq_len=n)


def test_memory_model_scaling_in_n():
    ratio = lambda **kw: _act(16384, **kw) / _act(8192, **kw)  # noqa: E731
    assert 3.5 < ratio(attention="standard") < 4.0  # dominated by the N^2 scores
    assert ratio() == pytest.approx(2.0)  # linear without the scores
    assert _act(65536, checkpointing=True, chunked_loss=True) < _act(65536, checkpointing=True) / 3
    totals = [model(2**k)["total"] for k in range(11, 21)]  # the largest of three peaks: never falls with N
    assert totals == sorted(totals)


def test_memory_model_errors():
    with pytest.raises(ValueError, match="chunk_size"):
        longmem.memory_model(SMALL, batch=1, seq_len=8, chunked_loss=True, chunk_size=0)
    for lever in ("offload", "chunked_mlp", "rope"):
        with pytest.raises(ValueError, match="checkpointing=True and chunked_loss=True"):
            longmem.memory_model(SMALL, batch=1, seq_len=8, chunked_loss=True, **{lever: True})


# ----------------------------------------------------------------------------- the chunked loss's phases

def test_loss_phase_chunk_buffers():
    V = SMALL.vocab
    # one chunk (t = 2048 rows): fp32 logits + logsumexp's fp32 temporary, 8 bytes per entry
    assert model(2048, chunk_size=4096)["logits"] == 8 * 2048 * V + 4 * 2048
    # several chunks: the next chunk's bf16 logits + fp32 softmax while the previous one's fp32 softmax
    # + bf16 gradient are bound: 12 bytes per entry of ONE chunk, whatever N (here the loss is the peak)
    assert model(8192, chunk_size=4096)["logits"] == 12 * 4096 * V + 4 * 8192
    assert model(6000, chunk_size=4096)["logits"] == 6 * (4096 + 1904) * V + 4 * 6000  # second chunk short
    two = longmem.memory_model(SMALL, batch=3, seq_len=2048, checkpointing=True, chunked_loss=True)
    assert two["logits"] == 6 * (4096 + 2048) * V + 4 * 3 * 2048  # rows run over the flattened B*N


def test_loss_phase_holds_only_lm_heads_gradient_and_the_inputs():
    L, h, V, n = SMALL.n_layer, SMALL.n_embd, SMALL.vocab, 8192
    loss = model(n)
    assert loss["grads"] == COEF.grad * V * h and loss["casts"] == COEF.cast * V * h and loss["attention"] == 0
    assert loss["activations"] == L * n * h * COEF.checkpoint + LEVER.loss_residual * n * h
    # without checkpointing every layer's activations (and eager's scores) are alive during the loss
    eager = longmem.memory_model(SMALL, batch=1, seq_len=n, attention="standard", chunked_loss=True)
    assert eager["attention"] == training_memory(SMALL, batch=1, seq_len=n, attention="standard")["attention"]


def test_long_n_peaks_in_the_layers_backward():
    L, h, n = SMALL.n_layer, SMALL.n_embd, 262144
    out, base = model(n), training_memory(SMALL, batch=1, seq_len=n, checkpointing=True)
    assert out["logits"] == 0 and out["grads"] == base["grads"]
    assert out["activations"] == L * n * h * COEF.checkpoint + LEVER.layer * n * h


# ----------------------------------------------------------------------------- levers

def test_chunked_mlp_term():
    h, n = SMALL.n_embd, 262144
    saved = model(n)["total"] - model(n, chunked_mlp=True)["total"]
    assert saved == (LEVER.layer - LEVER.layer_chunked_mlp) * n * h


def test_offload_moves_the_inputs_to_host():
    L, h, n = SMALL.n_layer, SMALL.n_embd, 262144
    kept, moved = model(n, chunked_mlp=True), model(n, chunked_mlp=True, offload=True)
    assert moved["host"] == (L * COEF.checkpoint + 4) * n * h and kept["host"] == 0
    # on the GPU: the L inputs go, the one being recomputed comes back
    assert kept["total"] - moved["total"] == (L - 1) * COEF.checkpoint * n * h


def test_rope_drops_the_position_table():
    h, n, d = SMALL.n_embd, 1 << 20, SMALL.n_embd // SMALL.n_head
    learned, rotary = model(n, chunked_mlp=True, offload=True), model(n, chunked_mlp=True, offload=True, rope=True)
    assert learned["weights"] - rotary["weights"] == COEF.weight * n * h
    assert learned["optimizer"] - rotary["optimizer"] == COEF.optimizer * n * h
    assert rotary["attention"] - learned["attention"] == 4 * d * n + LEVER.rope * n * h
    assert rotary["total"] < learned["total"] - 10 * GIB  # the table and its state: ~13 GiB at 1M positions


def test_one_million_tokens_fit_an_80_gb_gpu_only_with_the_levers():
    n = 1 << 20
    assert model(n)["total"] > 80e9  # checkpointing and the chunked loss alone
    best = model(n, chunked_mlp=True, offload=True, rope=True)
    assert best["total"] < 40 * GIB and best["host"] < 64 * GIB


# ----------------------------------------------------------------------------- against measurements

@pytest.mark.parametrize("config, n, measured_gib", [
    # Peaks measured phase by phase on an H100 80GB (torch 2.11, transformers 5.17; GPT-2 small, bf16
    # autocast, fused AdamW, batch 1, attention "labkit" = auto): build/calib in the course's history.
    ("flash+ckpt+chunked", 16384, 4.78), ("flash+ckpt+chunked", 65536, 10.24),
    ("flash+ckpt+chunked", 131072, 18.87), ("flash+ckpt+chunked+mlp", 65536, 7.18),
    ("flash+ckpt+chunked+mlp", 131072, 10.36), ("flash+ckpt+chunked+mlp+offload", 65536, 4.93),
    ("flash+ckpt+chunked+mlp+offload", 131072, 6.24), ("rope+ckpt+chunked+mlp+offload", 65536, 4.38),
    ("rope+ckpt+chunked+mlp+offload", 131072, 5.15),
    # longest_sequence on the same H100 (one step per N): the search up to where time stopped it, then 1M
    ("flash+ckpt+chunked+mlp+offload", 524288, 19.36), ("rope+ckpt+chunked+mlp+offload", 262144, 8.39),
    ("rope+ckpt+chunked+mlp+offload", 524288, 14.86), ("rope+ckpt+chunked+mlp+offload", 1048576, 27.83)])
def test_memory_model_matches_h100_peaks(config, n, measured_gib):
    from labkit.long.ctx import CONFIGS

    predicted = longmem.memory_model(SMALL, batch=1, seq_len=n, **CONFIGS[config].memory_kwargs())["total"]
    assert predicted / GIB == pytest.approx(measured_gib, rel=0.15)


@pytest.mark.parametrize("attention, ckpt, n, measured_gib", [
    ("eager", False, 8192, 69.1), ("sdpa", False, 32768, 45.3), ("sdpa", True, 65536, 41.4)])
def test_memory_model_matches_h100_anchors_without_chunked_loss(attention, ckpt, n, measured_gib):
    total = longmem.memory_model(SMALL, batch=1, seq_len=n, attention=attention, checkpointing=ckpt)["total"]
    assert total / GIB == pytest.approx(measured_gib, rel=0.1)


def tiny(n, **overrides):
    """Fused attention (saves q, k, v, o and the LSE; the math backend would save the N x N scores)."""
    return gpt2.build_model("tiny", attn_implementation="labkit:sdpa_flash", n_positions=n, **overrides).train()


def test_checkpointed_step_saves_the_inputs_the_model_counts():
    """CPU, fp32: with checkpointing and the chunked loss autograd keeps the L block inputs and the
    residual the loss needs (fp32, 4 bytes each per hidden unit) and per-token scalars only."""
    b, n = 2, 128
    m = tiny(n)
    gpt2.enable_checkpointing(m)
    ids = torch.randint(0, 256, (b, n), generator=torch.Generator().manual_seed(0))
    saved = longmem.saved_tensor_bytes(lambda: levers.lm_loss(m, ids, chunk_size=32), exclude=m.parameters())
    c, t = m.config, b * n
    inputs = (c.n_layer + 1) * t * c.n_embd * 4
    scalars = (8 + 8 + 4) * t + 8 * n  # ids, targets (int64), log-sum-exp (fp32); position ids [1, N]
    assert saved == inputs + scalars


def test_offload_moves_what_the_model_says():
    b, n = 2, 128
    m = tiny(n)
    gpt2.enable_checkpointing(m)
    levers.chunk_mlp(m, 32)
    ids = torch.randint(0, 256, (b, n), generator=torch.Generator().manual_seed(0))
    hooks = levers.OffloadSaved(keep=m.parameters(), min_bytes=16 * b * n)  # per-token scalars stay
    with hooks:
        levers.lm_loss(m, ids, chunk_size=32)
    shape = longmem.model_shape(m.config)
    host = longmem.memory_model(shape, batch=b, seq_len=n, checkpointing=True, chunked_loss=True, chunked_mlp=True,
                                offload=True)["host"]
    assert hooks.host_bytes == host


def _saved(chunk: bool, n: int, layers: int) -> int:
    """Bytes a GPT-2-small-wide model saves in a forward under bf16 autocast (CPU). A vocabulary of 256 (the ids
    drawn): the LM head's logits, the same for every layer count, cancel anyway and cost most of the time."""
    m = gpt2.build_model("tiny", attn_implementation="labkit:sdpa_flash", n_layer=layers, n_embd=768, n_head=12,
                         n_positions=n, vocab_size=256).train()
    if chunk:
        levers.chunk_mlp(m, n // 4)
    ids = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(0))

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(input_ids=ids, use_cache=False).logits.sum()

    return longmem.saved_tensor_bytes(forward, exclude=m.parameters())


def test_chunked_mlp_removes_the_mlps_saved_activations():
    """Per layer, bf16 autocast: x (fp32, 4), ln_1 out (2), qkv (6), o (2), residual (fp32, 4),
    ln_2 out (2) and five [N, 4h] bf16 tensors of the MLP and GPT-2's tanh GELU (40): 60 bytes per
    hidden unit and token; chunked, ln_2 and the MLP keep only the residual they share: 18.
    (What one more layer and 64 more tokens add: the bf16 weight copies, saved once, cancel.)"""
    def per_layer_and_token(chunk: bool) -> float:
        extra = [_saved(chunk, 128, layers) - _saved(chunk, 64, layers) for layers in (1, 2)]
        return (extra[1] - extra[0]) / (64 * 768)

    full, chunked = per_layer_and_token(False), per_layer_and_token(True)
    assert full == pytest.approx(60.0, abs=0.1) and chunked == pytest.approx(18.0, abs=0.1)
    assert LEVER.layer - LEVER.layer_chunked_mlp >= full - chunked  # the peak drops at least by what is saved


def test_rope_saves_the_rotation_table_once():
    n = 256
    saved = {}
    for use in (False, True):
        m = tiny(n)
        if use:
            rope.use_rope(m)
        ids = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(0))
        saved[use] = longmem.saved_tensor_bytes(lambda: m(input_ids=ids, use_cache=False).logits.sum(),
                                                exclude=m.parameters())
    head_dim = m.config.n_embd // m.config.n_head
    # + the complex64 table [N, D/2] shared by every layer; - the position ids the table lookup saved
    assert saved[True] - saved[False] == 4 * head_dim * n - 8 * n


def test_model_shape_from_config():
    assert longmem.model_shape(gpt2.gpt2_config("small")) == SMALL


# ----------------------------------------------------------------------------- peak_live_bytes
def test_peak_live_bytes_counts_what_is_alive_at_once():
    x = torch.ones(1000)  # existed before: not counted

    def two_at_once():
        a = x * 2          # 4000 bytes
        b = a + 1          # 4000 more, a still alive
        del a
        c = b * 3          # a freed: b and c, the peak stays 8000
        return c

    assert longmem.peak_live_bytes(two_at_once) == 8000
    assert longmem.peak_live_bytes(lambda: x.add_(1)) == 0  # in place on an existing tensor
    assert longmem.peak_live_bytes(lambda: (x * 2).view(10, 100).t()) == 4000  # views share one storage


def test_peak_live_bytes_sees_the_backward_of_one_checkpoint_around_every_chunk():
    from torch.utils.checkpoint import checkpoint

    h = torch.randn(512, 8, requires_grad=True)
    w = torch.randn(300, 8, requires_grad=True)
    chunk = 32 * 300 * 4  # one chunk of fp32 logits

    def loss(hc):
        return (hc @ w.T).logsumexp(-1).sum()

    def per_chunk():
        sum(checkpoint(loss, hc, use_reentrant=False) for hc in h.split(32)).backward()

    def whole_loop():
        checkpoint(lambda x: sum(loss(hc) for hc in x.split(32)), h, use_reentrant=False).backward()

    assert longmem.peak_live_bytes(per_chunk) < 6 * chunk < 16 * chunk <= longmem.peak_live_bytes(whole_loop)


def test_saved_tensor_bytes_leaves_no_graph_alive():
    """A node that saves its output (exp) must not keep it, and its graph, alive after the measurement."""
    import gc
    import weakref

    x = torch.randn(1000, requires_grad=True)
    outputs = []

    def forward():
        y = x.exp()
        outputs.append(weakref.ref(y))
        return y.sum()

    assert longmem.saved_tensor_bytes(forward) == 1000 * 4
    gc.collect()
    assert outputs[0]() is None, "the measured forward's output is still alive: its graph leaked"
    assert longmem.saved_tensor_bytes(lambda: x.exp().sum().backward()) == 1000 * 4 and x.grad is not None
