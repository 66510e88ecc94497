"""Long-sequence training of GPT-2 with the levers combined: how fast, and how long N can get.

- :class:`LongConfig` and :data:`CONFIGS`: named combinations of attention implementation,
  checkpointing, chunked loss, chunked MLP, offloaded checkpoints and RoPE.
- :func:`train_step`: one AdamW step of GPT-2 on one long random sequence, with a configuration.
- :func:`compare_attention`: tokens/s of labkit's attention against transformers' ``sdpa`` in
  the same run (same model, steps taking turns), the loss of each, and the ratio.
- :func:`longest_sequence`: N doubles until memory or a step-time limit stops it (both are
  reported), with the measured peak beside ``lk.longmem.memory_model``'s prediction.
- :func:`main`: the two as a command line (CSV files and a short printout).

Used in: 03_long_sequence_training.
"""
from __future__ import annotations

import argparse
import contextlib
import math
from dataclasses import asdict, dataclass, replace
from typing import Callable, Iterable

import pandas as pd
import torch

from labkit.engine import attention as attn
from labkit.core import cliargs as ca
from labkit.models import gpt2, rope
from labkit.long import levers, memory as longmem
from labkit.core.env import default_device
from labkit.long.summary import _stop_before, summary  # noqa: F401 - lk.longctx.summary
from labkit.core.measure import allocated_bytes, call_ms, free_memory, is_oom, peak_memory


@dataclass(frozen=True)
class LongConfig:
    """One way to train a long sequence: an attention implementation and the levers it uses."""

    attention: str = "labkit"    # attn_implementation: "eager", "sdpa", "labkit" (auto) or "labkit:<backend>"
    checkpointing: bool = False  # recompute each block in the backward
    chunked_loss: bool = False   # ln_f, lm_head and the loss chunk by chunk (lk.levers.lm_loss)
    chunked_mlp: bool = False    # each block's MLP in 16 checkpointed chunks of positions
    offload: bool = False        # checkpointed inputs wait in pinned host memory
    rope: bool = False           # rotary positions instead of the learned table (lk.rope)

    def memory_kwargs(self) -> dict:
        """The keyword arguments of ``lk.longmem.memory_model`` for this configuration."""
        fields = asdict(self)
        fields["attention"] = "standard" if self.attention == "eager" else "flash"
        return fields


_ALL = LongConfig(checkpointing=True, chunked_loss=True, chunked_mlp=True, offload=True)
CONFIGS = {
    "eager": LongConfig("eager"),
    "flash": LongConfig(),
    "flash+ckpt": LongConfig(checkpointing=True),
    "flash+ckpt+chunked": LongConfig(checkpointing=True, chunked_loss=True),
    "flash+ckpt+chunked+mlp": replace(_ALL, offload=False),
    "flash+ckpt+chunked+mlp+offload": _ALL,
    "rope+ckpt+chunked+mlp+offload": replace(_ALL, rope=True),
}
MLP_CHUNKS = 16  # chunked_mlp: positions per chunk = ceil(N / MLP_CHUNKS)


def train_step(config: LongConfig, size: str, n: int, *, device=None, dtype: torch.dtype = torch.bfloat16,
               chunk_size: int = 4096, seed: int = 0) -> tuple[Callable[[int | None], float], torch.nn.Module]:
    """GPT-2 ``size`` (random init) set up for ``config``, and a closure running one training step.

    ``step(length=None)`` runs autocast (``dtype``; fp32 = none) forward, backward and an AdamW
    step (fused on CUDA) on the first ``length`` (default ``n``) of ``n`` random tokens
    (batch 1) and returns the loss. The learned position table has ``n`` rows (none with RoPE).
    """
    device = torch.device(device or default_device())
    positions = {} if config.rope else {"n_positions": max(n, gpt2.SIZES[size]["n_positions"])}
    model = gpt2.build_model(size, attn_implementation=config.attention, device=device, seed=seed, **positions)
    model.train().config.use_cache = False
    if config.rope:
        rope.use_rope(model)
    if config.checkpointing:
        gpt2.enable_checkpointing(model)
    if config.chunked_mlp:
        levers.chunk_mlp(model, -(-n // MLP_CHUNKS))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed)).to(device)
    params = list(model.parameters())

    def step(length: int | None = None) -> float:
        offload = levers.OffloadSaved(keep=params) if config.offload else contextlib.nullcontext()
        with offload, torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = levers.lm_loss(model, ids[:, :length], chunk_size=chunk_size if config.chunked_loss else None)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step, model


def _initial_loss(model, n: int, seed: int, chunk_size: int | None, dtype: torch.dtype) -> float:
    """No-grad loss of ``model`` on the same tokens ``train_step`` uses."""
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed)).to(device)
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        return levers.lm_loss(model, ids, chunk_size=chunk_size).item()


def compare_attention(seq_lens: Iterable[int] = (32768, 65536, 131072), *,
                      implementations: Iterable[str] = ("sdpa", "labkit"), config: str = "flash+ckpt+chunked",
                      size: str = "small", rounds: int = 5, device=None, dtype: torch.dtype = torch.bfloat16,
                      chunk_size: int = 4096, seed: int = 0) -> pd.DataFrame:
    """Training tokens/s of each attention implementation on one long sequence, in the same run.

    Per N one model of ``config`` (batch 1) serves every implementation (switched with
    ``lk.gpt2.set_attention``): the loss of each on the initial weights, a warm-up step each,
    then ``rounds`` timed steps each, taking turns (the order rotates every round) so clock
    drift favours none; the first timed step of each also gives its peak memory.

    An N that runs out of memory gives rows with status "oom" (NaN numbers); the longer N after it are
    not tried ("skipped").

    Returns:
        DataFrame: N, implementation, status ("ok", "oom", "skipped"), backend (for "labkit": "labkit:<what
        auto chose>"), loss, step_ms (median), tokens_per_s, peak_gib (NaN on CPU), vs_sdpa (tokens/s over
        sdpa's at that N), device.
    """
    device, impls, rows = torch.device(device or default_device()), list(implementations), []
    cfg, shape = CONFIGS[config], longmem.model_shape(gpt2.gpt2_config(size))
    status = "ok"
    for n in seq_lens:
        if status == "ok":
            try:
                rows += _compare_at(n, cfg, shape, impls, size, rounds, device, dtype, chunk_size, seed)
                continue
            except (RuntimeError, MemoryError) as err:
                if not is_oom(err):
                    raise
                status = "oom"
            free_memory()  # the failed step's tensors went with the exception
        rows += [dict(N=n, implementation=impl, status=status, backend=impl, loss=math.nan, step_ms=math.nan,
                      tokens_per_s=math.nan, peak_gib=math.nan, device=device.type) for impl in impls]
        status = "skipped"
    df = pd.DataFrame(rows)
    sdpa = df[df.implementation == "sdpa"].set_index("N")["tokens_per_s"]
    return df.assign(vs_sdpa=df.tokens_per_s / df.N.map(sdpa) if len(sdpa) else math.nan)


