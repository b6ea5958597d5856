"""Fixture D3's tooling (lab/distill_fixture_d.py ``--experts lora``, lab/build_fixture_d.py's LoRA merge) on a tiny
random dense Llama: no wheel, no GGUF.

- the student block with a LoRA on the dense FFN is transformers' own ``Qwen2MoeSparseMoeBlock`` built from the
  merged FFN (``merge_lora`` then ``carve_mlp``); its teacher mode is still the dense FFN without the LoRA;
- zero-initialised LoRA (B = 0) is exactly fixture D2's student, and its parts assemble to exactly D2's model;
- a LoRA fixture's parts assemble deterministically (twice, and through a safetensors round trip) into a plain
  Qwen2MoeForCausalLM that ``from_pretrained`` loads, whose logits are the student's;
- distillation steps train the LoRA factors (the dense weights get no gradient) and lower the KD loss;
- an interrupted run (an exception mid-run, or ``--stop-after``) resumed from its checkpoint ends in the state of an
  uninterrupted run, bit for bit, for D2 and D3; a checkpoint made with other settings is refused;
- D2's options, checkpoint key and assembly are unchanged (no LoRA keys: the dense weights themselves)."""

import pytest
import torch

import lab.distill_fixture_d as dfd
from lab.build_fixture_d import (
    FIXTURE,
    build_moe,
    lora_merged_mlp,
    merge_lora,
    qwen2moe_config,
)
from lab.distill_fixture_d import DistillMoE, install, kd_step, make_optimizer, parse_args, train, trained_parts
from tests.helpers.carved_llama import INTER, SHARED, H, K, N, assert_block_is_transformers_block, carve, random_block
from tests.helpers.carved_llama import dense_model as _dense_model

R = 4   # LoRA rank


def _carve(model, seed=1):
    """A D2-like carve: permutation, router, scales and a non-zero shared gate per layer."""
    return carve(model, seed, shared_gate=True)


