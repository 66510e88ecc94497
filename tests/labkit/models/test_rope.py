"""labkit.models.rope: the rotation (RoFormer pairing), relative positions, and GPT-2 without a position table.

The rotation runs in fp32 with angles computed in float64: against a float64 evaluation of the
same formula the error is fp32 round-off of O(1) numbers (~1e-6), so atol=1e-5.
"""
from __future__ import annotations

import pytest
import torch

from labkit.models import gpt2, rope
from labkit.long import levers


def test_pairs_rotate_like_complex_numbers(randn):
    b, h, n, d, base = 2, 3, 17, 8, 100.0
    q, k = randn(b, h, n, d, seed=0), randn(b, h, n, d, seed=1)
    rq, rk = rope.rotate_queries_keys(q, k, base)
    theta = base ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)  # [D/2]
    angle = torch.arange(n, dtype=torch.float64)[:, None] * theta  # [N, D/2]
    x0, x1 = q.double()[..., 0::2], q.double()[..., 1::2]  # channels 2i and 2i+1
    expected = torch.stack([x0 * angle.cos() - x1 * angle.sin(), x0 * angle.sin() + x1 * angle.cos()], -1).flatten(-2)
    torch.testing.assert_close(rq.double(), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(rk[..., 0, :], k[..., 0, :])  # position 0: no rotation
    torch.testing.assert_close(rk.norm(dim=-1), k.norm(dim=-1))  # a rotation keeps norms


def test_scores_depend_only_on_relative_position(randn):
    d, n = 16, 64
    q = randn(d, seed=1).expand(1, 1, n, d)  # the same vector at every position
    k = randn(d, seed=2).expand(1, 1, n, d)
    rq, rk = rope.rotate_queries_keys(q, k)
    s = (rq @ rk.transpose(-2, -1))[0, 0]  # s[m, j] = <R_m q, R_j k>
    for offset in (0, 3, 20):
        diag = torch.diagonal(s, offset=-offset)
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), rtol=0, atol=1e-4)


def test_queries_sit_at_the_last_positions_and_dtype_is_kept(randn):
    q, k = randn(1, 2, 10, 8, seed=0, dtype=torch.bfloat16), randn(1, 2, 10, 8, seed=1, dtype=torch.bfloat16)
    full, _ = rope.rotate_queries_keys(q, k)
    last, _ = rope.rotate_queries_keys(q[:, :, -3:], k)  # decoding: 3 new queries, 10 cached keys
    assert full.dtype == torch.bfloat16
    torch.testing.assert_close(last, full[:, :, -3:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="even head dim"):
        rope.rotate_queries_keys(q[..., :7], k[..., :7])


def test_use_rope_drops_the_table_and_the_model_trains():
    m = gpt2.build_model("tiny", attn_implementation="labkit:sdpa_math").train()
    before = sum(p.numel() for p in m.parameters())
    rope.use_rope(m)
    assert before - sum(p.numel() for p in m.parameters()) == 512 * 64  # the 512 x 64 position table
    ids = torch.randint(0, 255, (2, 700), generator=torch.Generator().manual_seed(0))  # longer than any table had
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        loss = levers.lm_loss(m, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_rope_model_decodes_with_a_cache_like_without():
    m = gpt2.build_model("tiny", attn_implementation="labkit")
    rope.use_rope(m)
    prompt = torch.randint(0, 255, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        seq = prompt
        for _ in range(5):  # no cache: recompute the whole sequence every step
            seq = torch.cat([seq, m(input_ids=seq, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
        cached = m.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, min_new_tokens=5,
                            do_sample=False, pad_token_id=0)
    assert torch.equal(cached, seq)


def test_position_matters_without_a_table():
    """Without the rotation a table-free model could not tell positions apart: swapping two
    earlier tokens would not change the last position's logits."""
    m = gpt2.build_model("tiny", attn_implementation="labkit")
    rope.use_rope(m)
    ids = torch.randint(0, 255, (1, 12), generator=torch.Generator().manual_seed(2))
    swapped = ids.clone()
    swapped[0, [2, 7]] = ids[0, [7, 2]]
    last = [gpt2.forward_logits(m, x)[0, -1] for x in (ids, swapped)]
    assert (last[0] - last[1]).abs().max() > 1e-3
