"""GPT-2 models for the course: sizes, attention implementations, and their speed and memory.

- :func:`build_model`: GPT-2 of several sizes (``SIZES``), random init with any number of
  learned positions, or pretrained weights when they are already in the local Hugging Face
  cache (never downloads; their table has 1024 positions).
- :func:`set_attention`: switch a model between ``"eager"``, ``"sdpa"``, ``"labkit"`` and
  ``"labkit:<backend>"`` in place; the weights are the same tensors whatever runs attention.
  "labkit" is :func:`lk.hf_attention.attention_forward <labkit.models.hf_attention.attention_forward>`.
- :func:`enable_checkpointing`, :func:`forward_logits`: training and comparison helpers.
- :func:`training_throughput`, :func:`training_throughput_table`, :func:`inference_latency`:
  measurements (CUDA events after warm-up, peak memory after resetting the counter).

Transformers is imported inside functions, so ``import labkit`` stays fast.

Used in: 02_gpt2_integration, 03_long_sequence_training, 04_performance_analysis.
"""
from __future__ import annotations

import torch

from labkit.engine import attention as attn
from labkit.models import hf_attention
from labkit.core.env import default_device
from labkit.models.hf_attention import ATTN_NAME, DEFAULT_BACKEND
from labkit.core.measure import allocated_bytes, free_memory, is_oom, peak_memory, time_fn

SIZES = {  # n_layer, n_embd, n_head (head dim 64 except tiny), vocab, positions
    # tiny: bytes as tokens; a wider init so a random model does not just echo its input
    # through the tied embeddings (greedy decoding then shows varied tokens)
    "tiny": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=512, initializer_range=0.2),
    "small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024),
    "medium": dict(n_layer=24, n_embd=1024, n_head=16, vocab_size=50257, n_positions=1024),
    "large": dict(n_layer=36, n_embd=1280, n_head=20, vocab_size=50257, n_positions=1024),
    "xl": dict(n_layer=48, n_embd=1600, n_head=25, vocab_size=50257, n_positions=1024),
}
HUB_IDS = {"small": "openai-community/gpt2", "medium": "openai-community/gpt2-medium",
           "large": "openai-community/gpt2-large", "xl": "openai-community/gpt2-xl"}


def parse_implementation(implementation: str) -> tuple[str, str | None]:
    """'labkit:fa4' -> ('labkit', 'fa4'); 'sdpa' -> ('sdpa', None)."""
    name, _, backend = implementation.partition(":")
    if name != ATTN_NAME and backend:
        raise ValueError(f"only '{ATTN_NAME}:<backend>' takes a backend, got {implementation!r}.")
    if backend and backend not in attn.BACKENDS + ("auto",):
        raise ValueError(f"unknown labkit backend {backend!r}; choose one of {', '.join(attn.BACKENDS)}, auto.")
    if name not in ("eager", "sdpa", ATTN_NAME):
        raise ValueError(f"unknown attention implementation {implementation!r}; use 'eager', 'sdpa', "
                         f"'{ATTN_NAME}' or '{ATTN_NAME}:<backend>' (backends: {', '.join(attn.BACKENDS)}).")
    return name, backend or None


def set_attention(model, implementation: str) -> None:
    """Switch ``model``'s attention in place; the weights stay the same tensors.

    Args:
        implementation: "eager", "sdpa", "labkit" (backend ``DEFAULT_BACKEND``) or
            "labkit:<backend>" with a name from ``lk.attention.BACKENDS`` or "auto".
    """
    name, backend = parse_implementation(implementation)
    if name != ATTN_NAME and getattr(model.config, "labkit_rope_base", None) is not None:
        raise ValueError(f"this model uses RoPE (lk.rope.use_rope), which only the '{ATTN_NAME}' implementation "
                         f"applies; choose '{ATTN_NAME}' or '{ATTN_NAME}:<backend>', not {implementation!r}.")
    hf_attention.ensure_registered()
    if name == ATTN_NAME:
        model.config.labkit_backend = backend
    model.set_attn_implementation(name)


# ----------------------------------------------------------------------------- models

def gpt2_config(size: str = "tiny", *, dropout: float = 0.0, **overrides):
    """A fresh ``GPT2Config`` for ``size`` (see ``SIZES``); dropout 0 unless given."""
    from transformers import GPT2Config

    if size not in SIZES:
        raise ValueError(f"unknown GPT-2 size {size!r}; choose one of {', '.join(SIZES)}.")
    fields = {**SIZES[size], "attn_pdrop": dropout, "resid_pdrop": dropout, "embd_pdrop": dropout, **overrides}
    if fields["vocab_size"] <= 50256:  # keep the special tokens inside a small vocabulary
        fields.setdefault("bos_token_id", fields["vocab_size"] - 1)
        fields.setdefault("eos_token_id", fields["vocab_size"] - 1)
    return GPT2Config(**fields)


def build_model(size: str = "tiny", *, attn_implementation: str = "sdpa", pretrained: bool = False,
                device="cpu", seed: int = 0, dropout: float = 0.0, **overrides):
    """GPT2LMHeadModel of ``size``, in eval mode, with ``attn_implementation`` set.

    Random init (seeded) unless ``pretrained``: then the weights come from the local Hugging Face
    cache only (``local_files_only``, so HF_HUB_OFFLINE or not, nothing is downloaded); if they are
    not there a notice is printed and the model is randomly initialized.
    ``overrides`` go to the config of a random-init model (e.g. ``n_positions=65536``: a table
    of that many learned positions); pretrained weights take none.

    Raises:
        ValueError: ``pretrained`` with overrides, e.g. more positions than the checkpoint's 1024
            (random init needs no extension: build it for N tokens).
    """
    if pretrained and overrides:
        raise ValueError(f"pretrained GPT-2 comes with its own config (1024 learned positions); overrides "
                         f"{sorted(overrides)} apply to random init only (pretrained=False).")
    model = _load_pretrained(size, dropout) if pretrained else None
    if model is None:
        torch.manual_seed(seed)
        with torch.device(device):  # initialize where it will run (fast on a GPU)
            from transformers import GPT2LMHeadModel

            model = GPT2LMHeadModel(gpt2_config(size, dropout=dropout, **overrides))
    model = model.to(device).eval()
    model.loss_type = "ForCausalLM"  # GPT-2 configs name none; say it instead of a warning per model
    set_attention(model, attn_implementation)
    return model


def _load_pretrained(size: str, dropout: float):
    """Pretrained GPT-2 from the local cache, or None with a notice."""
    from transformers import GPT2LMHeadModel

    if size not in HUB_IDS:
        print(f"[labkit.models.gpt2] no pretrained weights exist for size {size!r}; using random init.")
        return None
    for repo in (HUB_IDS[size], HUB_IDS[size].split("/")[1]):
        try:
            return GPT2LMHeadModel.from_pretrained(repo, local_files_only=True, attn_pdrop=dropout,
                                                   resid_pdrop=dropout, embd_pdrop=dropout)
        except (OSError, ValueError):
            continue
    print(f"[labkit.models.gpt2] {HUB_IDS[size]} is not in the local Hugging Face cache; using random init "
          f"(nothing is downloaded). To use the real weights, run once with network access: "
          f"hf download {HUB_IDS[size]}")
    return None


def enable_checkpointing(model) -> None:
    """Activation checkpointing (recompute each block in the backward), version-robust."""
    fn = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    fn()


def forward_logits(model, input_ids: torch.Tensor, implementation: str | None = None, *,
                   autocast_dtype: torch.dtype | None = None, **kwargs) -> torch.Tensor:
    """fp32 logits [B, N, V] of one no-grad forward, under autocast when a dtype is given."""
    if implementation is not None:
        set_attention(model, implementation)
    device = input_ids.device.type
    with torch.no_grad(), torch.autocast(device, dtype=autocast_dtype or torch.float32,
                                         enabled=autocast_dtype is not None):
        return model(input_ids=input_ids, use_cache=False, **kwargs).logits.float()


# ----------------------------------------------------------------------------- measurements

def _default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _status(err: BaseException) -> str:
    if isinstance(err, (attn.AttentionInputError, ImportError)):
        return f"unsupported: {str(err).splitlines()[0][:160]}"
    return "oom" if is_oom(err) else f"error: {type(err).__name__}: {str(err).splitlines()[0][:160]}"


def _measure(step, device: torch.device, target_ms: float, before: float) -> tuple[float, float]:
    """(median ms, peak GiB) of ``step()`` after two warm-up calls; the peak counts what was
    allocated since ``before`` (bytes, taken before the model was built), NaN on a CPU."""
    for _ in range(2):  # warm-up: kernels chosen and compiled, optimizer state allocated
        step()
    held = allocated_bytes(device) - before
    extra = peak_memory(step, device=device)  # resets the peak counter first
    timing = time_fn(step, device=device, warmup=0, target_ms=target_ms)
    return timing.median_ms, (held + extra) / 2**30


