"""CASES C34: group-limited routing checked independently of the specs. For every grouped family (DeepSeek-V2
``group_limited_greedy``; DeepSeek-V3 and the selection-bias families that group: GLM-4.5, EXAONE-MoE, Solar-Open,
Beam, DeepSeek-V3.2), the allowed groups of each decode token are derived here from the router's own logits,
its bias tensor and the model config (never from a spec's selection scores), and every expert a policy remaps to
must lie inside them: default LYNX, the paper's rule (``mass_price=None``), OEA and XShare. Removing the group mask
from ``patches/deepseek_v2.py`` makes this fail (``lab/mutants.py`` ``v2_group_mask_dropped``)."""

import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

import lynx_hf
from helpers import families as fam
from lab import family_matrix as fm
from lynx_hf.block import BlockRouting

# policy_on_every_step (tests/conftest.py): the subject is which experts the policy's remap may choose (C34): it must
# run on every decode step of these tiny models, where the cost gate (the default) keeps it off; the default gate per
# family: test_every_family.py::test_the_default_gate_decodes_as_its_decisions_say
pytestmark = pytest.mark.usefixtures("policy_on_every_step")

POLICIES = {
    "lynx-default": dict(policy="lynx"),
    "paper-rule": dict(policy="lynx", mass_price=None, tau=1000.0),
    "oea": dict(policy="oea", oea_k0=1),
    "xshare": dict(policy="xshare", xshare_budget=1, xshare_warmup=0),
}
# registry families (tests/helpers/families.py) and matrix families (lab.family_matrix) that group
REGISTRY = ("deepseek_v2", "deepseek_v3")
MATRIX = ("glm4_moe", "exaone_moe", "solar_open", "beam", "deepseek_v32")  # dots3_note: GLM-4.5's router
# a family the installed transformers does not ship (Beam before 5.24) is not enumerated, as in the matrix
MATRIX = tuple(t for t in MATRIX if t in CONFIG_MAPPING_NAMES)
BIAS_NAMES = ("e_score_correction_bias", "expert_bias")


def _build(family):
    if family in REGISTRY:
        return fam.build(family, router_scale=60.0)
    return fm.build(fm.case_of(family))


def _groups(config):
    return int(config.n_group), int(config.topk_group)


def _allowed(config, router, block, logits):
    """``[T, N]`` bool: the experts of each token's ``topk_group`` best groups, from the model's definition:
    DeepSeek-V2 (no bias): group score = max softmax probability of the group; the bias families: group score =
    sum of the top-2 of sigmoid(logit) + bias (the bias read from the router or the block by name)."""
    n_group, topk_group = _groups(config)
    num_tokens, num_experts = logits.shape
    x = logits.float()
    bias = next((t for module in (router, block) for n, t in [*module.named_buffers(), *module.named_parameters()]
                 if n.rsplit(".", 1)[-1] in BIAS_NAMES), None)
    if bias is None:
        group_scores = x.softmax(-1).view(num_tokens, n_group, -1).max(-1).values
    else:
        corrected = x.sigmoid() + bias.reshape(-1).float()
        group_scores = corrected.view(num_tokens, n_group, -1).topk(2, dim=-1).values.sum(-1)
    best = group_scores.topk(topk_group, dim=-1).indices
    allowed_groups = torch.zeros(num_tokens, n_group, dtype=torch.bool).scatter_(1, best, True)
    return allowed_groups.repeat_interleave(num_experts // n_group, dim=1)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("family", REGISTRY + MATRIX)
def test_C34_remapped_experts_stay_in_the_tokens_allowed_groups(family, policy, monkeypatch):
    model = _build(family)
    n_group, topk_group = _groups(model.config)
    assert 1 < n_group and topk_group < n_group  # the tiny config really limits groups
    seen = []
    real_route = BlockRouting.route

    def spy(self, step, logits, weights, idx):
        new_w, new_idx = real_route(self, step, logits, weights, idx)
        seen.append((self.router, self.block, logits.detach().clone(), idx.clone(), new_idx.clone()))
        return new_w, new_idx

    monkeypatch.setattr(BlockRouting, "route", spy)
    ids = fm._prompts(16, 5, seed=1)
    with lynx_hf.patched(model, **POLICIES[policy]):
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    assert seen
    remapped = 0
    for router, block, logits, idx, new_idx in seen:
        allowed = _allowed(model.config, router, block, logits)
        assert bool(allowed.gather(1, idx.long()).all()), "the independent group rule disagrees with the model"
        outside = ~allowed.gather(1, new_idx.long())
        assert not bool(outside.any()), f"{int(outside.any(-1).sum())} decode rows use experts outside their groups"
        remapped += int((new_idx.sort(-1).values != idx.sort(-1).values).any(-1).sum())
    if policy != "lynx-default":  # the default may keep every token's set on a tiny batch
        assert remapped > 0
