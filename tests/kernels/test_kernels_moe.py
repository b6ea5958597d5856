"""Sparse decode expert kernel (Triton, interpreter) and block alignment vs kernels/moe_naive.py.

Alignment metadata must be *exactly* equal to the reference. Expert outputs are fp32 here (the
interpreter's bf16 ``tl.dot`` is unusable) and agree within atol 1e-5 / rtol 1e-5 (fp32 sums in a
different order). Outputs and intermediates come from a NaN-poisoned ``torch.empty``, so any
unwritten row shows as NaN. bf16/fp16 at real shapes: lab/gpu_check.py on a CUDA machine.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (also set in tests/conftest.py)

import importlib.util  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from helpers.strategies import fuzz  # noqa: E402
from lynx_hf.kernels.moe import moe_align_block_size, moe_block_config, sparse_moe  # noqa: E402
from lynx_hf.kernels.moe_naive import (  # noqa: E402
    max_num_tokens_padded,
    naive_moe_align_block_size,
    naive_sparse_moe,
)

ATOL, RTOL = 1e-5, 1e-5  # fp32


@pytest.fixture(autouse=True)
def _poison_empty(poisoned_empty):
    """Every test here allocates through a poisoned ``torch.empty`` (tests/conftest.py)."""


def _routing(T, N, k, g, mode="random"):
    if mode == "one_expert":  # every token's slot 0 on expert N-1 (k=1: all pairs on one expert)
        idx = torch.stack([torch.cat([torch.tensor([N - 1]), torch.randperm(N - 1, generator=g)[: k - 1]]) for _ in range(T)])
    elif mode == "few":  # only experts 0..k (the rest get zero tokens)
        idx = torch.stack([torch.randperm(k + 1, generator=g)[:k] for _ in range(T)])
    else:
        idx = torch.stack([torch.randperm(N, generator=g)[:k] for _ in range(T)])
    return idx.long()


def _experts(N, H, I, g, transposed, dtype=torch.float32):
    gu = torch.randn(N, *((H, 2 * I) if transposed else (2 * I, H)), generator=g) / H**0.5
    dn = torch.randn(N, *((I, H) if transposed else (H, I)), generator=g) / I**0.5
    return gu.to(dtype), dn.to(dtype)


def _problem(T, H, I, N, k, seed):
    """A random sparse-MoE problem: ``x [T, H]``, routing ``idx [T, k]``, weights ``w [T, k]``, experts
    ``gate_up [N, 2I, H]`` / ``down [N, H, I]`` (fp32), drawn in that order from one generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    idx = _routing(T, N, k, g)
    w = torch.rand(T, k, generator=g)
    gu, dn = _experts(N, H, I, g, False)
    return x, idx, w, gu, dn



# ---------------------------------------------------------------------------------------------
# alignment


# (T, k, N, block_m, mode), one comment each.
ALIGN_CASES = [
    (1, 1, 8, 16, "random"),  # T=1, k=1
    (1, 8, 64, 16, "random"),  # T=1 with Qwen2-57B k
    (5, 2, 8, 16, "random"),  # T*k < BLOCK_M
    (40, 1, 8, 16, "one_expert"),  # all pairs on one expert: several full blocks
    (33, 2, 8, 16, "one_expert"),  # one hot expert + others
    (12, 3, 16, 16, "few"),  # most experts receive zero tokens (C16)
    (16, 4, 60, 16, "random"),  # N=60, not a power of two (C16)
    (7, 8, 384, 32, "random"),  # N=384, BLOCK_M 32 (C16)
    (64, 8, 64, 16, "random"),  # B=64 decode, Qwen2-57B N/k
    (16, 16, 16, 16, "random"),  # k == N: every expert, every token
]


