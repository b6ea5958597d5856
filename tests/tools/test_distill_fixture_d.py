"""Fixture D2's distillation (lab/distill_fixture_d.py) on a tiny random dense Llama: no wheel, no GGUF.

- the student block (computed densely, unselected experts at 0) is transformers' own ``Qwen2MoeSparseMoeBlock``
  holding the same parameters (``moe_layer_params`` with a non-zero router, scales and shared gate); the teacher
  mode is the dense FFN;
- a few distillation steps reduce the KD loss;
- the trained parts assemble (``build_fixture_d.build_moe``) into a Qwen2MoeForCausalLM whose logits are the
  student's, the same tensors twice (deterministic)."""

import torch

from lab.build_fixture_d import build_moe, qwen2moe_config
from lab.distill_fixture_d import DistillMoE, install, kd_step, make_optimizer, trained_parts
from tests.helpers.carved_llama import INTER, SHARED, K, N, assert_block_is_transformers_block, random_block
from tests.helpers.carved_llama import carve as _carve
from tests.helpers.carved_llama import dense_model as _dense_model


def test_student_block_is_transformers_qwen2moe_block():
    p = random_block()
    ffn = (p["gate"], p["up"], p["down"])
    blk = DistillMoE(*ffn, p["perm"], p["router"], p["scale"], SHARED, K, p["shared_gate"])
    assert_block_is_transformers_block(blk, p, ffn)


def test_distillation_steps_reduce_the_kd_loss():
    model = _dense_model()
    blocks = install(model, _carve(model), SHARED, K)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    opt = make_optimizer(blocks, 2e-2)
    with torch.no_grad():
        first = kd_step(model, blocks, ids, 0.0)[1]["kl"]
    for _ in range(25):
        loss, _ = kd_step(model, blocks, ids, 0.01)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        last = kd_step(model, blocks, ids, 0.0)[1]["kl"]
    assert first > 0.1 and last < 0.8 * first, (first, last)
    # only the routing moved: every frozen weight of the dense model has no gradient
    assert all(p.grad is None for n, p in model.named_parameters() if not n.endswith(("router", "log_scale",
                                                                                      "shared_gate")))


def test_trained_parts_assemble_into_the_student_deterministically():
    model = _dense_model()
    carve = _carve(model)
    blocks = install(model, carve, SHARED, K)
    with torch.no_grad():   # "trained": move every trainable tensor off its start
        for b in blocks:
            b.router.add_(torch.randn_like(b.router) * 0.1)
            b.log_scale.add_(0.05)
            b.shared_gate.normal_(0, 0.2)
    parts = trained_parts(blocks, carve)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        student = model(ids).logits
    dense = _dense_model()   # the same seed: the untouched dense weights
    config = qwen2moe_config(dense.config, N, K, (INTER - SHARED) // N, SHARED)
    one, two = build_moe(dense, config, parts), build_moe(dense, config, parts)
    with torch.no_grad():
        torch.testing.assert_close(one(ids).logits, student, rtol=1e-4, atol=1e-4)
    sd1, sd2 = one.state_dict(), two.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    # the trained shared gate is the one assembled (not D's zero gate)
    torch.testing.assert_close(one.model.layers[0].mlp.shared_expert_gate.weight, parts["layers.0.shared_gate"])
