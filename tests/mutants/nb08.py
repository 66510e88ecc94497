"""Notebook 08 (08_decode_attention): rules its exercises state, wrong answers, answers fitted to visible cases."""

ASSIGNMENT = "08_decode_attention"
SETUP = ["P = lk.profiles.choose(", "def decode_reference("]

# grade_id -> the rules its visible tests check
RULES = {
    "ex1_kv_calculator": ["bytes per token = 2 (K and V) x layers x H_kv x d x bytes per element",
                          "each factor on its own: K and V, layers, H_kv (not H_q), element size",
                          "longest context and largest batch rounded down; 0 when one token does not fit",
                          "a negative budget (8 GB GPU, 16 GB of weights): 0, not a negative count (both calculators)",
                          "the context and element size passed in (context 1000, fp8, fp32), not 4096 or bf16's 2",
                          "largest batch: 1.75 sequences fit -> 1 (floor, not round); none fits -> 0 (not at least 1)",
                          "Python ints, also for a float budget",
                          "batch sequences share the budget",
                          "no labkit"],
    "ex2_decode_kernel": ["o and lse (natural log) equal float64 attention with K/V repeated per group",
                          "tail tile masked (N not a multiple of the block)",
                          "GQA: KV head j serves query heads j*g .. j*g+g-1 (g = 4 and g = 3 padded to 16 rows)",
                          "head size, key block and query rows of different sizes (d = 32, B_N = 16, B_G = 16 or 32)",
                          "a key block other than the notebook's (B_N = 32 launched by hand, N = 40 not a multiple of it)",
                          "inputs unchanged; transposed and sliced views of q, k, v give the same o and lse (o allocated "
                          "contiguous, not like q)",
                          "padded rows (g = 3 in 16) neither read nor written: o and lse stores masked",
                          "scores near 1e3: the max subtracted, the state rescaled",
                          "a fully masked tile: no NaN; a row with no key gets o = 0, lse = -inf",
                          "bf16 in: bf16 o, fp32 lse",
                          "precision (2x rule vs float64, against plain attention in that dtype): bf16 and fp16 o at N = 1000 "
                          "(63 key tiles): acc kept fp32 in the loop",
                          "every score near -240 (fp32, a tail tile): the running max starts at -inf and is taken after the mask",
                          "K/V read once per KV head (elements counted)",
                          "64-bit offsets: no int32 overflow when b*N*H_kv*d passes 2^31 (interpreter, sequence 2^22)",
                          "the kernel is launched; no SDPA, softmax or the reference",
                          "compiles for sm80 and sm90; fp32 dot with input_precision=PREC (no TF32 mma in the compiled code)",
                          "precision in the compiled Triton IR (bf16 and fp16 launches): s, m, l, acc, the exp2 argument and "
                          "lse in fp32; a value converted to the input dtype only a tl.dot operand (p) or stored (o)"],
    "ex3_split_kernel": ["split count: ceil(SMs / (batch x H_kv)), capped at ceil(max_len / block), at least 1 "
                         "(also when the SMs divide evenly, and when max_len is a multiple of the block; H_kv = 4, block 128)",
                         "partials equal attention over each split's own keys: S = 1, S = 3 with a tail, GQA, d = 32, g = 32 (B_G = 32)",
                         "a key block other than the notebook's (B_N = 32 launched by hand, CHUNK = 2 blocks, tails)",
                         "inputs unchanged; transposed and sliced views of q, k, v and lengths cut as lens[::2] give the same partials",
                         "padded rows (g = 3 in 16) not written outside the partials",
                         "per-sequence lengths (0, shorter than a split, not a multiple of the block)",
                         "splits with no key: o = 0, lse = -inf, no NaN",
                         "each split reads only its own keys and loops over its own blocks only (elements and "
                         "load lanes counted: no loop over the whole cache masked down to the split)",
                         "each split's loop stops at its sequence's length (lengths 96 and 20: load lanes counted)",
                         "64-bit offsets: no int32 overflow with a capacity of 2^26 tokens (interpreter)",
                         "precision: bf16 and fp16 o_s over N = 1000 by the 2x rule (acc fp32); every score near -240 (fp32)",
                         "precision in the compiled Triton IR (bf16 and fp16 launches): the partials o_s, lse_s stored as "
                         "fp32, acc not rounded before _finish",
                         "no SDPA, softmax or the reference; compiles for sm80 and sm90"],
    "ex4_combine_kernel": ["merged o and lse equal attention over all keys (uneven splits, S = 1, S not a power of 2)",
                           "S = 17 (BLOCK_S = 32, batch 1 on 132 SMs) with d = 32",
                           "partials unchanged; transposed and sliced views of them give the same o and lse",
                           "lse near +-1e4: no overflow (exp only of differences from the max)",
                           "-inf partials weigh 0; a row of all -inf gives o = 0, lse = -inf, no NaN",
                           "o in the requested dtype (bf16)",
                           "bf16 and fp16 o rounded once, at the store (vs a float64 merge of the same partials, rtol = eps); "
                           "lse fp32 whatever o's dtype",
                           "BLOCK_S padding lanes (s >= S) not read: elements counted",
                           "no logsumexp, logaddexp, softmax or the reference; compiles for sm80 and sm90"],
    "ex5_page_allocator": ["a sequence of length L holds ceil(L / page_size) pages; a new page only when the last is full",
                           "slots = page x page_size + t % page_size, by each sequence's own pages",
                           "no page held twice; free pages = total - held",
                           "n = 0 allowed; n < 0 raises ValueError",
                           "out of pages: MemoryError naming the pages needed and free, and nothing changed (no new sequence "
                           "registered, a partly filled last page left as it was)",
                           "free returns every page and forgets the sequence; pages reused; KeyError for unknown sequences",
                           "pages of 3: a sequence freed out of order (not the last allocated), its pages reused, none handed "
                           "out twice while in use",
                           "any hashable sequence name; no labkit"],
    "ex6_paged_kernel": ["padded rows (g = 3 in 16) not written outside the partials",
                         "partials and merged o equal attention over the contiguous cache: pages in order and shuffled",
                         "per-sequence lengths (0, not a multiple of the page); GQA; S = 1 and 3; page size != head size; "
                         "g = 32 (B_G = 32)",
                         "the cache, page table and lengths unchanged; transposed and sliced views of q and the pages, a page "
                         "table cut from a wider one and lengths cut as lens[::2] give the same partials",
                         "only tokens within the length read; the loop stops at the length, not the chunk: page-table "
                         "padding (an invalid page id) not read (elements and load lanes counted)",
                         "S = 3, lengths 96 and 20: each split walks its own pages only, from s * CHUNK to min((s + 1) * CHUNK, "
                         "n_b) (load lanes counted, masked-off ones too)",
                         "64-bit offsets: no int32 overflow with page ids from 2^22 (interpreter)",
                         "precision: bf16 and fp16 o_s over 63 pages by the 2x rule (acc fp32); every score near -240 (fp32)",
                         "precision in the compiled Triton IR (bf16 and fp16 launches): the partials o_s, lse_s stored as fp32",
                         "no SDPA, softmax or the reference; compiles for sm80 and sm90"],
}