@pytest.mark.parametrize("T,k,N,bm,mode", ALIGN_CASES)
def test_C16_align_matches_reference(T, k, N, bm, mode):
    g = torch.Generator().manual_seed(T * 31 + N)
    idx = _routing(T, N, k, g, mode)
    want = naive_moe_align_block_size(idx, N, bm)
    got = moe_align_block_size(idx, N, bm)
    for a, b, name in zip(got, want, ("sorted_ids", "expert_ids", "num_post")):
        assert a.dtype == torch.int64 and torch.equal(a, b), name
    sorted_ids, expert_ids, num_post = want
    # the contract itself
    P = T * k
    n_post = int(num_post)
    assert sorted_ids.numel() == max_num_tokens_padded(P, N, bm) and n_post % bm == 0
    valid = sorted_ids[sorted_ids < P]
    assert torch.equal(valid.sort().values, torch.arange(P))  # every pair exactly once
    assert (sorted_ids[n_post:] == P).all() and (expert_ids[n_post // bm :] == -1).all()
    flat = idx.flatten()
    counts = torch.bincount(flat, minlength=N)
    assert torch.equal(torch.bincount(expert_ids[: n_post // bm], minlength=N), (counts + bm - 1) // bm)
    for b in range(n_post // bm):
        blk = sorted_ids[b * bm : (b + 1) * bm]
        blk = blk[blk < P]
        assert (flat[blk] == expert_ids[b]).all()  # one expert per block


def test_align_empty_and_errors():
    idx = torch.empty(0, 2, dtype=torch.int64)
    for out in (moe_align_block_size(idx, 8, 16), naive_moe_align_block_size(idx, 8, 16)):
        assert out[0].numel() == 0 and out[1].numel() == 0 and int(out[2]) == 0
    with pytest.raises(ValueError):
        moe_align_block_size(torch.zeros(4, dtype=torch.int64), 8, 16)
    with pytest.raises(ValueError):
        naive_moe_align_block_size(torch.zeros(4, 1, dtype=torch.int64), 8, 0)
    with pytest.raises(ValueError):
        naive_moe_align_block_size(torch.full((4, 1), 8), 8, 16)


# ---------------------------------------------------------------------------------------------
# sparse expert kernel

# (T, H, I, N, k, transposed, weight_on_input, mode, block_n, block_k), one comment each.
MOE_CASES = [
    (1, 64, 32, 8, 2, False, False, "random", 32, 32),  # T=1, Mixtral layout
    (5, 64, 48, 8, 2, False, False, "random", 32, 32),  # T < BLOCK_M; I not a multiple of block_n
    (24, 64, 16, 4, 1, False, False, "one_expert", 32, 32),  # k=1, all tokens on one expert: 2 blocks
    (12, 48, 16, 16, 3, False, False, "few", 32, 16),  # most experts get zero tokens (C16)
    (8, 64, 16, 60, 4, False, False, "random", 64, 64),  # N=60 (C16)
    (4, 64, 16, 384, 6, False, False, "random", 64, 64),  # N=384 (C16)
    (6, 80, 24, 16, 1, True, True, "random", 32, 32),  # Llama-4: transposed layout, weight on input, k=1
    (6, 80, 24, 16, 2, True, False, "random", 32, 32),  # transposed layout, weight on output
    (6, 80, 24, 16, 2, False, True, "random", 32, 32),  # weight on input, Qwen layout
    (20, 64, 32, 8, 2, False, False, "random", 32, 32),  # a block with 16 < pairs: two blocks per expert
]


@pytest.mark.parametrize("T,H,I,N,k,tr,woi,mode,bn,bk", MOE_CASES)
def test_C16_sparse_moe_matches_reference(T, H, I, N, k, tr, woi, mode, bn, bk):
    g = torch.Generator().manual_seed(T * 7 + H + N)
    x = torch.randn(T, H, generator=g)
    idx = _routing(T, N, k, g, mode)
    w = torch.rand(T, k, generator=g) + 0.1
    gu, dn = _experts(N, H, I, g, tr)
    got = sparse_moe(x, idx, w, gu, dn, transposed=tr, weight_on_input=woi, block_m=16, block_n=bn, block_k=bk)
    want = naive_sparse_moe(x, idx, w, gu, dn, transposed=tr, weight_on_input=woi)
    assert got.shape == (T, H) and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


# C15: kernel tails at batch 1, hidden sizes 64/200/1000/2880, every element written.
@pytest.mark.parametrize("H", [64, 200, 1000, 2880])
def test_C15_hidden_size_tails_batch1(H):
    T, I, N, k = 1, 16, 4, 2
    x, idx, w, gu, dn = _problem(T, H, I, N, k, seed=H)
    blk = 128 if H >= 1000 else 32
    got = sparse_moe(x, idx, w, gu, dn, block_n=blk, block_k=blk)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, naive_sparse_moe(x, idx, w, gu, dn), atol=ATOL, rtol=RTOL)


def test_upper_bound_grid_programs_exit():
    # the CUDA path launches the data-independent upper bound of blocks; extra programs must exit
    T, H, I, N, k = 3, 32, 16, 8, 2
    x, idx, w, gu, dn = _problem(T, H, I, N, k, seed=1)
    got = sparse_moe(x, idx, w, gu, dn, block_n=32, block_k=32, exact_grid=False)
    torch.testing.assert_close(got, naive_sparse_moe(x, idx, w, gu, dn), atol=ATOL, rtol=RTOL)


def test_non_contiguous_inputs():
    # weights viewed from the other layout, hidden a column slice, int32 ids, fp64 routing weights
    g = torch.Generator().manual_seed(2)
    T, H, I, N, k = 4, 32, 16, 8, 2
    big = torch.randn(T, 2 * H, generator=g)
    x = big[:, :H]
    idx = _routing(T, N, k, g)
    w = torch.rand(T, k, generator=g, dtype=torch.float64)
    gu_t, dn_t = _experts(N, H, I, g, True)  # [N, H, 2I], [N, I, H]
    gu, dn = gu_t.transpose(1, 2), dn_t.transpose(1, 2)  # [N, 2I, H], [N, H, I] views
    assert not x.is_contiguous() and not gu.is_contiguous()
    got = sparse_moe(x, idx.int(), w, gu, dn, block_n=32, block_k=32)
    torch.testing.assert_close(got, naive_sparse_moe(x, idx, w, gu, dn), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got, naive_sparse_moe(x, idx, w, gu_t, dn_t, transposed=True), atol=ATOL, rtol=RTOL)


def test_zero_routing_weight_and_empty_batch():
    g = torch.Generator().manual_seed(3)
    T, H, I, N, k = 2, 32, 16, 4, 2
    x = torch.randn(T, H, generator=g)
    idx = _routing(T, N, k, g)
    gu, dn = _experts(N, H, I, g, False)
    got = sparse_moe(x, idx, torch.zeros(T, k), gu, dn, block_n=32, block_k=32)
    assert torch.equal(got, torch.zeros(T, H))
    empty = sparse_moe(x[:0], idx[:0], torch.zeros(0, k), gu, dn)
    assert empty.shape == (0, H)


def test_naive_reference_against_dense_loop():
    # the reference itself vs a literal per-(token, slot) loop (both layouts, both weight modes)
    g = torch.Generator().manual_seed(4)
    T, H, I, N, k = 3, 8, 4, 5, 2
    x = torch.randn(T, H, generator=g, dtype=torch.float64).float()
    idx = _routing(T, N, k, g)
    w = torch.rand(T, k, generator=g)
    gu, dn = _experts(N, H, I, g, False)
    for woi in (False, True):
        want = torch.zeros(T, H)
        for t in range(T):
            for s in range(k):
                e = int(idx[t, s])
                xi = x[t] * w[t, s] if woi else x[t]
                gate, up = (gu[e] @ xi).chunk(2)
                y = dn[e] @ (torch.nn.functional.silu(gate) * up)
                want[t] += y if woi else w[t, s] * y
        torch.testing.assert_close(naive_sparse_moe(x, idx, w, gu, dn, weight_on_input=woi), want, atol=ATOL, rtol=RTOL)
        got_t = naive_sparse_moe(
            x, idx, w, gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous(), transposed=True, weight_on_input=woi
        )
        torch.testing.assert_close(got_t, want, atol=ATOL, rtol=RTOL)


def test_invalid_arguments():
    T, H, I, N, k = 2, 32, 16, 4, 2
    x, idx, w, gu, dn = _problem(T, H, I, N, k, seed=5)
    for fn in (sparse_moe, naive_sparse_moe):
        with pytest.raises(ValueError):
            fn(x[0], idx, w, gu, dn)  # 1-d hidden
        with pytest.raises(ValueError):
            fn(x, idx[:1], w, gu, dn)  # T mismatch
        with pytest.raises(ValueError):
            fn(x, idx, w[:, :1], gu, dn)  # weights shape
        with pytest.raises(ValueError):
            fn(x, idx.float(), w, gu, dn)  # float ids
        with pytest.raises(ValueError):
            fn(x, idx, w, gu, dn, transposed=True)  # wrong layout
        with pytest.raises(ValueError):
            fn(x, idx, w, gu, dn[:, :, :-1])  # down/gate_up mismatch
        with pytest.raises(ValueError):
            fn(x, idx, w, gu, dn, activation="gelu")
    with pytest.raises(ValueError):
        sparse_moe(x, idx, w, gu, dn, block_m=8)  # tl.dot needs >= 16
    with pytest.raises(IndexError):
        naive_sparse_moe(x, torch.full_like(idx, N), w, gu, dn)


def test_lynx_remap_then_sparse_moe_end_to_end():
    # routing kernels feed the expert kernel: the remapped batch touches fewer experts, same result
    from lynx_hf.kernels import routing_torch as ref
    from lynx_hf.kernels.routing import lynx_critical_set, remap_topk

    g = torch.Generator().manual_seed(6)
    T, H, I, N, k = 16, 32, 16, 16, 4
    logits = torch.linspace(2, -2, N) * 2 + torch.randn(T, N, generator=g)
    idx0 = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
    crit = lynx_critical_set(logits, idx0, k, *ref.default_lynx_bins(N, k), 1.0)
    idx, w = remap_topk(logits, crit, k, rule="softmax_all", renormalize=True)
    assert idx.unique().numel() <= idx0.unique().numel()
    x = torch.randn(T, H, generator=g)
    gu, dn = _experts(N, H, I, g, False)
    got = sparse_moe(x, idx, w, gu, dn, block_n=32, block_k=32)
    torch.testing.assert_close(got, naive_sparse_moe(x, idx, w, gu, dn), atol=ATOL, rtol=RTOL)


@fuzz(0.4)
@given(
    T=st.integers(0, 70),
    k=st.integers(1, 8),
    N=st.sampled_from([1, 3, 8, 60, 64, 384]),
    bm=st.sampled_from([1, 4, 16, 64]),
    hot=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_property_align_matches_reference(T, k, N, bm, hot, seed):
    # random routings, optionally concentrated on the first `hot` experts (many zero-token experts)
    k = min(k, N)
    g = torch.Generator().manual_seed(seed)
    span = N if hot == 0 else max(k, min(N, hot + k))
    idx = torch.stack([torch.randperm(span, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.int64)
    for a, b in zip(moe_align_block_size(idx, N, bm), naive_moe_align_block_size(idx, N, bm)):
        assert torch.equal(a, b)


def _load_gpu_check():
    path = importlib.util.find_spec("lab.gpu_check").origin  # a fresh module object per call
    spec = importlib.util.spec_from_file_location("lab.gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit path")
def test_gpu_check_exits_cleanly_without_cuda(capsys):
    assert _load_gpu_check().main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.slow
def test_gpu_check_dry_run(capsys):
    # every section of the GPU script on tiny CPU shapes under the interpreter (keeps lab/gpu_check.py
    # runnable where no GPU is); its checks compare kernels with their references, so it can fail
    # In its own process: the script compiles, captures and sets torch's global state as a GPU run does. Run inside
    # a pytest-xdist worker under torch 2.15 it left that worker so that a later `with torch.device("meta")` model
    # build (tests/decode/test_vlm_wrappers.py, Inkling) allocated its 23.6 GB vision layer on the CPU: the worker
    # was OOM-killed (not reproduced outside pytest; seen in CI's next leg, 2026-12-04)
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(filter(None, (str(root),
                                                                                               os.environ.get("PYTHONPATH"))))}
    res = subprocess.run([sys.executable, "-m", "lab.gpu_check", "--dry-run", "--budget", "600"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=900)
    out = res.stdout
    assert res.returncode == 0, (out[-3000:], res.stderr[-3000:])
    assert "gpu_check summary" in out
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in out.split("gpu_check summary", 1)[1].splitlines() if line.startswith("| ")]
    rows = [row for row in rows if len(row) >= 3 and row[0] not in ("section", "---")]
    for section in ("compiled", "kernels", "sync", "tpot", "graphs"):
        assert any(row[0] == section and row[2] in ("ok", "info") for row in rows), section
    assert not any(row[2] in ("FAIL", "skipped") for row in rows), out


def test_bf16_inputs_on_cpu_are_computed_in_fp32():
    # interpreter: bf16 tl.dot is unusable, so the launcher upcasts; result in bf16, close to the reference
    g = torch.Generator().manual_seed(8)
    T, H, I, N, k = 3, 32, 16, 8, 2
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = _routing(T, N, k, g)
    w = torch.rand(T, k, generator=g).bfloat16()
    gu, dn = _experts(N, H, I, g, False, torch.bfloat16)
    got = sparse_moe(x, idx, w, gu, dn, block_n=32, block_k=32)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, naive_sparse_moe(x, idx, w, gu, dn), atol=1e-2, rtol=1e-2)


# (T, k, N, expected block_m), one comment each: block_m holds the average pairs per expert, T*k/N.
BLOCK_M_CASES = [
    (1, 8, 64, 16),  # Qwen2-57B decode at B=1: 16 is tl.dot's minimum
    (64, 8, 64, 16),  # B=64: 8 pairs per expert
    (64, 2, 8, 16),  # Mixtral B=64: 16 pairs per expert
    (128, 2, 8, 32),  # Mixtral B=128: 32 pairs per expert
    (512, 8, 8, 64),  # 512 pairs per expert: capped at 64
]


@pytest.mark.parametrize("T,k,N,block_m", BLOCK_M_CASES)
def test_moe_block_config_values(T, k, N, block_m):
    cfg = moe_block_config(T, k, N, 4096, 14336, torch.bfloat16)
    assert cfg["block_m"] == block_m
    # vLLM's untuned defaults: small M -> (32, 64), otherwise (64, 32)
    assert (cfg["block_n"], cfg["block_k"]) == ((32, 64) if block_m == 16 else (64, 32))
    assert cfg["num_warps"] == 4 and cfg["num_stages"] == 3


# (T, H, I, N, k): shapes where the default configuration picks block_m 32 / 64 (several hot experts)
@pytest.mark.parametrize("T,H,I,N,k", [(40, 32, 16, 4, 2), (70, 32, 16, 4, 4)])
def test_sparse_moe_default_blocks_large_groups(T, H, I, N, k):
    x, idx, w, gu, dn = _problem(T, H, I, N, k, seed=T + N)
    assert moe_block_config(T, k, N, H, I, torch.float32)["block_m"] in (32, 64)
    got = sparse_moe(x, idx, w, gu, dn, exact_grid=False)  # block sizes from moe_block_config
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, naive_sparse_moe(x, idx, w, gu, dn), atol=ATOL, rtol=RTOL)
