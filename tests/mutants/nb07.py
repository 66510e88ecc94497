"""Notebook 07 (07_context_parallel): rules its exercises state, wrong answers, answers fitted to visible cases."""

ASSIGNMENT = "07_context_parallel"
SETUP = ['P = lk.profiles.choose(']

# grade_id -> the rules its visible tests check
RULES = {'ex1_merge': ['o and lse equal attention over all keys (even and uneven split)',
               'lse near +1e4 and -1e4: no overflow or underflow (exp only of lse differences)',
               'rows with no visible key on either side: o = 0, lse = -inf, no NaN',
               'rows with keys on one side only: that side\'s o and lse',
               "o in o1's dtype (also when o2's differs: bf16 with fp32, both ways); lse float64 for float64 inputs, fp32 "
               "for bf16 o (never o's dtype)",
               'bf16 and fp16 partials: lse within 2x of the CPU flash kernel\'s error (fp32 statistics), o rounded once',
               'the contract: inputs unchanged, views give the contiguous answer, no state between merges of other '
               'partials, tensors made follow the inputs\' device (meta)',
               'no labkit in the answer'],
 'ex2_zigzag': ['a list of P lists of two chunk indices',
                'chunk indices are Python ints',
                'chunks 0..2P-1 each on exactly one device',
                'device i holds chunks i and 2P-1-i (P = 1, 2, 3, 4)'],
 'ex3_causal_work': ['all chunks together give the causal triangle N(N+1)/2',
                     'non-adjacent chunks, each counted by its own index (vs enumeration)',
                     'returns a Python int']}

# grade_id -> [(mistake, text in the answer, replacement)]: each fails a visible test
MISTAKES = {'ex1_merge': [('plain average, no rescale',
                'o = w1 * o1.to(acc) + w2 * o2.to(acc)',
                'o = 0.5 * (o1.to(acc) + o2.to(acc))'),
               ('weights swapped',
                'o = w1 * o1.to(acc) + w2 * o2.to(acc)',
                'o = w2 * o1.to(acc) + w1 * o2.to(acc)'),
               ('max instead of logaddexp',
                'lse = torch.logaddexp(lse1, lse2)',
                'lse = torch.maximum(lse1, lse2)'),
               ('exp of lse overflows',
                'lse = torch.logaddexp(lse1, lse2)',
                'lse = torch.log(torch.exp(lse1) + torch.exp(lse2))'),
               ('-inf - -inf trap',
                'shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)',
                'shift = lse'),
               ("lse in o's dtype", 'return o.to(o1.dtype), lse', 'return o.to(o1.dtype), lse.to(o1.dtype)'),
               ("o not cast back to o1's dtype", 'return o.to(o1.dtype), lse', 'return o, lse'),
               ("accumulation in o's dtype",
                'acc = torch.promote_types(torch.promote_types(lse1.dtype, o1.dtype), torch.float32)',
                'acc = o1.dtype'),
               ("merge computed in o's dtype (bf16), lse handed back as fp32",
                'acc = torch.promote_types(torch.promote_types(lse1.dtype, o1.dtype), torch.float32)\n'
                '    lse1, lse2 = lse1.to(acc), lse2.to(acc)\n'
                '    lse = torch.logaddexp(lse1, lse2)',
                'acc = o1.dtype\n'
                '    lse1, lse2 = lse1.to(acc), lse2.to(acc)\n'
                '    lse = torch.logaddexp(lse1, lse2).to(torch.promote_types(lse1.dtype, torch.float32))'),
               ("weighted sum of o in o's dtype (weights cast down)",
                'o = w1 * o1.to(acc) + w2 * o2.to(acc)',
                'o = w1.to(o1.dtype) * o1 + w2.to(o1.dtype) * o2'),
               ("o returned in o2's dtype", 'return o.to(o1.dtype), lse', 'return o.to(o2.dtype), lse'),
               ('o in the promoted dtype of o1 and o2', 'return o.to(o1.dtype), lse',
                'return o.to(torch.promote_types(o1.dtype, o2.dtype)), lse')],
 'ex2_zigzag': [('round-robin instead of head-tail',
                 '[[i, 2 * P - 1 - i] for i in range(P)]',
                 '[[i, i + P] for i in range(P)]'),
                ('tail off by one',
                 '[[i, 2 * P - 1 - i] for i in range(P)]',
                 '[[i, 2 * P - i] for i in range(P)]'),
                ('tail hard-coded from P = 2',
                 '[[i, 2 * P - 1 - i] for i in range(P)]',
                 '[[i, 3 - i] for i in range(P)]'),
                ('0-d tensors as chunk indices',
                 '[[i, 2 * P - 1 - i] for i in range(P)]',
                 '[[torch.tensor(i), torch.tensor(2 * P - 1 - i)] for i in range(P)]'),
                ('tuples instead of lists',
                 '[[i, 2 * P - 1 - i] for i in range(P)]',
                 '[(i, 2 * P - 1 - i) for i in range(P)]')],
 'ex3_causal_work': [('diagonal block counted whole', 'c * m * m + m * (m + 1) // 2', '(c + 1) * m * m'),
                     ('diagonal itself left out', 'm * (m + 1) // 2', 'm * (m - 1) // 2'),
                     ('true division: a float', 'm * (m + 1) // 2', 'm * (m + 1) / 2'),
                     ('chunk index ignored', 'for c in chunks)', 'for c in range(len(chunks)))'),
                     ('only the first chunk counted', 'for c in chunks)', 'for c in chunks[:1])')]}

