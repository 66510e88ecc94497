"""Synthetic submissions for the speed-of-light board, made from the solution notebooks by text substitution.

nbgrader's layout, ``ROOT/<student>/<assignment>/<assignment>.ipynb``. Each variant is a list of
(old, new) replacements in the solution's code cells; each ``old`` must occur exactly once.

- ``ok``: the solution; ``wrong``: o divided by l + 1 (a wrong result at every shape); ``flagged``: the wrapper
  calls ``F.scaled_dot_product_attention`` (09: ``flex_attention``); ``pytorch``: the forward in plain PyTorch
  (no Triton kernel launched); ``error``: an answer cell raises (NameError); ``timeout``: an answer cell sleeps
  past any limit.
- Cheats that name nothing the name checks know, 08's ``decode_split``: ``lookup`` reaches SDPA through names
  built at run time, ``matmul`` computes o with torch.matmul and a hand softmax (both while the notebook's kernel
  still launches), ``small`` launches the kernel only for inputs as small as the board's tiny call.
- Weaker, still right, for the GPU ranking: 08 ``nosplit`` (decode_split and paged_decode launch one split),
  06 ``noskip`` (the causal forward masks the tiles above the diagonal instead of skipping them) and ``smalltiles``
  (the forward tries one small tile, 32 x 16, instead of its tuned list), 09 ``dense``
  (the forward reads every key block as a partial one: the mask rule keeps it right, no block is skipped), 10
  ``noskip`` (as 06's).
- 10: ``wrong`` leaves v's descale out (o off by ~100x); ``bf16`` widens q, k, P and v to bf16 before both
  ``tl.dot`` (right, since bf16 holds every e4m3 value, but no FP8 MMA: ``flagged`` by the sm90 compile);
  ``flagged`` returns SDPA's o (of the e4m3 values, the descales left out: the name check stops it first).

GPU check: ``python tests/gpu/board_gpu.py`` (:data:`GPU_STUDENTS`: the solution, the weaker variant, and what
must be flagged or wrong, as compiled kernels).

Used in: tests/labkit/board/test_board.py.
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# 08's cheats that the name checks miss (issue: the board judged by what runs): decode_split's last two lines, and
# replacements that keep the notebook's kernel launching but return another computation's o.
_DECODE_RETURN = ("    o_part, lse_part, _ = split_kv_partials(q, k, v, seqlens, num_splits, max_len=max_len)\n"
                  "    return combine_partials(o_part, lse_part, q.dtype)\n")
_KERNEL_RUNS = ("    o_part, lse_part, _ = split_kv_partials(q, k, v, seqlens, num_splits, max_len=max_len)\n"
                "    _, lse = combine_partials(o_part, lse_part, q.dtype)   # the kernel still launches\n")
_SDPA_BY_BUILT_NAME = (
    "    import importlib\n"
    "    attend = getattr(importlib.import_module('torch.nn.' + 'functional'), 'scaled_dot_' + 'product_attention')\n"
    "    keep = torch.arange(k.shape[1], device=q.device)[None, :] < seqlens[:, None]\n"
    "    o = attend(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep[:, None, None, :],\n"
    "               enable_gqa=True)[:, :, 0]\n"
    "    return o.to(q.dtype), lse\n")


def _hand_attention(products: str) -> str:
    """decode_split's o and lse in plain torch, the scores and o by torch.matmul or by broadcast sums ("sum")."""
    if products == "sum":
        scores, out = "(kr * q.float()[:, :, None, :]).sum(-1)", "((p / l)[..., None] * vr).sum(-2)"
    else:
        scores, out = f"{products}(kr, q.float()[..., None])[..., 0]", f"{products}((p / l)[:, :, None, :], vr)[:, :, 0]"
    return ("    g = q.shape[1] // k.shape[2]\n"
            "    kr, vr = (t.repeat_interleave(g, dim=2).transpose(1, 2).float() for t in (k, v))   # [B, H_q, N, d]\n"
            f"    s = {scores} * q.shape[-1] ** -0.5\n"
            "    s = s.masked_fill(torch.arange(k.shape[1], device=q.device) >= seqlens[:, None, None], float('-inf'))\n"
            "    m = s.amax(-1, keepdim=True)\n    p = (s - m).exp()\n    l = p.sum(-1, keepdim=True)\n"
            f"    return {out}.to(q.dtype), (m + l.log())[..., 0]\n")


