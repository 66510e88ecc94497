"""Notebook 04 (04_performance_analysis): rules its exercises state, wrong answers, answers fitted to visible cases."""

ASSIGNMENT = "04_performance_analysis"
SETUP = ['P = lk.profiles.choose(', 'ridge = peak_tflops', 'sweep = lk.predictor.time_grid(']

# grade_id -> the rules its visible tests check
RULES = {
    "ex1_phase_counts": [
        "dict of (flop, bytes) for QK^T, softmax, PV",
        "matmul 2·N²·d and softmax 5·N² FLOPs, times B·H",
        "bytes: every tensor each phase reads and writes",
        "bytes follow elem_bytes (bf16 and fp32 cases)",
        "no labkit",
    ],
    "ex2_flash_bytes": [
        "bytes = s·(2Nd + 2Nd·T_r) + 4N per head, times B·H",
        "T_r rounds up (N not a multiple of block_m), and an exact odd quotient adds no tile (N = 384, block_m = 128)",
        "log-sum-exp counted in fp32 whatever elem_bytes",
        "intensity = flop / nbytes",
        "ValueError for nbytes = 0 and nbytes < 0",
        "flop = 0 is valid: intensity 0, no error",
        "no labkit",
    ],
    "ex3_roofline": [
        "roof = min(peak, I·bandwidth/1e12) in TFLOP/s",
        "elementwise on numpy arrays and pandas Series",
        "bandwidth multiplies the intensity before the min (a 2 TB/s machine)",
        "returns a numpy array (a number for a number), not a torch tensor, a list or a Series (the roofline cell compares it with a Series)",
        "intensities that are not whole numbers (I = 2.5)",
        "'memory' below the ridge peak/bandwidth, 'compute' at and above it (a 1 TB/s and a 1.5 TB/s machine)",
        "no labkit",
    ],
    "ex4_predictor": [
        "design matrix columns and causal factor 0.5 on the first two; a GPU-sized row (4BHN^2d ~ 3.5e13) without int32 overflow",
        "design_matrix leaves the caller's df unchanged (no column added); fit_time_model leaves X and y unchanged",
        "exact data: fit reproduces y and the coefficients",
        "noisy data over three decades: the fit reaches the least relative squared error",
        "MAPE in percent over |true|, for lists, arrays and Series",
        "MAPE is the mean, not the median (three values)",
        "MAPE of a numpy prediction against a Series whose index is not 0..n-1 (no index alignment)",
        "no labkit",
    ],
}

# grade_id -> [(mistake, text in the answer, replacement)]: each fails a visible test
MISTAKES = {
    "ex1_phase_counts": [
        ("softmax FLOPs", '"softmax": (5 * bh * nn,', '"softmax": (3 * bh * nn,'),
        ("bf16 bytes hard-coded", "elem_bytes * bh * 2 * nn", "2 * bh * 2 * nn"),
        ("Q and K reads forgotten", "elem_bytes * bh * (2 * N * D + nn)", "elem_bytes * bh * nn"),
        ("matmul counted as N²d (no multiply-add factor 2)", '"QK^T": (2 * bh * nn * D,', '"QK^T": (bh * nn * D,'),
        ("per head only (B·H forgotten)", "bh, nn = B * H, N * N", "bh, nn = 1, N * N"),
        ("softmax bytes: only the write of P", "elem_bytes * bh * 2 * nn", "elem_bytes * bh * nn"),
        ("PV bytes: V read forgotten", "elem_bytes * bh * (nn + 2 * N * D)", "elem_bytes * bh * (nn + N * D)"),
    ],
    "ex2_flash_bytes": [
        ("floor tile count", "tiles = math.ceil(N / block_m)", "tiles = N // block_m"),
        ("tile count N // block_m + 1", "tiles = math.ceil(N / block_m)", "tiles = N // block_m + 1"),
        ("LSE forgotten", " + 4 * B * H * N", ""),
        ("LSE counted in elem_bytes", " + 4 * B * H * N", " + elem_bytes * B * H * N"),
        ("K and V read once (tiles ignored)", "2 * N * D * tiles", "2 * N * D"),
        ("block_m ignored (128 hard-coded)", "math.ceil(N / block_m)", "math.ceil(N / 128)"),
        ("zero bytes accepted", "if nbytes <= 0:", "if False:"),
        ("only zero rejected", "if nbytes <= 0:", "if nbytes == 0:"),
        ("integer division", "return flop / nbytes", "return flop // nbytes"),
        ("flop = 0 rejected too", "if nbytes <= 0:", "if nbytes <= 0 or flop <= 0:"),
    ],
    "ex3_roofline": [
        ("scalar min", "np.minimum(peak_tflops,", "min(peak_tflops,"),
        ("ridge point counted as memory", "intensity < peak_tflops", "intensity <= peak_tflops"),
        ("bytes/s not converted", "* bandwidth / 1e12)", "* bandwidth)"),
        ("maximum instead of minimum", "np.minimum(", "np.maximum("),
        ("bandwidth hard-coded to the toy machine's 1 TB/s", "* bandwidth / 1e12)", "* 1.0)"),
        ("min taken before multiplying by the bandwidth",
         "np.minimum(peak_tflops, np.asarray(intensity, dtype=float) * bandwidth / 1e12)",
         "np.minimum(peak_tflops, np.asarray(intensity, dtype=float)) * bandwidth / 1e12"),
        ("ridge inverted (bandwidth / peak)", "peak_tflops * 1e12 / bandwidth", "bandwidth / (peak_tflops * 1e12)"),
        ("ridge mixes TFLOP/s and bytes/s", "peak_tflops * 1e12 / bandwidth", "peak_tflops / bandwidth"),
        ("torch tensor returned (torch.minimum)", "np.minimum(peak_tflops, np.asarray(intensity, dtype=float) * bandwidth / 1e12)",
         "torch.minimum(torch.tensor(peak_tflops), torch.as_tensor(np.asarray(intensity, dtype=float)) * bandwidth / 1e12)"),
        ("torch tensor returned (torch.clamp)", "np.minimum(peak_tflops, np.asarray(intensity, dtype=float) * bandwidth / 1e12)",
         "torch.clamp(torch.as_tensor(np.asarray(intensity, dtype=float)) * bandwidth / 1e12, max=peak_tflops)"),
        ("list returned", "return np.minimum(peak_tflops, np.asarray(intensity, dtype=float) * bandwidth / 1e12)",
         "return [min(peak_tflops, x * bandwidth / 1e12) for x in np.atleast_1d(intensity)]"),
    ],
    "ex4_predictor": [
        ("causal factor ignored", 'np.where(df["causal"].to_numpy(dtype=bool), 0.5, 1.0)', "np.ones(len(df))"),
        ("causal factor on the Q,K,V,O column", "B * H * N * D, np.ones_like(B)", "B * H * N * D * c, np.ones_like(B)"),
        ("plain least squares",
         "np.linalg.lstsq(A / scale, np.ones(len(y)), rcond=None)[0] / scale",
         "np.linalg.lstsq(X, y, rcond=None)[0]"),
        ("column scaling not undone", "rcond=None)[0] / scale", "rcond=None)[0]"),
        ("signed denominator", "np.abs(pred - true) / np.abs(true)", "np.abs(pred - true) / true"),
        ("fraction, not percent", "float(100 * np.mean(", "float(np.mean("),
        ("lists not converted", "pred, true = np.asarray(pred, dtype=float), np.asarray(true, dtype=float)", "pred, true = pred, true"),
        ("median instead of mean", "np.mean(", "np.median("),
        ("Series kept (index alignment)",
         "pred, true = np.asarray(pred, dtype=float), np.asarray(true, dtype=float)",
         "pred, true = pd.Series(pred, dtype=float), pd.Series(true, dtype=float)"),
    ],
}