def _compare_at(n, cfg, shape, impls, size, rounds, device, dtype, chunk_size, seed) -> list[dict]:
    """:func:`compare_attention`'s rows at one N (one per implementation)."""
    rows: list[dict] = []
    before = allocated_bytes(device)  # what the process holds already is not this model's
    try:
        step, model = train_step(cfg, size, n, device=device, dtype=dtype, chunk_size=chunk_size, seed=seed)
        losses = {}
        for impl in impls:  # every loss on the same initial weights
            gpt2.set_attention(model, impl)
            losses[impl] = _initial_loss(model, n, seed, chunk_size if cfg.chunked_loss else None, dtype)
        for impl in impls:
            gpt2.set_attention(model, impl)
            step()  # warm-up: kernels chosen (auto tunes here), AdamW state allocated
        times, peaks = {impl: [] for impl in impls}, {}
        for r in range(rounds):
            for impl in impls[r % len(impls):] + impls[:r % len(impls)]:
                gpt2.set_attention(model, impl)
                if impl in peaks:
                    times[impl].append(call_ms(step, device=device))
                else:
                    timed = peak_memory(lambda: times[impl].append(call_ms(step, device=device)), device=device)
                    peaks[impl] = allocated_bytes(device) - before + timed
        for impl in impls:
            ms = sorted(times[impl])[len(times[impl]) // 2]
            rows.append(dict(N=n, implementation=impl, status="ok", backend=_named(impl, shape, n, device, dtype),
                             loss=losses[impl], step_ms=ms, tokens_per_s=n / (ms / 1e3), peak_gib=peaks[impl] / 2**30,
                             device=device.type))
    finally:
        step = model = None  # noqa: F841 - free the model and its optimizer, also after an error
        free_memory()
    return rows


def longest_sequence(configs: Iterable[str] = tuple(CONFIGS), *, size: str = "small", start: int = 2048,
                     max_len: int | None = None, max_step_s: float = 150.0, attention: str | None = None,
                     device=None, dtype: torch.dtype = torch.bfloat16, chunk_size: int = 4096,
                     progress: bool = True) -> pd.DataFrame:
    """The longest single sequence one GPT-2 training step fits, per configuration, and what stopped it.

    For each configuration in :data:`CONFIGS`, N doubles from ``start``; each N builds GPT-2
    ``size`` (random init, a position table of N rows unless RoPE), runs a warm-up step on the
    first 2048 tokens (kernels chosen, AdamW state allocated) and one measured step on all N
    (autocast to ``dtype``, AdamW). The search stops at the first out-of-memory error
    (``stopped_by="memory"``), after a step slower than ``max_step_s`` or before one predicted
    to be (from the growth of the last two steps: ``"time"``), past ``max_len`` (``"max_len"``),
    or at another error (``"error"``). ``attention`` replaces the configurations'
    implementation (e.g. "labkit:fa4"), except eager's. Memory is freed between rows.

    Returns:
        DataFrame: config, N, status ("ok", "oom", "skipped" or "error: ..."), step_s, tokens_per_s,
        peak_gib (measured, NaN on CPU), predicted_gib and host_gib (``lk.longmem.memory_model``),
        loss, stopped_by (in each configuration's last row), device.
    """
    from tqdm.auto import tqdm

    device = torch.device(device or default_device())
    unknown = set(configs) - set(CONFIGS)
    if unknown or start < 2 or (max_len is not None and max_len < start):
        raise ValueError(f"configs must come from {list(CONFIGS)} (unknown: {sorted(unknown)}) "
                         f"and 2 <= start <= max_len; got start={start}, max_len={max_len}.")
    if max_len is None and device.type != "cuda":
        raise ValueError("on a CPU give max_len: running out of host memory would stall the machine.")
    shape = longmem.model_shape(gpt2.gpt2_config(size))
    rows, bar = [], tqdm(desc="longest sequence", disable=not progress)
    for name in configs:
        cfg = CONFIGS[name]
        if cfg.attention != "eager":
            cfg = replace(cfg, attention=_named(attention or cfg.attention, shape, min(start, 32768), device, dtype))
        done: list[dict] = []
        n = start
        while True:
            predicted = longmem.memory_model(shape, batch=1, seq_len=n, chunk_size=chunk_size, **cfg.memory_kwargs())
            row = dict(config=name, attention=cfg.attention, N=n, status="ok", step_s=math.nan, tokens_per_s=math.nan, peak_gib=math.nan,
                       predicted_gib=predicted["total"] / 2**30, host_gib=predicted["host"] / 2**30,
                       loss=math.nan, stopped_by="", device=device.type)
            stop = _stop_before(done, n, max_len, max_step_s)
            if stop:
                row.update(status="skipped", stopped_by=stop)
            else:
                stop = _measure_row(row, cfg, size, n, device, dtype, chunk_size, max_step_s)
                done.append(row)
            rows.append(row)
            bar.update(1)
            if stop:
                break
            n *= 2
    bar.close()
    return pd.DataFrame(rows)


def _named(impl: str, shape, n: int, device: torch.device, dtype: torch.dtype) -> str:
    """"labkit" (auto) as the backend auto picks for a causal sequence of ``n`` tokens, e.g.
    "labkit:fa4"; other names as they are. Tuned once here, not at every N inside a timed step."""
    if impl != gpt2.ATTN_NAME:
        return impl
    head_dim = shape.n_embd // shape.n_head
    probe = torch.randn(1, shape.n_head, n, head_dim, device=device,
                        dtype=dtype if device.type == "cuda" else None).requires_grad_()
    with torch.enable_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        return f"{impl}:{attn.auto_choice(probe, probe, probe, causal=True)}"


def _measure_row(row: dict, cfg: LongConfig, size: str, n: int, device: torch.device, dtype: torch.dtype,
                 chunk_size: int, max_step_s: float) -> str:
    """Fill ``row`` with one measured step at N; returns why the search stops here ("" to go on)."""
    losses: list[float] = []
    before = allocated_bytes(device)  # what the process holds already (earlier cells' tensors) is not this step's
    try:
        step, model = train_step(cfg, size, n, device=device, dtype=dtype, chunk_size=chunk_size)
        step(min(n, 2048))  # warm-up on a prefix: kernels chosen, AdamW state allocated
        held = allocated_bytes(device) - before
        ms: list[float] = []
        extra = peak_memory(lambda: ms.append(call_ms(lambda: losses.append(step()), device=device)), device=device)
        row.update(step_s=ms[0] / 1e3, tokens_per_s=n / (ms[0] / 1e3), peak_gib=(held + extra) / 2**30,
                   loss=losses[0])
        stop = "time" if ms[0] / 1e3 > max_step_s else ""
    except (RuntimeError, MemoryError) as err:
        row["status"] = "oom" if is_oom(err) else f"error: {str(err).splitlines()[0][:120]}"
        stop = "memory" if is_oom(err) else "error"
    step = model = None  # noqa: F841 - free the model and its optimizer before the next row
    free_memory()
    row["stopped_by"] = stop
    return stop


def main(argv: list[str] | None = None) -> int:
    """``compare`` or ``search`` from the command line; CSVs go to ``--out``. See ``--help``."""
    parser = argparse.ArgumentParser(prog="python -m labkit longctx", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    compare = sub.add_parser("compare", help="labkit's attention vs sdpa: tokens/s, loss, peak memory")
    compare.add_argument("--seq-lens", type=ca.integers(2), default=[2**15, 2**16, 2**17], help="comma-separated N")
    compare.add_argument("--implementations", type=ca.checked(gpt2.parse_implementation, "implementation", many=True),
                         default="sdpa,labkit", help="comma-separated attn implementations")
    compare.add_argument("--config", default="flash+ckpt+chunked", choices=list(CONFIGS), help="levers to use")
    compare.add_argument("--rounds", type=ca.integer(1, 5), default=5, help="timed steps per implementation and N")
    search = sub.add_parser("search", help="longest N per configuration, until memory or step time stops it")
    search.add_argument("--configs", type=ca.names(CONFIGS, "config"), default="rope+ckpt+chunked+mlp+offload",
                        help="comma-separated names")
    search.add_argument("--start", type=ca.integer(2, 2048), default=32768, help="first N (then doubled)")
    search.add_argument("--max-len", type=ca.integer(2, 65536),
                        help="largest N to try (default: no limit on a GPU; a CPU needs one: its memory must last)")
    search.add_argument("--max-step-s", type=ca.number(0, 150), default=150.0, help="step-time limit in seconds")
    search.add_argument("--attention", type=ca.checked(gpt2.parse_implementation, "implementation"),
                        help="implementation for every configuration, e.g. labkit:fa4")
    for p in (compare, search):
        p.add_argument("--size", default="small", choices=list(gpt2.SIZES), help="GPT-2 size")
        p.add_argument("--chunk-size", type=ca.integer(1, 4096), default=4096, help="chunked loss: positions per chunk")
        p.add_argument("--out", type=ca.out_folder("build/longctx"), default="build/longctx", help="folder for the CSV")
    args = parser.parse_args(argv)
    searching, fail = args.command == "search", sub.choices[args.command].error  # argparse's one line, status 2
    configs, impls = (args.configs, [args.attention]) if searching else ([args.config], args.implementations)
    if any(CONFIGS[c].rope for c in configs) and any(i and gpt2.parse_implementation(i)[0] != gpt2.ATTN_NAME for i in impls):
        fail("RoPE (a rope+ configuration) runs in labkit's attention only: give labkit or labkit:<backend>")
    if searching and (args.max_len or 0) < args.start and (args.max_len or default_device().type != "cuda"):
        fail(f"argument --max-len: must be at least --start ({args.start}), and a CPU needs one; got {args.max_len}, "
             f"e.g. {2 * args.start}")
    args.out.mkdir(parents=True, exist_ok=True)
    if searching:
        df = longest_sequence(args.configs, size=args.size, start=args.start, max_len=args.max_len,
                              max_step_s=args.max_step_s, attention=args.attention, chunk_size=args.chunk_size,
                              progress=False)
    else:
        df = compare_attention(args.seq_lens, implementations=args.implementations, config=args.config,
                               size=args.size, rounds=args.rounds, chunk_size=args.chunk_size)
    df.to_csv(path := args.out / f"{args.command}.csv", index=False)
    print(df.drop(columns="device").to_string(index=False, float_format="{:.4g}".format))
    if searching:
        print(summary(df).to_string(index=False, float_format="{:.4g}".format))
    print(f"wrote {path}")
    return 0


__all__ = ["CONFIGS", "LongConfig", "MLP_CHUNKS", "compare_attention", "longest_sequence", "main", "summary",
           "train_step"]
