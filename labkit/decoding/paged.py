"""A paged KV cache: page tables, K/V written into pages, greedy generation through the student's pages.

Notebook 08 writes the page allocator and the paged kernel; this module is the plumbing around them:

- :func:`page_table`: per-sequence page lists as the padded int32 table a paged kernel reads.
- :func:`write_kv`: new tokens' K/V scattered into the pages at the slots an allocator returned.
- :func:`generate_paged`: greedy generation with a Hugging Face Llama model whose decode attention is
  the student's paged kernel and whose cache pages come from the student's allocator (both passed in),
  each decode step replayed from a CUDA graph on a GPU.

Layout: a paged cache is ``[num_pages, page_size, H_kv, d]``; a decode query is ``[B, H_q, d]``.

Used in: 08_decode_attention (through ``lk.decode``).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from labkit.decoding.graphtime import capture, warm_up


def page_table(pages: list[list[int]], *, width: int | None = None, device=None) -> torch.Tensor:
    """The page table of a batch: row b lists sequence b's pages in order, padded with 0.

    Args:
        pages: per sequence, its page ids in token order (an allocator's ``pages(seq)``).
        width: columns (default: the longest list, at least 1).

    Returns:
        int32 [B, width]. Padding is page 0: a kernel must not read past a sequence's length.
    """
    width = max([1, *map(len, pages)]) if width is None else width
    if any(len(p) > width for p in pages):
        raise ValueError(f"a sequence has more than width={width} pages")
    table = torch.zeros(len(pages), width, dtype=torch.int32)
    for row, p in enumerate(pages):
        table[row, :len(p)] = torch.tensor(p, dtype=torch.int32)
    return table.to(device)


def write_kv(k_pages: torch.Tensor, v_pages: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Store new tokens' keys and values in the paged cache, in place.

    Args:
        k_pages, v_pages: [num_pages, page_size, H_kv, d].
        slots: [T] flat slot of each token, ``page * page_size + offset``.
        k, v: [T, H_kv, d].
    """
    if slots.numel() != k.shape[0]:
        raise ValueError(f"{slots.numel()} slots for {k.shape[0]} tokens")
    flat = slots.to(device=k_pages.device, dtype=torch.long)
    k_pages.view(-1, *k_pages.shape[2:])[flat] = k.to(k_pages.dtype)
    v_pages.view(-1, *v_pages.shape[2:])[flat] = v.to(v_pages.dtype)


def _forward(model, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, k_pages: list[torch.Tensor],
             v_pages: list[torch.Tensor], attention: Callable) -> torch.Tensor:
    """Every layer of a Llama-style model on ids [B, n] at positions pos [B, n]; returns the greedy next ids [B, 1].

    Each layer's new K/V go into its pages at slots [B * n] (row-major over B, n) before its attention,
    ``attention(layer, q [B, H_q, n, d], k, v [B, H_kv, n, d]) -> o [B, n, H_q, d]``.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inner, (b, n) = model.model, ids.shape
    d = inner.layers[0].self_attn.head_dim
    h = inner.embed_tokens(ids)                                       # [B, n, hidden]
    cos, sin = inner.rotary_emb(h, pos)
    for i, layer in enumerate(inner.layers):
        attn, x = layer.self_attn, layer.input_layernorm(h)
        q, k, v = (proj(x).view(b, n, -1, d).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)                   # [B, H, n, d]
        write_kv(k_pages[i], v_pages[i], slots, k.transpose(1, 2).reshape(b * n, -1, d),
                 v.transpose(1, 2).reshape(b * n, -1, d))
        h = h + attn.o_proj(attention(i, q, k, v).reshape(b, n, -1).to(h.dtype))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(inner.norm(h[:, -1])).argmax(-1, keepdim=True)


@torch.no_grad()
def generate_paged(model, prompt: torch.Tensor, new_tokens: int, *, allocator, attend: Callable,
                   k_pages: list[torch.Tensor], v_pages: list[torch.Tensor],
                   cuda_graph: bool | None = None) -> torch.Tensor:
    """Greedy generation with a Llama-style Hugging Face model, its KV cache in pages.

    The prompt is prefilled with causal SDPA (prefill is not the lesson); every decode step writes
    each layer's new K/V into the pages at the slots ``allocator.append(seq, 1)`` returns and calls
    ``attend`` for the attention. The sequences are freed at the end, even after an error.

    A decode step launches some 40 kernels per layer, each costing microseconds of Python and driver
    time for microseconds of GPU work at batch 1. With ``cuda_graph`` the first decode step is captured
    in a CUDA graph and every later step replays it: its inputs (token ids, slots, page table,
    lengths; positions follow from the lengths) are copied into the same tensors each step, one
    host -> GPU copy, so the host only runs the allocator.

    Args:
        model: a ``LlamaForCausalLM`` (or one with the same module names), in eval mode.
        prompt: [B, T] token ids (equal lengths).
        new_tokens: tokens to generate per sequence.
        allocator: the student's page allocator: ``append(seq, n) -> slots [n]``, ``pages(seq)``,
            ``length(seq)``, ``free(seq)``; sequences are named 0..B-1.
        attend: ``attend(q [B, H_q, d], k_pages, v_pages, block_table [B, P] int32, seqlens [B] int32,
            max_len)`` -> o [B, H_q, d]. ``max_len`` is T + new_tokens, a Python int bounding every
            sequence's length for the whole generation: the kernel's wrapper need not read
            ``seqlens.max()`` (a GPU -> CPU sync per layer), and its launch is the same every step (a
            graph replays fixed launches; only the tensors' contents change). ``block_table`` has
            ceil(max_len / page_size) columns.
        k_pages, v_pages: per layer, [num_pages, page_size, H_kv, d].
        cuda_graph: replay the decode step from a CUDA graph (default: where the model is on a GPU).

    Returns:
        [B, T + new_tokens] token ids, as ``model.generate(prompt, do_sample=False)`` would give.
    """
    if new_tokens < 0:
        raise ValueError(f"new_tokens = {new_tokens}; it must be >= 0")
    if new_tokens == 0:
        return prompt
    b, t = prompt.shape
    device, capacity = prompt.device, t + new_tokens
    width = -(-capacity // k_pages[0].shape[1])
    use_graph = device.type == "cuda" if cuda_graph is None else cuda_graph
    if use_graph and device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs the model on a CUDA device, not {device}")

    def prefill(i, q, k, v):                                          # causal over the prompt
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)

    ids = torch.zeros(b, 1, dtype=torch.long, device=device)         # the step's inputs, in tensors that stay put:
    packed = torch.zeros(b * (2 + width), dtype=torch.long, device=device)   # slots [B], lens [B], table [B, width]

    def decode_step():                                                # reads only ids and packed: replayable
        slots, lens, table = packed[:b], packed[b:2 * b].int(), packed[2 * b:].view(b, width).int()

        def paged(i, q, k, v):
            return attend(q[:, :, 0].contiguous(), k_pages[i], v_pages[i], table, lens, capacity)[:, None]
        return _forward(model, ids, (lens - 1).long()[:, None], slots, k_pages, v_pages, paged)

    graph, out = None, [prompt]
    try:
        slots = torch.stack([allocator.append(s, t) for s in range(b)]).reshape(-1).to(device)
        pos = torch.arange(t, device=device)[None].expand(b, t)
        out.append(_forward(model, prompt, pos, slots, k_pages, v_pages, prefill))
        for _ in range(new_tokens - 1):
            slots = torch.cat([allocator.append(s, 1) for s in range(b)])
            lens = torch.tensor([allocator.length(s) for s in range(b)])
            table = page_table([allocator.pages(s) for s in range(b)], width=width)
            packed.copy_(torch.cat([slots, lens, table.view(-1).long()]))   # one host -> GPU copy per step
            ids.copy_(out[-1])
            if not use_graph:
                out.append(decode_step())
                continue
            if graph is None:
                warm_up(decode_step)
                graph, next_ids = capture(decode_step)
            graph.replay()
            out.append(next_ids.clone())
    finally:
        for s in range(b):
            try:
                allocator.free(s)
            except KeyError:                                          # never allocated: append failed first
                pass
    return torch.cat(out, dim=1)