def training_throughput(implementation: str, seq_len: int, tokens_per_step: int = 16384, *,
                        size: str = "small", device=None, dtype: torch.dtype | None = None,
                        target_ms: float = 1000.0, checkpointing: bool = False, seed: int = 0) -> dict:
    """One GPT-2 training step's speed and memory: random init, AdamW (fused on CUDA), autocast
    to ``dtype`` (bf16 on CUDA, none on CPU), batch = tokens_per_step // seq_len.

    Returns:
        dict with implementation, N, batch, tokens, status ("ok", "oom", "unsupported: ...",
        "error: ..."), step_ms, tokens_per_s, peak_gib (model, optimizer state and the step's peak,
        not what the process held before; NaN on CPU), device, dtype.
    """
    device = torch.device(device or default_device())
    dtype = dtype or _default_dtype(device)
    batch = max(1, tokens_per_step // seq_len)
    row = dict(implementation=implementation, size=size, N=seq_len, batch=batch, tokens=batch * seq_len,
               checkpointing=checkpointing, device=device.type, dtype=str(dtype).replace("torch.", ""))
    before = allocated_bytes(device)  # what the process holds already is not this step's
    try:
        ms, gib = _measure(_train_step(implementation, size, seq_len, batch, device, dtype, checkpointing, seed),
                           device, target_ms, before)
        row.update(status="ok", step_ms=ms, tokens_per_s=batch * seq_len / (ms / 1e3), peak_gib=gib)
    except (RuntimeError, MemoryError, ValueError, ImportError, NotImplementedError) as err:
        row.update(status=_status(err), step_ms=float("nan"), tokens_per_s=float("nan"), peak_gib=float("nan"))
    if device.type == "cuda":  # gc.collect costs ~0.5 s with transformers loaded: only where memory is scarce
        free_memory()
    return row


def _train_step(implementation, size, seq_len, batch, device, dtype, checkpointing, seed):
    """A closure running one optimizer step on random tokens (model and optimizer inside)."""
    model = build_model(size, attn_implementation=implementation, device=device, seed=seed,
                        n_positions=max(seq_len, SIZES[size]["n_positions"])).train()
    model.config.use_cache = False
    if checkpointing:
        enable_checkpointing(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen).to(device)

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def training_throughput_table(implementations=("eager", "sdpa", "labkit:sdpa_cudnn", "labkit:fa4"),
                              seq_lens=(1024, 2048, 4096, 8192), tokens_per_step: int = 16384,
                              **kwargs):
    """:func:`training_throughput` for every (N, implementation): a DataFrame with, per N,
    ``vs_eager`` (tokens/s ratio), ``mem_vs_eager`` (peak ratio) and ``vs_sdpa``."""
    import pandas as pd

    df = pd.DataFrame([training_throughput(impl, n, tokens_per_step, **kwargs)
                       for n in seq_lens for impl in implementations])

    def ratio(ref: str, col: str):
        base = df[df.implementation == ref].set_index("N")[col]
        return df[col] / df.N.map(base) if len(base) else float("nan")

    return df.assign(vs_eager=ratio("eager", "tokens_per_s"), mem_vs_eager=ratio("eager", "peak_gib"),
                     vs_sdpa=ratio("sdpa", "tokens_per_s"))


def inference_latency(model, implementation: str, seq_len: int, batch: int = 1, *,
                      dtype: torch.dtype | None = None, target_ms: float = 200.0) -> dict:
    """Forward (no grad, no cache) latency and peak memory of ``model`` with ``implementation``.

    Returns:
        dict with implementation, N, batch, status, ms, tokens_per_s, peak_gib (the model's weights and
        the forward's peak, not other tensors the process holds; NaN on CPU).
    """
    device = next(model.parameters()).device
    dtype = dtype or _default_dtype(device)
    row = dict(implementation=implementation, N=seq_len, batch=batch, dtype=str(dtype).replace("torch.", ""))
    try:
        set_attention(model, implementation)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), device=device)

        def forward():
            with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                return model(input_ids=ids, use_cache=False).logits

        weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        ms, gib = _measure(forward, device, target_ms, allocated_bytes(device) - weights)
        row.update(status="ok", ms=ms, tokens_per_s=batch * seq_len / (ms / 1e3), peak_gib=gib)
    except (RuntimeError, MemoryError, ValueError, ImportError) as err:
        row.update(status=_status(err), ms=float("nan"), tokens_per_s=float("nan"), peak_gib=float("nan"))
    if device.type == "cuda":
        free_memory()
    return row


__all__ = ["ATTN_NAME", "DEFAULT_BACKEND", "HUB_IDS", "SIZES", "build_model", "enable_checkpointing",
           "forward_logits", "gpt2_config", "inference_latency", "set_attention", "training_throughput",
           "training_throughput_table"]