def _perturb_lora(blocks, seed=5, std=0.2, prefix=""):
    """Every block's ``<prefix><proj>_lora_B`` drawn N(0, std^2) (``prefix="expert_"``: the per-expert factors)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in blocks:
            for n in dfd.LORA_PROJ:
                lb = getattr(b, f"{prefix}{n}_lora_B")
                lb.copy_(torch.randn(lb.shape, generator=g) * std)


def _config(dense):
    return qwen2moe_config(dense.config, N, K, (INTER - SHARED) // N, SHARED)


def test_lora_student_block_is_transformers_block_of_the_merged_ffn():
    p = random_block()
    ffn = (p["gate"], p["up"], p["down"])
    blk = DistillMoE(*ffn, p["perm"], p["router"], p["scale"], SHARED, K, p["shared_gate"])
    blk.add_lora(p["perm"], R, alpha=2.0 * R, generator=torch.Generator().manual_seed(1))   # scaling 2
    _perturb_lora([blk], std=0.5)
    parts = trained_parts([blk], {"layers.0.perm": p["perm"]}, lora_dtype=torch.float32)
    merged = [merge_lora(w, parts[f"layers.0.{n}_lora_A"], parts[f"layers.0.{n}_lora_B"])
              for w, n in zip(ffn, dfd.LORA_PROJ)]
    assert all((m - w).abs().max() > 0.05 for m, w in zip(merged, ffn))   # the LoRA moves every weight
    assert_block_is_transformers_block(blk, p, merged)   # the teacher: the dense FFN, without the LoRA


def test_zero_lora_is_exactly_the_d2_student_and_model():
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(2))
    d2, d3 = _dense_model(), _dense_model()
    carve = _carve(d2)
    b2 = install(d2, carve, SHARED, K)
    b3 = install(d3, carve, SHARED, K, rank=R, alpha=float(R), seed=0)
    assert all(b.rank == R and float(b.gate_lora_A.detach().abs().max()) > 0
               and not b.gate_lora_B.detach().any() for b in b3)   # A random, B zero
    loss2, st2 = kd_step(d2, b2, ids, 0.01)
    loss3, st3 = kd_step(d3, b3, ids, 0.01)
    assert torch.equal(loss2, loss3) and st2 == st3
    loss2.backward()
    loss3.backward()
    for x2, x3 in zip(b2, b3):   # the routing's gradients are D2's too
        for n in dfd.ROUTING:
            assert torch.equal(getattr(x2, n).grad, getattr(x3, n).grad), n
    # assembled: the zero LoRA merges to the dense weights exactly, in either stored dtype
    dense = _dense_model()
    want = build_moe(dense, _config(dense), trained_parts(b2, carve)).state_dict()
    for dtype in (torch.float32, torch.bfloat16):
        got = build_moe(dense, _config(dense), trained_parts(b3, carve, dtype)).state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_lora_fixture_assembles_deterministically_into_the_student(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2MoeForCausalLM

    model = _dense_model()
    carve = _carve(model)
    blocks = install(model, carve, SHARED, K, rank=R, alpha=float(R), seed=0)
    _perturb_lora(blocks)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        student = model(ids).logits
    dense = _dense_model()
    config = _config(dense)
    parts = trained_parts(blocks, carve, torch.float32)
    assert {f"layers.1.{n}_lora_{f}" for n in dfd.LORA_PROJ for f in "AB"} <= parts.keys()
    save_file(parts, tmp_path / "carve.safetensors")
    one, two = build_moe(dense, config, parts), build_moe(dense, config, load_file(tmp_path / "carve.safetensors"))
    sd1, sd2 = one.state_dict(), two.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    plain = build_moe(dense, config, {k: v for k, v in parts.items() if "_lora_" not in k})
    assert not torch.equal(sd1["model.layers.0.mlp.experts.gate_up_proj"],
                           plain.state_dict()["model.layers.0.mlp.experts.gate_up_proj"])   # the LoRA is merged
    with torch.no_grad():
        torch.testing.assert_close(one(ids).logits, student, rtol=1e-4, atol=1e-4)
        assert (plain(ids).logits - student).abs().max() > 1e-2   # ... and it matters
    one.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    loaded = Qwen2MoeForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, student, rtol=1e-4, atol=1e-4)
    # the committed dtype (bf16 factors): deterministic too, and close to the fp32 student
    bf = trained_parts(blocks, carve)
    assert bf["layers.0.up_lora_B"].dtype == torch.bfloat16
    m1, m2 = build_moe(dense, config, bf), build_moe(dense, config, bf)
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    with torch.no_grad():
        torch.testing.assert_close(m1(ids).logits, student, rtol=0.05, atol=0.05)


def test_lora_distillation_trains_the_experts_and_lowers_the_kd_loss():
    model = _dense_model()
    blocks = install(model, _carve(model), SHARED, K, rank=R, alpha=float(R), seed=0)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    opt = make_optimizer(blocks, 2e-2, 2e-2)
    assert len(opt.param_groups) == 4 and len(opt.param_groups[3]["params"]) == 6 * len(blocks)
    with torch.no_grad():
        first = kd_step(model, blocks, ids, 0.0)[1]["kl"]
    for _ in range(25):
        loss, _ = kd_step(model, blocks, ids, 0.01)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        last = kd_step(model, blocks, ids, 0.0)[1]["kl"]
    assert first > 0.1 and last < 0.5 * first, (first, last)
    assert all(b.down_lora_B.detach().abs().max() > 0 for b in blocks)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    trained = {n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.grad is not None}
    assert trained == set(blocks[0].trainable())


def _args(tmp, mode, *extra):
    return parse_args(["--experts", mode, "--rank", str(R), "--steps", "7", "--batch", "2", "--save-every", "2",
                       "--warmup", "2", "--lr", "2e-2", "--lora-lr", "1e-2", "--print-every", "100",
                       "--work", str(tmp), *extra])


def _trained(mode, args, win, seed=0):
    model = _dense_model()
    carve = _carve(model)
    blocks = install(model, carve, SHARED, K, *((R, float(R), seed) if mode == "lora" else ()))
    log, _ = train(model, blocks, win, args, args.work / "ckpt.pt")
    return [{n: getattr(b, n).detach().clone() for n in b.trainable()} for b in blocks], log


@pytest.mark.parametrize("mode", ["none", "lora"])
def test_resume_after_an_interruption_equals_an_uninterrupted_run(tmp_path, monkeypatch, mode):
    win = torch.randint(0, 64, (14, 16), generator=torch.Generator().manual_seed(3))
    ref, ref_log = _trained(mode, _args(tmp_path / "a", mode), win)
    # an exception at step 6 (last checkpoint: step 4), then the same command again
    calls, real = [0], dfd.kd_step

    def crashing(*a, **kw):
        calls[0] += 1
        if calls[0] == 6:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(dfd, "kd_step", crashing)
    with pytest.raises(KeyboardInterrupt):
        _trained(mode, _args(tmp_path / "b", mode), win)
    monkeypatch.setattr(dfd, "kd_step", real)
    assert torch.load(tmp_path / "b" / "ckpt.pt", weights_only=False)["step"] == 4
    got, got_log = _trained(mode, _args(tmp_path / "b", mode), win)
    # --stop-after 3 (a checkpoint where it stops, off the save grid), then a rerun
    part, part_log = _trained(mode, _args(tmp_path / "c", mode, "--stop-after", "3"), win)
    assert len(part_log) == 3
    stopped, stopped_log = _trained(mode, _args(tmp_path / "c", mode), win)
    for other, other_log in ((got, got_log), (stopped, stopped_log)):
        assert [r["kl"] for r in other_log] == [r["kl"] for r in ref_log]
        for a, b in zip(ref, other):
            assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], b[n]) for a, b in zip(ref, part) for n in a)   # 3 steps != 7 steps
    # a checkpoint of other settings is refused
    with pytest.raises(SystemExit, match="other settings"):
        _trained(mode, _args(tmp_path / "a", mode, "--lr", "1e-2"), win)


def test_d2_options_checkpoint_key_and_assembly_are_unchanged():
    d2 = parse_args([])
    assert (d2.experts, d2.fixture, d2.out_fixture, d2.work.name) == ("none", FIXTURE, dfd.OUT_FIXTURE, "d2")
    assert dfd._args_key(d2) == {k: getattr(d2, k) for k in ("steps", "batch", "window", "lr", "lb_coef", "seed",
                                                              "warmup", "skip_files")}
    assert dfd.base_lrs(d2) == (2e-3, 1e-2, 2e-3)
    d3 = parse_args(["--experts", "lora"])
    assert (d3.fixture, d3.out_fixture, d3.work.name) == (dfd.OUT_FIXTURE, dfd.D3_FIXTURE, "d3")
    assert (d3.rank, d3.lora_alpha, d3.lora_dtype) == (16, 16.0, "bfloat16")
    assert parse_args(["--experts", "lora", "--init-fixture", "x"]).fixture.name == "x"
    model = _dense_model()
    carve = _carve(model)
    mlp = model.model.layers[0].mlp
    got = lora_merged_mlp(mlp, carve, 0)
    assert all(g.data_ptr() == w.data_ptr() and torch.equal(g, w)   # the dense weights themselves, not a copy
               for g, w in zip(got, (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)))
    with pytest.raises(ValueError, match="do not fit"):
        merge_lora(mlp.gate_proj.weight.data, torch.zeros(R, H), None)


def test_second_stage_starts_from_the_init_fixtures_lora_exactly():
    """``--init-fixture`` with LoRA factors (D3's second stage, a larger ``--rank``): they fill the first slots, so
    step 0 computes the init fixture's student; the new slots start at zero ``B``; a rank below the stored one is
    refused."""
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(2))
    d1 = _dense_model()
    carve1 = _carve(d1)
    b1 = install(d1, carve1, SHARED, K, rank=R, alpha=2.0 * R, seed=0)   # scaling 2 (stored B carries it)
    _perturb_lora(b1)
    parts = trained_parts(b1, carve1, lora_dtype=torch.float32)
    d2 = _dense_model()
    b2 = install(d2, parts, SHARED, K, rank=2 * R, alpha=float(2 * R), seed=7)   # scaling 1
    for x1, x2 in zip(b1, b2):
        for n in dfd.LORA_PROJ:
            assert torch.equal(getattr(x2, f"{n}_lora_A")[:R], getattr(x1, f"{n}_lora_A"))
            assert not getattr(x2, f"{n}_lora_B")[:, R:].detach().any()
            assert getattr(x2, f"{n}_lora_A")[R:].detach().abs().max() > 0   # fresh A: the new slots can train
    with torch.no_grad():
        (l1, s1), (l2, _) = kd_step(d1, b1, ids, 0.01), kd_step(d2, b2, ids, 0.01)
    assert s1["kl"] > 0.01   # the perturbed LoRA is not the teacher
    torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="exceeds --rank"):
        install(_dense_model(), parts, SHARED, K, rank=R - 1, alpha=1.0, seed=0)


def test_skip_windows_continues_where_the_first_stage_ended(monkeypatch):
    texts = {"docs": [("d", "a " * 40)], "code": [("c", "b " * 40)]}
    monkeypatch.setattr(dfd, "training_texts", lambda domain, root: texts[domain])

    class Tok:   # one id per character
        def __call__(self, text, verbose=False):
            return {"input_ids": [ord(ch) + i for i, ch in enumerate(text)]}

    both = dfd.training_windows(Tok(), None, None, 8, 5)
    second = dfd.training_windows(Tok(), None, None, 4, 5, skip_windows=2)
    assert torch.equal(second, both[4:])   # docs, code alternating: windows 2, 3 of each domain
    assert dfd._args_key(_args("w", "lora", "--skip-windows", "2"))["skip_windows"] == 2
    assert "skip_windows" not in dfd._args_key(_args("w", "lora"))   # earlier checkpoints still resume
    assert dfd._args_key(_args("w", "none", "--skip-windows", "2"))["skip_windows"] == 2   # D2 mode too


def test_per_expert_lora_starts_at_the_first_stage_and_assembles_into_the_student():
    """``--expert-rank`` (D3's per-expert second stage): zero ``B_e`` computes the dense-LoRA student exactly; trained
    factors assemble (``lab.build_fixture_d.merge_expert_lora``, each expert's own ``W_e + B_e A_e``) into a plain
    Qwen2-MoE whose logits are the student's; each expert's factors move only that expert's weights."""
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    d1, d2 = _dense_model(), _dense_model()
    carve1 = _carve(d1)
    b1 = install(d1, carve1, SHARED, K, rank=R, alpha=float(R), seed=0)
    _perturb_lora(b1)
    first = trained_parts(b1, carve1, lora_dtype=torch.float32)
    b2 = install(d2, first, SHARED, K, rank=R, alpha=float(R), seed=0, expert_rank=2, expert_alpha=4.0)  # scaling 2
    m = (INTER - SHARED) // N
    assert all(b.expert_gate_lora_A.shape == (N, 2, H) and b.expert_gate_lora_B.shape == (N, m, 2)
               and b.expert_down_lora_A.shape == (N, 2, m) and b.expert_down_lora_B.shape == (N, H, 2) for b in b2)
    with torch.no_grad():
        (l1, s1), (l2, s2) = kd_step(d1, b1, ids, 0.01), kd_step(d2, b2, ids, 0.01)
    assert s1["kl"] > 0.01 and s2 == s1   # the perturbed dense LoRA is not the teacher; zero B_e changes no statistic
    torch.testing.assert_close(l2, l1, rtol=1e-6, atol=1e-7)   # zero B_e: the first stage's student
    _perturb_lora(b2, seed=6, std=0.3, prefix="expert_")
    with torch.no_grad():
        student = d2(ids).logits
    dense = _dense_model()
    config = _config(dense)
    parts = trained_parts(b2, first, lora_dtype=torch.float32)
    assert parts["layers.0.expert_up_lora_A"].shape == (N, 2, H) and parts["layers.0.expert_down_lora_B"].shape == (N, H, 2)
    moe = build_moe(dense, config, parts)
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, student, rtol=1e-4, atol=1e-4)
        plain = build_moe(dense, config, {k: v for k, v in parts.items() if not k.split(".")[-1].startswith("expert_")})
        assert (plain(ids).logits - student).abs().max() > 1e-2   # the per-expert factors matter
    # expert 1's factors alone: only expert 1's weights move (gate, up and down)
    only = dict(parts)
    for n in dfd.LORA_PROJ:
        b = parts[f"layers.0.expert_{n}_lora_B"].clone()
        b[torch.arange(N) != 1] = 0
        only[f"layers.0.expert_{n}_lora_B"] = b
    ref = plain.state_dict()
    got = build_moe(dense, config, only).state_dict()
    gu = got["model.layers.0.mlp.experts.gate_up_proj"] - ref["model.layers.0.mlp.experts.gate_up_proj"]
    dn = got["model.layers.0.mlp.experts.down_proj"] - ref["model.layers.0.mlp.experts.down_proj"]
    moved = [e for e in range(N) if gu[e].abs().max() > 0 or dn[e].abs().max() > 0]
    assert moved == [1]
    with pytest.raises(ValueError, match="exceeds --expert-rank"):
        install(_dense_model(), parts, SHARED, K, rank=R, alpha=float(R), seed=0, expert_rank=1)


def test_per_expert_lora_trains_and_its_options_key_the_checkpoint():
    model = _dense_model()
    blocks = install(model, _carve(model), SHARED, K, rank=R, alpha=float(R), seed=0, expert_rank=2)
    opt = make_optimizer(blocks, 2e-2, 1e-2, 3e-2)
    assert [g["lr"] for g in opt.param_groups] == [2e-2, 1e-1, 2e-2, 1e-2, 3e-2]
    assert len(opt.param_groups[4]["params"]) == 6 * len(blocks)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    loss, _ = kd_step(model, blocks, ids, 0.01)
    loss.backward()
    assert all(b.expert_up_lora_A.grad is not None and b.expert_down_lora_B.grad.abs().max() > 0 for b in blocks)
    args = _args("w", "lora", "--expert-rank", "3", "--expert-lora-lr", "4e-3")
    assert (args.expert_rank, args.expert_lora_alpha, args.expert_lora_lr) == (3, 3.0, 4e-3)
    assert dfd._args_key(args)["expert_rank"] == 3 and dfd.base_lrs(args)[-1] == 4e-3
    plain = _args("w", "lora")
    assert "expert_rank" not in dfd._args_key(plain) and len(dfd.base_lrs(plain)) == 4   # earlier checkpoints resume
    with pytest.raises(SystemExit, match="expert-rank"):
        parse_args(["--expert-rank", "2"])   # D2 mode has no experts' factors