MISTAKES["ex2_flash_bytes"] += [("ceil written as round(N / block_m + 0.5)", "math.ceil(N / block_m)", "round(N / block_m + 0.5)")]
MISTAKES["ex3_roofline"] += [
    ("a Series returned (np.asarray dropped)", "np.asarray(intensity, dtype=float) * bandwidth / 1e12", "intensity * bandwidth / 1e12"),
    ("intensity cast to int", "np.asarray(intensity, dtype=float)", "np.asarray(intensity, dtype=int)"),
    ("ridge = peak (bandwidth taken as 1 TB/s)", "intensity < peak_tflops * 1e12 / bandwidth", "intensity < peak_tflops"),
    ("ridge = peak x bandwidth", "peak_tflops * 1e12 / bandwidth", "peak_tflops * bandwidth / 1e12"),
    ("ridge hard-coded to the toy machine's 100", "intensity < peak_tflops * 1e12 / bandwidth", "intensity < 100"),
]
MISTAKES["ex4_predictor"] += [
    ("int32 columns (overflow)", "df[k].to_numpy(dtype=float)", "df[k].to_numpy(dtype=np.int32)"),
    ("causal factor added as a column of the caller's df", 'c = np.where(df["causal"].to_numpy(dtype=bool), 0.5, 1.0)',
     'df["c"] = np.where(df["causal"].to_numpy(dtype=bool), 0.5, 1.0)\n    c = df["c"].to_numpy()'),
    ("X divided by y in place (the caller's array)", "A = X / y[:, None]", "X /= y[:, None]\n    A = X"),
]
MISTAKES["ex2_flash_bytes"] += [("elem_bytes ignored (bf16's 2 hard-coded)", "return elem_bytes * B * H", "return 2 * B * H")]

# (grade_id, mistake) -> why no visible check can catch it (at most one per notebook)
HIDDEN_ONLY = {}

# grade_id -> [(name, text in the answer, replacement)]: pass the visible tests, fail the hidden ones
FITTED = {
    "ex1_phase_counts": [("B·H hard-coded to the visible 8", "bh, nn = B * H, N * N", "bh, nn = 8, N * N")],
    "ex2_flash_bytes": [("ceil written as (N + 63) // block_m (visible block 64)", "math.ceil(N / block_m)", "(N + 63) // block_m"),
                        ("ceil only for the visible block sizes 64 and 128", "tiles = math.ceil(N / block_m)",
                         "tiles = math.ceil(N / block_m) if block_m in (64, 128) else N // block_m")],
    "ex3_roofline": [("ridge right only for the visible 1 and 1.5 TB/s machines", "intensity < peak_tflops * 1e12 / bandwidth",
                      "intensity < (peak_tflops * 1e12 / bandwidth if bandwidth in (1e12, 1.5e12) else peak_tflops)")],
    "ex4_predictor": [("columns taken by position (every visible frame starts with B, H, N, D)",
                       'B, H, N, D = (df[k].to_numpy(dtype=float) for k in "BHND")',
                       "B, H, N, D = (df.iloc[:, i].to_numpy(dtype=float) for i in range(4))")],
}