MISTAKES["ex1_merge"] += [
    ("always fp32 (float64 inputs computed in fp32)",
     "acc = torch.promote_types(torch.promote_types(lse1.dtype, o1.dtype), torch.float32)", "acc = torch.float32"),
    ("renormalized by w1 + w2 (0/0 on empty rows)", "o = w1 * o1.to(acc) + w2 * o2.to(acc)",
     "o = (w1 * o1.to(acc) + w2 * o2.to(acc)) / (w1 + w2)"),
    ("-inf guard keyed on lse2", "shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)",
     "shift = torch.where(torch.isneginf(lse2), torch.zeros_like(lse), lse)"),
    ("shift clamped at 0", "shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)", "shift = lse.clamp(min=0)"),
    ("caller's lse1 shifted in place (.to(float64) does not copy)", "w1 = torch.exp(lse1 - shift)[..., None]",
     "w1 = torch.exp(lse1.sub_(shift))[..., None]"),
    ("o1 flattened with .view (fails on a transposed view)", "o = w1 * o1.to(acc) + w2 * o2.to(acc)",
     "o = (w1.reshape(-1, 1) * o1.to(acc).view(-1, o1.shape[-1])).view(o1.shape) + w2 * o2.to(acc)"),
    ("zero shift made on the default device", "torch.zeros_like(lse)", "torch.zeros(lse.shape, dtype=lse.dtype)"),
]
MISTAKES["ex2_zigzag"] += [
    ("pair order swapped within a device", "[[i, 2 * P - 1 - i] for i in range(P)]", "[[2 * P - 1 - i, i] for i in range(P)]"),
    ("devices in reverse order", "[[i, 2 * P - 1 - i] for i in range(P)]",
     "[[i, 2 * P - 1 - i] for i in reversed(range(P))]"),
    ("one flat list", "[[i, 2 * P - 1 - i] for i in range(P)]", "[c for i in range(P) for c in (i, 2 * P - 1 - i)]"),
]
MISTAKES["ex3_causal_work"] += [
    ("diagonal block counted as half (m * m // 2)", "m * (m + 1) // 2", "m * m // 2"),
    ("chunk index off by one", "c * m * m + m * (m + 1) // 2", "(c + 1) * m * m + m * (m + 1) // 2"),
    ("diagonal added once per device", "sum(c * m * m + m * (m + 1) // 2 for c in chunks)",
     "sum(c * m * m for c in chunks) + m * (m + 1) // 2"),
    ("chunks assumed adjacent", "for c in chunks)", "for c in range(min(chunks), max(chunks) + 1))"),
]

# (grade_id, mistake) -> why no visible check can catch it (at most one per notebook)
HIDDEN_ONLY = {}

# grade_id -> [(name, text in the answer, replacement)]: pass the visible tests, fail the hidden ones
FITTED = {'ex1_merge': [('-inf guard on lse1 only (the visible empty side is the second)',
                'shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)',
                'shift = torch.where(torch.isneginf(lse1), torch.zeros_like(lse), lse)')],
 'ex2_zigzag': [('table of the visible P',
                 'return [[i, 2 * P - 1 - i] for i in range(P)]',
                 'return {1: [[0, 1]], 2: [[0, 3], [1, 2]], 3: [[0, 5], [1, 4], [2, 3]], 4: [[0, 7], [1, 6], [2, 5], [3, 4]]}[P]')],
 'ex3_causal_work': [('table of the visible cases',
                      'return sum(c * m * m + m * (m + 1) // 2 for c in chunks)',
                      'return {((0, 1, 2, 3), 8): 528, ((0, 1), 3): 21, ((1, 6), 3): 75, ((2,), 5): 65,\n'
                      '            ((3, 4), 2): 34}[tuple(chunks), m]')]}