# grade_id -> [(mistake, text in the answer, replacement)]: each fails a visible test
MISTAKES = {
    "ex1_kv_calculator": [
        ("largest batch rounded to the nearest integer",
         "int(free_bytes // (context * kv_bytes_per_token(layers, n_kv_heads, head_dim, bytes_per_element)))",
         "round(free_bytes / (context * kv_bytes_per_token(layers, n_kv_heads, head_dim, bytes_per_element)))"),
        ("largest batch at least 1 (one sequence always served)",
         "return max(0, int(free_bytes // (context *", "return max(1, int(free_bytes // (context *"),
        ("K and V not both counted", "return 2 * layers * n_kv_heads * head_dim * bytes_per_element",
         "return layers * n_kv_heads * head_dim * bytes_per_element"),
        ("layers left out", "return 2 * layers * n_kv_heads * head_dim * bytes_per_element",
         "return 2 * n_kv_heads * head_dim * bytes_per_element"),
        ("element size left out", "return 2 * layers * n_kv_heads * head_dim * bytes_per_element",
         "return 2 * layers * n_kv_heads * head_dim"),
        ("true division: a float context", "int(free_bytes // (batch *", "(free_bytes / (batch *"),
        ("batch ignored", "int(free_bytes // (batch * kv_bytes_per_token", "int(free_bytes // (1 * kv_bytes_per_token"),
        ("no int() for a float budget", "int(free_bytes // (batch *", "(free_bytes // (batch *"),
        ("batch rounded up", "int(free_bytes // (context * kv_bytes_per_token(layers, n_kv_heads, head_dim, bytes_per_element)))",
         "int(-(-free_bytes // (context * kv_bytes_per_token(layers, n_kv_heads, head_dim, bytes_per_element))))"),
        ("negative budget not clamped at 0 (max_context)", "return max(0, int(free_bytes // (batch *",
         "return (int(free_bytes // (batch *"),
        ("negative budget not clamped at 0 (max_batch)", "return max(0, int(free_bytes // (context *",
         "return (int(free_bytes // (context *"),
        ("context fixed at 4096 in max_batch", "(context * kv_bytes_per_token", "(4096 * kv_bytes_per_token"),
        ("element size fixed at bf16's 2 in max_context",
         "(batch * kv_bytes_per_token(layers, n_kv_heads, head_dim, bytes_per_element))",
         "(batch * kv_bytes_per_token(layers, n_kv_heads, head_dim, 2))"),
    ],
    "ex2_decode_kernel": [
        ("exp instead of exp2 (scores in log2 units)", "p = tl.math.exp2(s - shift[:, None])", "p = tl.exp(s - shift[:, None])"),
        ("output not rescaled", "acc = acc * alpha[:, None] + tl.dot", "acc = acc + tl.dot"),
        ("GQA heads interleaved (h % H_kv)", "heads = j * G + offs_g", "heads = offs_g * H_KV + j"),
        ("tail keys not masked", "inside[None, :], qk_scale", "(offs_n >= 0)[None, :], qk_scale"),
        ("lse left in log2 units", "(m_i + tl.math.log2(l_safe)) * 0.6931471805599453", "(m_i + tl.math.log2(l_safe))"),
        ("K/V head offset missing", "kv_base = b * N * H_KV * HEAD_DIM + j * HEAD_DIM", "kv_base = b * N * H_KV * HEAD_DIM"),
        ("no -inf guard: a fully masked tile gives -inf - -inf", 'shift = tl.where(m_new == float("-inf"), 0.0, m_new)',
         "shift = m_new"),
        ("_finish divides by l = 0", "    l_safe = tl.where(empty, 1.0, l_i)\n", "    l_safe = l_i\n"),
        ("o stored without the row mask (padded rows written)", "o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])",
         "o.to(o_ptr.dtype.element_ty))"),
        ("lse stored without the row mask", "tl.store(lse_ptr + b * H_KV * G + heads, lse, mask=row_ok)",
         "tl.store(lse_ptr + b * H_KV * G + heads, lse)"),
        ("head size and key block mixed (offs_d over BLOCK_N)", "offs_d = tl.arange(0, HEAD_DIM)", "offs_d = tl.arange(0, BLOCK_N)"),
        ("keys per tile taken from the head size", "offs_n = start + tl.arange(0, BLOCK_N)", "offs_n = start + tl.arange(0, HEAD_DIM)"),
        ("query rows sized by the key block", "offs_g = tl.arange(0, BLOCK_G)", "offs_g = tl.arange(0, BLOCK_N)"),
        ("32-bit offsets (program id not widened)", "b = tl.program_id(0).to(tl.int64)", "b = tl.program_id(0)"),
        ("64-bit cast after the int32 product", "kv_base = b * N * H_KV * HEAD_DIM + j * HEAD_DIM",
         "kv_base = (b.to(tl.int32) * N * H_KV * HEAD_DIM).to(tl.int64) + j * HEAD_DIM"),
        ("no input_precision: the fp32 dot runs in TF32", "s = tl.dot(q, tl.trans(k), input_precision=PREC)", "s = tl.dot(q, tl.trans(k))"),
        ("acc rounded to the input dtype every tile",
         "acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)",
         "acc = (acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)).to(v.dtype).to(tl.float32)"),
        ("row max taken before masking (masked tail keys read as 0 count)",
         '    s = tl.where(keep, s, float("-inf"))\n    m_new = tl.maximum(m_i, tl.max(s, 1))\n',
         '    m_new = tl.maximum(m_i, tl.max(s, 1))\n    s = tl.where(keep, s, float("-inf"))\n'),
        ("a tile's P.V rounded to the input dtype before it joins acc",
         "+ tl.dot(p.to(v.dtype), v, input_precision=PREC)", "+ tl.dot(p.to(v.dtype), v, input_precision=PREC).to(v.dtype)"),
        ("lse rounded to the output dtype before its fp32 store", "tl.store(lse_ptr + b * H_KV * G + heads, lse, mask=row_ok)",
         "tl.store(lse_ptr + b * H_KV * G + heads, lse.to(o_ptr.dtype.element_ty), mask=row_ok)"),
        ("rescale with exp while the max is in log2 units", "alpha = tl.math.exp2(m_i - shift)", "alpha = tl.exp(m_i - shift)"),
        ("running max initialised to 0",
         'm_i = tl.full([BLOCK_G], float("-inf"), tl.float32)\n    l_i = tl.zeros([BLOCK_G], tl.float32)\n    kv_base',
         'm_i = tl.zeros([BLOCK_G], tl.float32)\n    l_i = tl.zeros([BLOCK_G], tl.float32)\n    kv_base'),
        ("o allocated like q (empty_like copies a transposed q's strides)",
         "o = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)", "o = torch.empty_like(q)"),
        ("q scaled in place on the host (the caller's q changed)",
         "_decode_kernel[(b, hkv)](q.contiguous(), k.contiguous(), v.contiguous(), o, lse, d ** -0.5 * LOG2E, n,",
         "_decode_kernel[(b, hkv)](q.mul_(d ** -0.5 * LOG2E).contiguous(), k.contiguous(), v.contiguous(), o, lse, 1.0, n,"),
        ("key block fixed at the interpreter's 16", "offs_n = start + tl.arange(0, BLOCK_N)", "offs_n = start + tl.arange(0, 16)"),
    ],
    "ex3_split_kernel": [
        ("floor instead of ceil for the SM fill", "fill = -(-n_sms // (batch * n_kv_heads))", "fill = n_sms // (batch * n_kv_heads)"),
        ("no cap by the context length", "return max(1, min(fill, blocks))", "return max(1, fill)"),
        ("cap by floor + 1 (one split too many when max_len is a multiple of the block)",
         "blocks = -(-max_len // block_n)", "blocks = max_len // block_n + 1"),
        ("zero splits for an empty batch", "return max(1, min(fill, blocks))", "return min(fill, blocks)"),
        ("tail masked by the capacity N", "inside = offs_n < hi", "inside = offs_n < N"),
        ("every split starts at key 0", "lo = s * CHUNK", "lo = 0"),
        ("loop over the whole cache, loads masked down to the split",
         "for start in range(lo, hi, BLOCK_N):                                   # an empty range when hi <= lo\n"
         "        offs_n = start + tl.arange(0, BLOCK_N)\n        inside = offs_n < hi\n",
         "for start in range(0, N, BLOCK_N):\n"
         "        offs_n = start + tl.arange(0, BLOCK_N)\n        inside = (offs_n >= lo) & (offs_n < hi)\n"),
        ("sequence length ignored", "hi = tl.minimum(lo + CHUNK, n_b)", "hi = tl.minimum(lo + CHUNK, N)"),
        ("partials stored without the split index", "part = (b * H_KV * G + heads) * S + s", "part = (b * H_KV * G + heads) * S"),
        ("partials stored without the row mask", "o, mask=row_ok[:, None])", "o)"),
        ("keys per tile taken from the head size", "offs_n = start + tl.arange(0, BLOCK_N)", "offs_n = start + tl.arange(0, HEAD_DIM)"),
        ("head size and key block mixed (offs_d over BLOCK_N)", "offs_d = tl.arange(0, HEAD_DIM)", "offs_d = tl.arange(0, BLOCK_N)"),
        ("32-bit offsets (program id not widened)", "b = tl.program_id(0).to(tl.int64)", "b = tl.program_id(0)"),
        ("acc rounded to the input dtype every tile", "        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, inside[None, :], qk_scale, PREC)\n    o, lse = _finish(acc, m_i, l_i)\n", "        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, inside[None, :], qk_scale, PREC)\n        acc = acc.to(k.dtype).to(tl.float32)\n    o, lse = _finish(acc, m_i, l_i)\n"),
        ("running max initialised to 0", 'm_i = tl.full([BLOCK_G], float("-inf"), tl.float32)', "m_i = tl.zeros([BLOCK_G], tl.float32)"),
        ("floor + 1 for the SM fill (one split too many when the SMs divide evenly)",
         "fill = -(-n_sms // (batch * n_kv_heads))", "fill = n_sms // (batch * n_kv_heads) + 1"),
        ("loop to the chunk's end, loads masked by the length", "for start in range(lo, hi, BLOCK_N):",
         "for start in range(lo, lo + CHUNK, BLOCK_N):"),
        ("hi not clamped to the length, tail masked by the length",
         "hi = tl.minimum(lo + CHUNK, n_b)", "hi = lo + CHUNK"),
        ("partial o_s rounded to the input dtype",
         "tl.store(o_part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])",
         "tl.store(o_part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o.to(q.dtype), mask=row_ok[:, None])"),
        ("acc rounded to the input dtype once, before _finish", "o, lse = _finish(acc, m_i, l_i)",
         "o, lse = _finish(acc.to(q.dtype).to(tl.float32), m_i, l_i)"),
        ("H_kv fixed at 8 in the SM fill", "fill = -(-n_sms // (batch * n_kv_heads))", "fill = -(-n_sms // (batch * 8))"),
        ("block fixed at 64 in the cap", "blocks = -(-max_len // block_n)", "blocks = -(-max_len // 64)"),
        ("key block fixed at the interpreter's 16", "offs_n = start + tl.arange(0, BLOCK_N)", "offs_n = start + tl.arange(0, 16)"),
        ("query rows fixed at 16 (B_G of every g <= 16)", "offs_g = tl.arange(0, BLOCK_G)", "offs_g = tl.arange(0, 16)"),
        ("lengths handed to the kernel as they come (a strided view read as contiguous)",
         "seqlens.to(torch.int32).contiguous(),", "seqlens.to(torch.int32),"),
        ("q scaled in place on the host (the caller's q changed)",
         "q.contiguous(), k.contiguous(), v.contiguous(), seqlens.to(torch.int32).contiguous(),\n"
         "                                        o_part, lse_part, d ** -0.5 * LOG2E,",
         "q.mul_(d ** -0.5 * LOG2E).contiguous(), k.contiguous(), v.contiguous(), seqlens.to(torch.int32).contiguous(),\n"
         "                                        o_part, lse_part, 1.0,"),
    ],
    "ex4_combine_kernel": [
        ("plain average of the partials", "w = tl.exp(lse_s - shift)",
         'w = tl.where(valid & (lse_s > float("-inf")), 1.0, 0.0)'),
        ("exp of lse without the max (overflow)", 'shift = tl.where(m == float("-inf"), 0.0, m)', "shift = 0.0"),
        ("-inf - -inf trap", 'shift = tl.where(m == float("-inf"), 0.0, m)', "shift = m"),
        ("lse = the max only", 'lse = tl.where(empty, float("-inf"), shift + tl.log(tl.where(empty, 1.0, total)))', "lse = m"),
        ("padding splits read as 0 instead of -inf", 'mask=valid, other=float("-inf"))', "mask=valid, other=0.0)"),
        ("partials rounded to o's dtype before the weighted sum", "o = tl.sum(w[:, None] * o_s, 0)",
         "o = tl.sum(w[:, None] * o_s.to(o_ptr.dtype.element_ty), 0)"),
        ("weights rounded to o's dtype", "o = tl.sum(w[:, None] * o_s, 0)",
         "o = tl.sum(w.to(o_ptr.dtype.element_ty)[:, None] * o_s, 0)"),
        ("o_s loaded without the split mask (BLOCK_S padding read)", "mask=valid[:, None],\n                  other=0.0)", ")"),
        ("lse rounded to o's dtype before its fp32 store", "tl.store(lse_ptr + r, lse)",
         "tl.store(lse_ptr + r, lse.to(o_ptr.dtype.element_ty))"),
        ("head dim fixed at 16", "offs_d = tl.arange(0, HEAD_DIM)", "offs_d = tl.arange(0, 16)"),
        ("BLOCK_S fixed at 4 (every visible S was <= 4)", "offs_s = tl.arange(0, BLOCK_S)", "offs_s = tl.arange(0, 4)"),
        ("partials handed to the kernel as they come (a view read as contiguous)",
         "_combine_kernel[(b * hq,)](o_part.contiguous(), lse_part.contiguous(),", "_combine_kernel[(b * hq,)](o_part, lse_part,"),
    ],
    "ex5_page_allocator": [
        ("a page too many at the boundary", "need = -(-(length + n) // self.page_size) - len(pages)",
         "need = (length + n) // self.page_size + 1 - len(pages)"),
        ("state changed before MemoryError", "        if need > len(self._free):\n",
         "        self._length[seq] = length + n\n        if need > len(self._free):\n"),
        ("contiguous slots assumed",
         "return torch.tensor(pages, dtype=torch.int64)[t // self.page_size] * self.page_size + t % self.page_size",
         "return t"),
        ("pages not returned on free", "self._free.extend(reversed(pages))", "pass"),
        ("RuntimeError instead of MemoryError", "raise MemoryError(", "raise RuntimeError("),
        ("MemoryError that does not say how many pages",
         'raise MemoryError(f"sequence {seq!r} needs {need} more pages for {n} tokens; {len(self._free)} are free")',
         'raise MemoryError("out of pages")'),
        ("sequence not forgotten on free", "        del self._length[seq]\n", ""),
        ("last page partly filled before MemoryError", "        if need > len(self._free):\n",
         "        if seq in self._length:                                # fill the last page's room first\n"
         "            self._length[seq] = min(length + n, len(pages) * self.page_size)\n"
         "        if need > len(self._free):\n"),
        ("pages handed out by a counter of pages in use (an out-of-order free hands out a page in use)",
         "pages = pages + [self._free.pop() for _ in range(need)]",
         "pages = pages + [self.num_pages - len(self._free) + i for i in range(need)]\n"
         "        del self._free[len(self._free) - need:]"),
        ("page size fixed at 4", "need = -(-(length + n) // self.page_size) - len(pages)", "need = -(-(length + n) // 4) - len(pages)"),
    ],
    "ex6_paged_kernel": [
        ("page table ignored (pages assumed in order)",
         "page = tl.load(table_ptr + b * MAX_PAGES + start // PAGE_SIZE).to(tl.int64)",
         "page = (b * MAX_PAGES + start // PAGE_SIZE).to(tl.int64)"),
        ("page-table row stride forgotten", "table_ptr + b * MAX_PAGES + start // PAGE_SIZE", "table_ptr + start // PAGE_SIZE"),
        ("last page not masked by the length", "inside = start + offs_p < hi", "inside = start + offs_p < lo + CHUNK"),
        ("K/V head offset missing", " + j * HEAD_DIM + offs_d[None, :]", " + offs_d[None, :]"),
        ("page offset not scaled by the page size", "(page * PAGE_SIZE + offs_p)", "(page + offs_p)"),
        ("partials stored without the row mask", "o, mask=row_ok[:, None])", "o)"),
        ("page id not widened to 64 bits", "start // PAGE_SIZE).to(tl.int64)", "start // PAGE_SIZE)"),
        ("loop bounded by the chunk, not the length", "for start in range(lo, hi, PAGE_SIZE):",
         "for start in range(lo, lo + CHUNK, PAGE_SIZE):"),
        ("each split loops on to the sequence's length", "for start in range(lo, hi, PAGE_SIZE):",
         "for start in range(lo, n_b, PAGE_SIZE):"),
        ("each split loops from page 0, masked down to its own keys",
         "    for start in range(lo, hi, PAGE_SIZE):                                 # one page per step\n"
         "        page = tl.load(table_ptr + b * MAX_PAGES + start // PAGE_SIZE).to(tl.int64)\n        inside = start + offs_p < hi\n",
         "    for start in range(0, hi, PAGE_SIZE):\n"
         "        page = tl.load(table_ptr + b * MAX_PAGES + start // PAGE_SIZE).to(tl.int64)\n"
         "        inside = (start + offs_p >= lo) & (start + offs_p < hi)\n"),
        ("each split loops over the whole sequence, masked down to its own keys",
         "    for start in range(lo, hi, PAGE_SIZE):                                 # one page per step\n"
         "        page = tl.load(table_ptr + b * MAX_PAGES + start // PAGE_SIZE).to(tl.int64)\n        inside = start + offs_p < hi\n",
         "    for start in range(0, n_b, PAGE_SIZE):\n"
         "        page = tl.load(table_ptr + b * MAX_PAGES + start // PAGE_SIZE).to(tl.int64)\n"
         "        inside = (start + offs_p >= lo) & (start + offs_p < hi)\n"),
        ("page size and head size mixed", "offs_p = tl.arange(0, PAGE_SIZE)", "offs_p = tl.arange(0, HEAD_DIM)"),
        ("acc rounded to the input dtype every page", "        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, inside[None, :], qk_scale, PREC)\n    o, lse = _finish(acc, m_i, l_i)\n", "        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, inside[None, :], qk_scale, PREC)\n        acc = acc.to(k.dtype).to(tl.float32)\n    o, lse = _finish(acc, m_i, l_i)\n"),
        ("running max initialised to 0", 'm_i = tl.full([BLOCK_G], float("-inf"), tl.float32)', "m_i = tl.zeros([BLOCK_G], tl.float32)"),
        ("K/V token stride without H_KV", "(page * PAGE_SIZE + offs_p)[:, None] * (H_KV * HEAD_DIM)",
         "(page * PAGE_SIZE + offs_p)[:, None] * HEAD_DIM"),
        ("partial o_s rounded to the input dtype",
         "tl.store(o_part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])",
         "tl.store(o_part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o.to(q.dtype), mask=row_ok[:, None])"),
        ("partial lse_s rounded to the input dtype", "tl.store(lse_part_ptr + part, lse, mask=row_ok)",
         "tl.store(lse_part_ptr + part, lse.to(q.dtype), mask=row_ok)"),
        ("query rows fixed at 16 (B_G of every g <= 16)", "offs_g = tl.arange(0, BLOCK_G)", "offs_g = tl.arange(0, 16)"),
        ("K/V pages handed to the kernel as they come (a view of the pool read as contiguous)",
         "k_pages.contiguous(), v_pages.contiguous(),", "k_pages, v_pages,"),
        ("K pages scaled in place on the host (the caller's cache changed)",
         "k_pages.contiguous(), v_pages.contiguous(), block_table.to(torch.int32).contiguous(),\n"
         "        seqlens.to(torch.int32).contiguous(),\n        o_part, lse_part, d ** -0.5 * LOG2E,",
         "k_pages.mul_(d ** -0.5 * LOG2E).contiguous(), v_pages.contiguous(), block_table.to(torch.int32).contiguous(),\n"
         "        seqlens.to(torch.int32).contiguous(),\n        o_part, lse_part, 1.0,"),
    ],
}

