"""PyTorch's FlexAttention as notebook 09 uses it: one call across torch versions, a block mask's lists, its plot.

What the notebook's exercises write (the dense reference, the mask and score rules, the block lists, the
kernel) is not here: this module only calls the library and draws. ``flex`` runs
``torch.nn.attention.flex_attention`` eagerly (on a CPU: unfused, it materializes the scores; the
notebook's checks use it for values, never for speed) and returns ``(o, lse)`` whatever the installed
torch calls its log-sum-exp output (``return_aux=AuxRequest(lse=True)`` from 2.9, ``return_lse`` before).

Used in: 09_flex_attention.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

EAGER_WARNING = "flex_attention called without torch.compile"   # the eager path's UserWarning, expected here
STATES = ("empty", "partial", "full")                          # a block's state: 0, 1, 2 in a grid
LIST_NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
              "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, score_mod: Callable | None = None,
         mask_mod: Callable | None = None, block: int = 128, scale: float | None = None,
         compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``flex_attention(q, k, v)`` with ``score_mod`` and a block mask made from ``mask_mod``: (o, lse).

    Args:
        q: [B, H, Nq, d]; k, v: [B, H, Nk, d] (same dtype and device).
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool``, independent of b and h here (the mask is built
            once with ``B = H = None``); None attends everywhere.
        block: the block mask's block size (128 on a GPU; any size on a CPU).
        compiled: run ``torch.compile(flex_attention)`` (a GPU's fused kernel) instead of the eager path.
    Returns:
        o [B, H, Nq, d] in q's dtype and lse [B, H, Nq] (fp32; -inf for a row that sees no key).
    """
    from torch.nn.attention import flex_attention as fa

    Nq, Nk = q.shape[-2], k.shape[-2]
    block_mask = None if mask_mod is None else fa.create_block_mask(mask_mod, None, None, Nq, Nk, device=q.device,
                                                                    BLOCK_SIZE=block)
    fn = torch.compile(fa.flex_attention) if compiled else fa.flex_attention
    debug = getattr(fa, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=EAGER_WARNING)
        try:   # eager: the math path called directly, without tracing the mods through dynamo (a notebook's
            if debug is not None and not compiled:   # functions defined in an exec'd namespace trip its guards)
                fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
            if hasattr(fa, "AuxRequest"):
                o, aux = fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                            return_aux=fa.AuxRequest(lse=True))
                return o, aux.lse
            return fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, return_lse=True)
        finally:
            if debug is not None:
                fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = debug


def torch_lists(mask_mod: Callable, Nq: int, Nk: int, block: int) -> dict[str, torch.Tensor]:
    """``create_block_mask``'s eight lists for one (batch, head), as int64 tensors (num: [n], indices: [n, m]).

    Only the first ``num[i]`` entries of row i of an index list are read by a kernel; the rest is filler.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    bm = create_block_mask(mask_mod, None, None, Nq, Nk, device="cpu", BLOCK_SIZE=block)
    return {name: getattr(bm, name)[0, 0].long() for name in LIST_NAMES}


def state_grid(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) -> torch.Tensor:
    """[query blocks, key blocks] int grid of block states (0 empty, 1 partial, 2 full) read off the kv lists."""
    n_q, n_k = kv_indices.shape
    grid = torch.zeros(n_q, n_k, dtype=torch.int64)
    for i in range(n_q):
        grid[i, kv_indices[i, :int(kv_num_blocks[i])].long()] = 1
        grid[i, full_kv_indices[i, :int(full_kv_num_blocks[i])].long()] = 2
    return grid


def plot_grids(grids: dict[str, torch.Tensor], *, title: str = ""):
    """One panel per mask: its block states (white empty, orange partial, blue full) and the share of blocks read."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    from labkit.core import plots

    colors = ("#ffffff", "#f4a259", "#3d5a80")
    fig, axes = plt.subplots(1, len(grids), figsize=(3.6 * len(grids), 3.8), squeeze=False)
    for ax, (name, grid) in zip(axes[0], grids.items()):
        ax.imshow(grid.numpy(), cmap=ListedColormap(colors), vmin=0, vmax=2, interpolation="nearest")
        read = float((grid > 0).float().mean())
        ax.set_title(f"{name}\n{plots.label('讀取的區塊', 'blocks read')} {read:.0%}")
        ax.set_xlabel(plots.label("鍵區塊", "key block"))
        ax.set_ylabel(plots.label("查詢區塊", "query block"))
        ax.set_xticks([])
        ax.set_yticks([])
    names = (plots.label("空（略過）", "empty (skipped)"), plots.label("部分（逐元素遮罩）", "partial (masked)"),
             plots.label("全滿（不遮罩）", "full (no mask)"))
    fig.legend(handles=[Patch(facecolor=c, edgecolor="#888888", label=n) for c, n in zip(colors, names)],
               loc="lower center", ncol=3, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig
