"""Tests for labkit.decoding.decode: bytes counted, SDPA's decode sweep, the page table, K/V writes, paged generation."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from labkit.decoding import decode, readbw


class ListAllocator:
    """A minimal page allocator for the tests (the notebook's exercise is the students' own)."""

    def __init__(self, num_pages: int, page_size: int, order: list[int] | None = None):
        self.page_size = page_size
        self.free_pages = list(order if order is not None else range(num_pages))
        self.table: dict = {}
        self.lengths: dict = {}

    def append(self, seq, n):
        pages, length = self.table.setdefault(seq, []), self.lengths.get(seq, 0)
        while len(pages) * self.page_size < length + n:
            pages.append(self.free_pages.pop(0))
        self.lengths[seq] = length + n
        t = torch.arange(length, length + n)
        return torch.tensor(pages)[t // self.page_size] * self.page_size + t % self.page_size

    def pages(self, seq):
        return list(self.table[seq])

    def length(self, seq):
        return self.lengths[seq]

    def free(self, seq):
        self.free_pages += self.table.pop(seq)
        del self.lengths[seq]


def paged_reference(q, k_pages, v_pages, table, lens):
    """Attention through the page table in float64, K/V repeated per group: every page of the table gathered,
    keys past a sequence's length masked. No host sync, so a CUDA graph can capture it.
    q [B, H_q, d]; pages [num_pages, page_size, H_kv, d]; table [B, P]; lens [B] -> o [B, H_q, d] in q's dtype."""
    b, hq, d = q.shape
    hkv = k_pages.shape[2]
    k, v = (pages.double()[table.long()].reshape(b, -1, hkv, d).repeat_interleave(hq // hkv, dim=2)
            for pages in (k_pages, v_pages))                                             # [B, P * page, H_q, d]
    keep = torch.arange(k.shape[1], device=q.device)[None, :] < lens.to(q.device)[:, None]   # [B, N]
    s = torch.einsum("bhd,bnhd->bhn", q.double(), k) / math.sqrt(d)
    p = torch.softmax(s.masked_fill(~keep[:, None], float("-inf")), dim=-1)
    return torch.einsum("bhn,bnhd->bhd", p, v).to(q.dtype)


def test_tensor_bytes_counts_elements_times_size():
    assert decode.tensor_bytes(torch.zeros(3, 4), torch.zeros(5, dtype=torch.bfloat16)) == 3 * 4 * 4 + 5 * 2
    assert decode.tensor_bytes() == 0


def test_page_table_pads_with_zero_and_checks_width():
    table = decode.page_table([[5, 2], [], [7]])
    assert table.dtype == torch.int32 and table.tolist() == [[5, 2], [0, 0], [7, 0]]
    assert decode.page_table([[1]], width=3).tolist() == [[1, 0, 0]]
    assert decode.page_table([[], []]).shape == (2, 1)
    with pytest.raises(ValueError, match="width"):
        decode.page_table([[1, 2, 3]], width=2)


def test_write_kv_scatters_tokens_to_their_slots():
    k_pages, v_pages = torch.zeros(3, 2, 1, 4), torch.zeros(3, 2, 1, 4)
    k, v = torch.randn(3, 1, 4), torch.randn(3, 1, 4)
    decode.write_kv(k_pages, v_pages, torch.tensor([5, 0, 3]), k, v)   # page 2 row 1, page 0 row 0, page 1 row 1
    assert torch.equal(k_pages[2, 1], k[0]) and torch.equal(k_pages[0, 0], k[1]) and torch.equal(v_pages[1, 1], v[2])
    assert int((k_pages != 0).any(-1).sum()) == 3
    with pytest.raises(ValueError, match="slots"):
        decode.write_kv(k_pages, v_pages, torch.tensor([0, 1]), k, v)


def test_sdpa_decode_sweep_on_cpu_reports_ok_and_unsupported_backends():
    df = decode.sdpa_decode_sweep([64], [1, 2], h_q=4, h_kv=2, d=16, dtype=torch.float32, device="cpu", target_ms=1)
    names = set(decode.SDPA_DECODE_BACKENDS) | {decode.READ_ONLY}
    assert set(df["backend"]) == names and len(df) == 2 * len(names)
    assert (df["calls_per_replay"] == 1).all()                            # one call per timing off a GPU
    math_rows = df[df["backend"] == "sdpa_math"]
    assert (math_rows["status"] == "ok").all() and (math_rows["gb_per_s"] > 0).all()
    # bytes: q and o [B, 4, 1, 16] plus K and V [B, 2, 64, 16], fp32
    assert math_rows["bytes"].tolist() == [4 * (2 * 4 * 16 + 2 * 2 * 64 * 16) * b for b in (1, 2)]
    cudnn = df[df["backend"] == "sdpa_cudnn"]
    assert (cudnn["status"] != "ok").all() and cudnn["gb_per_s"].isna().all()
    assert (df["timed"] == "eager").all()                                  # no CUDA graphs off a GPU


def test_graphs_are_refused_off_a_gpu():
    with pytest.raises(ValueError, match="CUDA device, not cpu"):
        decode.graphed({"x": lambda: torch.zeros(1)}, "cpu")
    with pytest.raises(ValueError, match="CUDA device, not cpu"):
        decode.sdpa_decode_sweep([16], [1], h_q=2, h_kv=1, d=8, dtype=torch.float32, device="cpu", target_ms=1,
                                 cuda_graph=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_replay_recomputes_from_the_inputs_current_contents_and_a_failing_call_is_reported():
    """A replay reads the captured input tensors again (new contents, new result, written into the captured
    output); a call that cannot run (here SDPA's efficient kernel, which takes no GQA at query length 1)
    comes back as an error, the rest run."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, 64, device="cuda"), torch.randn(2, 96, 2, 64, device="cuda"), torch.randn(2, 96, 2, 64, device="cuda")
    fns = decode.yardsticks(q, k, v, ("sdpa_math",))
    fns["cannot run"] = lambda: decode._sdpa_runner("sdpa_efficient", q[:, :, None].half(), k.transpose(1, 2).half(),
                                                     v.transpose(1, 2).half())()
    fns["two layers"] = [fns["sdpa_math"], decode.read_once(k, v)]       # one graph, the last call's output
    replays, errors = decode.graphed(fns, "cuda")
    assert set(replays) == {"sdpa_math", "two layers"} and set(errors) == {"cannot run"}
    for _ in range(2):
        q.normal_()
        torch.testing.assert_close(replays["sdpa_math"](), fns["sdpa_math"](), rtol=0, atol=0)
        k.normal_()
        torch.testing.assert_close(replays["two layers"](), k.sum() + v.sum(), rtol=1e-4, atol=1e-2)
    df = decode.sdpa_decode_sweep([256], [1], h_q=8, h_kv=2, d=64, dtype=torch.bfloat16, device="cuda", target_ms=2,
                                  fa4=False)
    assert (df["timed"] == "cuda graph").all() and (df.set_index("backend").loc["sdpa_flash", "status"] == "ok")
    assert (df["calls_per_replay"] == decode.LAYERS).all()
    assert df.set_index("backend").loc[decode.READ_ONLY, "status"] == "ok"


def test_yardsticks_compute_the_same_attention_on_cpu_and_name_what_they_take():
    """Each library kernel sees the same problem: SDPA's math backend, given its own bhnd copies, equals float64
    attention on the bnhd cache; FA4 is absent without flash_attn.cute; unknown names are refused."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 24, 2, 16), torch.randn(2, 24, 2, 16)
    fns = decode.yardsticks(q, k, v, ("sdpa_math",))
    assert list(fns) == ["sdpa_math"]
    got = fns["sdpa_math"]()[:, :, 0]                                   # [B, H_q, d]
    table = decode.page_table([[0], [1]])
    want = paged_reference(q.double(), k.reshape(2, 24, 2, 16), v.reshape(2, 24, 2, 16), table, torch.tensor([24, 24]))
    torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=1e-5)   # fp32 softmax and matmuls vs float64
    k[0, 0, 0, 0] = 1e3                                                   # SDPA's copies were made when asked for
    torch.testing.assert_close(fns["sdpa_math"]()[:, :, 0], got)
    try:
        import flash_attn.cute  # noqa: F401
    except Exception:  # noqa: BLE001 - no FA4 here: the yardstick is left out, not an error
        assert "fa4" not in decode.yardsticks(q, k, v, ("fa4",))
    with pytest.raises(ValueError, match="unknown yardsticks"):
        decode.yardsticks(q, k, v, ("sdpa_flash", "triton"))


@pytest.mark.parametrize("capability, expected", [((8, 0), 1), ((9, 0), 1), ((10, 0), 0), ((12, 0), 0)])
def test_fa4_splits_only_where_its_split_kv_path_runs(monkeypatch, capability, expected):
    """flash-attn-4 4.0 asserts "SplitKV not supported on SM 9.0" (and 8.0) for num_splits != 1: there it runs unsplit."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert decode.fa4_num_splits("cuda:0") == expected
    assert decode.fa4_num_splits("cpu") == 1


def test_fa4_paged_is_absent_without_flash_attn_cute():
    try:
        import flash_attn.cute  # noqa: F401
    except Exception:  # noqa: BLE001
        q, pages = torch.randn(1, 4, 16), torch.randn(2, 16, 2, 16)
        assert decode.fa4_paged(q, pages, pages, decode.page_table([[1, 0]]), torch.tensor([20])) is None
    else:
        pytest.skip("flash_attn.cute imports here: the GPU notebook run measures it")


@pytest.fixture(scope="module")
def tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.LlamaForCausalLM(config).eval()


def _pools(model, num_pages, page_size):
    cfg = model.config
    shape = (num_pages, page_size, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)
    return [torch.zeros(shape) for _ in range(2)], [torch.zeros(shape) for _ in range(2)]


@pytest.mark.parametrize("page_size,order", [(4, None), (2, [9, 3, 14, 0, 7, 1, 12, 5, 10, 2, 15, 4, 8, 6, 13, 11])])
def test_generate_paged_matches_transformers_generate(tiny_llama, page_size, order):
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    alloc = ListAllocator(16, page_size, order)
    k_pools, v_pools = _pools(tiny_llama, 16, page_size)
    calls = []

    def attend(q, k_pages, v_pages, table, lens, max_len):
        assert max_len == 5 + 4 and type(max_len) is int              # prompt + new tokens, known on the host
        assert table.shape == (2, -(-max_len // page_size))           # one width for the whole generation
        calls.append((tuple(q.shape), lens.tolist()))
        return paged_reference(q, k_pages, v_pages, table, lens)

    mine = decode.generate_paged(tiny_llama, prompt, 4, allocator=alloc, attend=attend, k_pages=k_pools, v_pages=v_pools)
    theirs = tiny_llama.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    assert torch.equal(mine, theirs)
    assert calls[0] == ((2, 4, 8), [6, 6]) and calls[-1][1] == [8, 8]   # decode steps only: prefill is SDPA
    assert len(calls) == 3 * 2                                          # 3 decode steps x 2 layers
    assert alloc.table == {} and len(alloc.free_pages) == 16            # every page returned


def test_generate_paged_frees_pages_when_attention_fails(tiny_llama):
    prompt = torch.zeros(2, 3, dtype=torch.long)
    alloc = ListAllocator(8, 4)
    k_pools, v_pools = _pools(tiny_llama, 8, 4)

    def broken(*args):
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError, match="kernel failed"):
        decode.generate_paged(tiny_llama, prompt, 3, allocator=alloc, attend=broken, k_pages=k_pools, v_pages=v_pools)
    assert alloc.table == {} and sorted(alloc.free_pages) == list(range(8))


def test_generate_paged_checks_its_arguments(tiny_llama):
    prompt = torch.zeros(1, 3, dtype=torch.long)
    alloc = ListAllocator(4, 4)
    k_pools, v_pools = _pools(tiny_llama, 4, 4)
    kwargs = dict(allocator=alloc, attend=None, k_pages=k_pools, v_pages=v_pools)
    assert torch.equal(decode.generate_paged(tiny_llama, prompt, 0, **kwargs), prompt) and alloc.table == {}
    with pytest.raises(ValueError, match="new_tokens = -1"):
        decode.generate_paged(tiny_llama, prompt, -1, **kwargs)
    with pytest.raises(ValueError, match="CUDA device, not cpu"):
        decode.generate_paged(tiny_llama, prompt, 2, cuda_graph=True, **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_generate_paged_replays_the_same_tokens_from_a_cuda_graph(tiny_llama):
    model = tiny_llama.cuda()
    prompt = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(2)).cuda()
    runs = {}
    for graph in (False, True):
        k_pools, v_pools = ([p.cuda() for p in pools] for pools in _pools(model, 24, 4))
        attend = lambda q, kp, vp, table, lens, max_len: paged_reference(q, kp, vp, table, lens)   # noqa: E731
        runs[graph] = decode.generate_paged(model, prompt, 9, allocator=ListAllocator(24, 4), attend=attend,
                                            k_pages=k_pools, v_pages=v_pools, cuda_graph=graph)
    theirs = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=9, do_sample=False)
    assert torch.equal(runs[False], theirs) and torch.equal(runs[True], theirs)
    model.cpu()


def test_paged_reference_equals_sdpa_on_a_contiguous_cache():
    """The tests' own reference: pages in order hold a contiguous cache; GQA through enable_gqa."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 8, dtype=torch.float64), torch.randn(1, 8, 2, 8), torch.randn(1, 8, 2, 8)
    table = decode.page_table([[0, 1]])
    got = paged_reference(q, k.reshape(2, 4, 2, 8), v.reshape(2, 4, 2, 8), table, torch.tensor([8]))
    want = F.scaled_dot_product_attention(q[:, :, None], k.double().transpose(1, 2), v.double().transpose(1, 2),
                                          enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)   # float64: rounding only


def test_paged_reference_reads_shuffled_pages_up_to_each_length():
    """Sequence 0 holds pages 3, 0, 4 (10 tokens), sequence 1 page 1 (2 tokens, then padding); page 2, in
    neither table row, holds NaN that must not reach the output; keys past each length are masked."""
    torch.manual_seed(1)
    q, k_pages, v_pages = torch.randn(2, 4, 8, dtype=torch.float64), torch.randn(5, 4, 2, 8), torch.randn(5, 4, 2, 8)
    k_pages[2], v_pages[2] = float("nan"), float("nan")
    table, lens = decode.page_table([[3, 0, 4], [1]], width=3), torch.tensor([10, 2])
    got = paged_reference(q, k_pages, v_pages, table, lens)
    for i, pages in enumerate(([3, 0, 4], [1])):
        k, v = (p[pages].reshape(-1, 2, 8)[:int(lens[i])].double().transpose(0, 1)[None] for p in (k_pages, v_pages))
        want = F.scaled_dot_product_attention(q[i, None, :, None], k, v, enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-12)


def test_a_sweep_that_runs_out_of_memory_says_oom(monkeypatch):
    """The math backend's scores at B = 32, N = 64K need 32 GiB on a GPU: the row says "oom", not the allocator's
    whole message."""
    real = decode._sdpa_runner

    def runner(backend, q, k, v):
        if backend != "sdpa_math":
            return real(backend, q, k, v)

        def run():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB. GPU 0 has ...")
        return run

    monkeypatch.setattr(decode, "_sdpa_runner", runner)
    df = decode.sdpa_decode_sweep([16], [1], h_q=2, h_kv=1, d=8, dtype=torch.float32, device="cpu", target_ms=1)
    assert df.set_index("backend").loc["sdpa_math", "status"] == "oom"


def test_read_once_reads_every_element_and_refuses_what_it_cannot_stream():
    """The limit's kernel sums each tensor whole: its result equals torch's sum (CPU path); the Triton kernel
    itself, run by the interpreter, covers every element once when the slices do not divide the length."""
    k, v = torch.randn(3, 1000), torch.randn(77)
    torch.testing.assert_close(decode.read_once(k, v)(), k.sum() + v.sum(), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="contiguous"):
        decode.read_once(k.t())
    with pytest.raises(ValueError, match="contiguous"):
        decode.read_once()
    device = "cuda" if torch.cuda.is_available() else "cpu"                # the interpreter runs it on a CPU
    x, sums = torch.arange(10_000, dtype=torch.float32, device=device), torch.full((3,), float("nan"), device=device)
    per = -(-x.numel() // 3 // 512) * 512                                 # 3584: the last slice is short
    readbw._read_kernel[(3,)](x, sums, x.numel(), per, BLOCK=512, UNROLL=2)
    assert sums.tolist() == [x[i * per:(i + 1) * per].sum().item() for i in range(3)]


def test_caches_for_cycles_enough_caches_that_none_is_read_from_l2(monkeypatch):
    """Between two reads of one byte the graph's calls read at least 3x L2: 5 caches of 33.6 MB on a
    50 MiB L2 (batch 1, 8K, bf16), 1 for a cache of 3x L2 or more, never more than the layers; 1 off a GPU."""
    class Props:
        L2_cache_size = 50 * 2**20
    monkeypatch.setattr(decode.torch.cuda, "get_device_properties", lambda device: Props)
    one_layer_8k = 2 * 8192 * 8 * 128 * 2
    assert decode.caches_for(one_layer_8k, "cuda") == 5
    assert decode.caches_for(3 * Props.L2_cache_size, "cuda") == 1
    assert decode.caches_for(1000, "cuda") == decode.LAYERS and decode.caches_for(1000, "cuda", layers=3) == 3
    assert decode.caches_for(one_layer_8k, "cpu") == 1


def test_layered_cycles_the_caches_and_keeps_names_every_cache_has():
    per_cache = [{"a": "a0", "b": "b0"}, {"a": "a1"}, {"a": "a2", "b": "b2"}]
    assert decode.layered(per_cache, 5) == {"a": ["a0", "a1", "a2", "a0", "a1"]}
    with pytest.raises(ValueError, match="one cache"):
        decode.layered([], 8)


def test_noise_is_seeded_normal_and_fills_any_shape_without_a_cuda_generator():
    a = decode._noise((3, 5, 7), torch.bfloat16, "cpu", seed=1)
    assert a.shape == (3, 5, 7) and a.dtype == torch.bfloat16
    assert torch.equal(a, decode._noise((3, 5, 7), torch.bfloat16, "cpu", seed=1))
    assert not torch.equal(a, decode._noise((3, 5, 7), torch.bfloat16, "cpu", seed=2))
    big = decode._noise((decode.NOISE_BLOCK + 10,), torch.float32, "cpu", seed=0)   # repeats past one block
    assert torch.equal(big[-10:], big[:10]) and abs(big[:decode.NOISE_BLOCK].std().item() - 1) < 0.01


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_call_that_breaks_its_capture_is_reported_and_the_next_one_still_replays():
    """In a process of its own: a failed capture leaves CUDA's default generator unusable for the rest."""
    code = """
import torch
from labkit.decoding import decode, readbw
x = torch.ones(4, device="cuda")
replays, errors = decode.graphed({"syncs": lambda: x.sum().item(), "fine": lambda: x * 2}, "cuda")
assert set(errors) == {"syncs"} and set(replays) == {"fine"}, (errors, replays)
assert replays["fine"]().tolist() == [2.0] * 4
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