# (grade_id, mistake) -> why no visible check can catch it (at most one per notebook)
HIDDEN_ONLY = {}

# grade_id -> [(name, text in the answer, replacement)]: pass the visible tests, fail the hidden ones
FITTED = {
    "ex1_kv_calculator": [("table of the visible configurations",
                           "return 2 * layers * n_kv_heads * head_dim * bytes_per_element",
                           "return {(12, 12, 64, 2): 36864, (1, 1, 1, 1): 2, (32, 1, 1, 1): 64, (32, 8, 128, 2): 131072,\n"
                           "            (1, 1, 1, 4): 8, (32, 8, 128, 1): 65536, (32, 8, 128, 4): 262144}"
                           "[layers, n_kv_heads, head_dim, bytes_per_element]")],
    "ex2_decode_kernel": [("head dim fixed at the visible 16 and 32", "offs_d = tl.arange(0, HEAD_DIM)",
                           "offs_d = tl.arange(0, 32 if HEAD_DIM == 32 else 16)")],
    "ex3_split_kernel": [("table of the visible split counts", "return max(1, min(fill, blocks))",
                          "return {(1, 8, 4096, 132): 17, (1, 8, 4096, 128): 16, (16, 8, 4096, 132): 2, (4, 8, 4096, 132): 5,\n"
                          "            (32, 8, 4096, 132): 1, (1, 8, 100, 132): 2, (1, 8, 1024, 132): 16, (1, 8, 0, 132): 1,\n"
                          "            (2, 4, 4096, 132): 17, (1, 8, 300, 132): 3}[batch, n_kv_heads, max_len, n_sms]")],
    "ex4_combine_kernel": [("head dim fixed at the visible 16 and 32", "offs_d = tl.arange(0, HEAD_DIM)",
                            "offs_d = tl.arange(0, 32 if HEAD_DIM == 32 else 16)")],
    "ex5_page_allocator": [("page size fixed at the visible 3 and 4", "need = -(-(length + n) // self.page_size) - len(pages)",
                            "need = -(-(length + n) // (3 if self.page_size == 3 else 4)) - len(pages)")],
    "ex6_paged_kernel": [("head dim fixed at the visible 16 and 32", "offs_d = tl.arange(0, HEAD_DIM)",
                          "offs_d = tl.arange(0, 32 if HEAD_DIM == 32 else 16)")],
}