VARIANTS = {
    "08_decode_attention": {
        "ok": [],
        "wrong": [("    o = acc / l_safe[:, None]\n", "    o = acc / (l_safe[:, None] + 1.0)\n")],
        "flagged": [("    o_part, lse_part, _ = split_kv_partials(q, k, v, seqlens, num_splits, max_len=max_len)\n"
                     "    return combine_partials(o_part, lse_part, q.dtype)\n",
                     "    o = torch.nn.functional.scaled_dot_product_attention(\n"
                     "        q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)[:, :, 0]\n"
                     "    return o, torch.zeros(o.shape[:2], device=o.device)\n")],
        "error": [("def chunk_size(max_len, num_splits, block):\n",
                   "BLOCK_SPLIT = block_size_for(64)\n\n\ndef chunk_size(max_len, num_splits, block):\n")],
        "timeout": [("class PageAllocator:\n", "import time\n\ntime.sleep(10_000)\n\n\nclass PageAllocator:\n")],
        "lookup": [(_DECODE_RETURN, _KERNEL_RUNS + _SDPA_BY_BUILT_NAME)],
        "matmul": [(_DECODE_RETURN, _KERNEL_RUNS + _hand_attention("torch.matmul"))],
        "small": [(_DECODE_RETURN, "    if k.shape[1] <= 64:   # the board's tiny call: the kernel\n"
                                   + _DECODE_RETURN.replace("    ", "        ", 2) + _hand_attention("sum"))],
        "nosplit": [("        num_splits = launch_splits(q.shape[0], k.shape[2], max_len, BLOCK_N)\n",
                     "        num_splits = 1\n"),
                    ("        num_splits = launch_splits(q.shape[0], k_pages.shape[2], max_len, page_size)\n",
                     "        num_splits = 1\n")],
    },
    "06_triton_flashattention": {
        "ok": [],
        "wrong": [("(acc / l_safe[:, None])", "(acc / (l_safe[:, None] + 1.0))")],
        "flagged": [("        o, lse = flash_attention_forward(q, k, v, is_causal=is_causal)\n",
                     "        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)\n"
                     "        lse = torch.zeros(q.shape[:-1], device=q.device)\n")],
        "pytorch": [("        o, lse = flash_attention_forward(q, k, v, is_causal=is_causal)\n",
                     "        s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5\n"
                     "        p = (s - s.amax(-1, keepdim=True)).exp()\n"
                     "        o, lse = (p / p.sum(-1, keepdim=True)) @ v, p.sum(-1).log()\n")],
        "noskip": [("        hi = tl.minimum(N_K, start_m + BLOCK_M + shift)"
                    "                    # keys any row here sees\n",
                    "        hi = N_K                                                           # no tile skipped\n")],
        "smalltiles": [("    [(128, 64, 4, 3), (128, 32, 4, 4), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 4), (128, 64, 4, 7)],\n",
                        "    [(32, 16, 4, 1)],                                          # one small tile, untuned\n")],
    },
    "10_fp8_attention": {
        "ok": [],
        "wrong": [("acc = acc * alpha[:, None] + tl.dot(p8, v) * tl.load(vd_base + j)",
                   "acc = acc * alpha[:, None] + tl.dot(p8, v)")],                        # v's descale left out
        "bf16": [("s = tl.dot(q, kt) * (q_scale", "s = tl.dot(q.to(tl.bfloat16), kt.to(tl.bfloat16)) * (q_scale"),
                 ("tl.dot(p8, v) * tl.load(vd_base + j)",
                  "tl.dot(p8.to(tl.bfloat16), v.to(tl.bfloat16)) * tl.load(vd_base + j)")],
        "flagged": [("    return o, lse\n",
                     "    o = torch.nn.functional.scaled_dot_product_attention(q8.float(), k8.float(), v8.float(),\n"
                     "                                                         enable_gqa=True).to(o.dtype)\n"
                     "    return o, lse\n")],
        "noskip": [("        hi = tl.maximum(tl.minimum(N_K, tile_m * BLOCK_M + BLOCK_M + N_K - N_Q), 0)\n",
                    "        hi = N_K                                                # no tile skipped\n")],
    },
    "09_flex_attention": {
        "ok": [],
        "wrong": [("(acc / l_safe[:, None])", "(acc / (l_safe[:, None] + 1.0))")],
        "flagged": [("    return o.reshape(q.shape), lse.reshape(B, H, Nq)\n",
                     "    o = flex_attention(q, k, v)\n    return o, lse.reshape(B, H, Nq)\n")],
        "dense": [("    kv_idx = as_i32(\"kv_indices\")\n",
                   "    n_q, n_k = triton.cdiv(Nq, block), triton.cdiv(Nk, block)   # every block partial\n"
                   "    lists = {**lists, \"kv_num_blocks\": torch.full((n_q,), n_k),\n"
                   "             \"full_kv_num_blocks\": torch.zeros(n_q)}\n"
                   "    kv_idx = torch.arange(n_k, device=q.device, dtype=torch.int32).repeat(n_q, 1).contiguous()\n")],
    },
}
GPU_STUDENTS = {"08_decode_attention": ["ok", "nosplit", "wrong", "flagged", "lookup", "matmul", "small"],
                "06_triton_flashattention": ["ok", "noskip", "smalltiles", "flagged"],
                "09_flex_attention": ["ok", "dense", "wrong", "flagged"],
                "10_fp8_attention": ["ok", "noskip", "wrong", "bf16", "flagged"]}


def variant(assignment: str, name: str) -> dict:
    """The solution notebook of ``assignment`` with the replacements of variant ``name``."""
    nb = json.loads((ROOT / "solutions" / assignment / f"{assignment}.ipynb").read_text(encoding="utf-8"))
    for old, new in VARIANTS[assignment][name]:
        hits = [c for c in nb["cells"] if c["cell_type"] == "code" and old in "".join(c["source"])]
        assert len(hits) == 1 and "".join(hits[0]["source"]).count(old) == 1, f"{assignment} {name}: {old!r}"
        hits[0]["source"] = "".join(hits[0]["source"]).replace(old, new).splitlines(True)
    return nb


def write_submitted(root: Path, assignment: str, students: list[str]) -> Path:
    """``root/<variant>/<assignment>/<assignment>.ipynb`` for each variant in ``students``; returns ``root``."""
    for name in students:
        folder = Path(root) / name / assignment
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{assignment}.ipynb").write_text(json.dumps(variant(assignment, name), ensure_ascii=False, indent=1)
                                                    + "\n", encoding="utf-8")
    return Path(root)