# grade_id -> [(name, text in the answer, replacement)]: right answers written another way the prose allows: must pass
ACCEPTED = {
    "ex1_kv_calculator": [("negative budget clamped before the division",
                           "return max(0, int(free_bytes // (batch * kv_bytes_per_token(layers, n_kv_heads, head_dim, bytes_per_element))))",
                           "return int(max(0, free_bytes) // (batch * kv_bytes_per_token(layers, n_kv_heads, head_dim, bytes_per_element)))")],
}

# A key tile loaded past the cache's end: the extra scores are masked afterwards, so the values stay right; the visible
# tests run the kernels under lk.tritonbounds.outside_accesses.
RULES["ex2_decode_kernel"] += ["no load or store outside the tensors handed to the kernel (lk.tritonbounds), in every run of the staged tests"]
RULES["ex3_split_kernel"] += ["no load or store outside the tensors handed to the kernel (lk.tritonbounds), in every run of the staged tests"]
MISTAKES["ex2_decode_kernel"] += [
    ("K of the last tile loaded past N", "k = tl.load(k_ptr + kv_rows, mask=inside[:, None], other=0.0)",
     "k = tl.load(k_ptr + kv_rows)"),
]
MISTAKES["ex3_split_kernel"] += [
    ("K of a split's last tile loaded past its end", "k = tl.load(k_ptr + kv_rows, mask=inside[:, None], other=0.0)",
     "k = tl.load(k_ptr + kv_rows)"),
]
