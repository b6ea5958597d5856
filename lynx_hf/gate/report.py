"""What the cost gate tells the user: the patch-time note and the line ``lynx-hf generate`` prints."""

from __future__ import annotations

from collections import Counter

from ..config import GATE_ENV as ENV


def off_line(layers: list[dict]) -> str | None:
    """One line when the gate switched the policy off on some layer at the step size most seen, e.g.
    ``"LYNX off on 24/24 layers at 16 tokens: expected saving 0.02 ms < cost 0.05 ms per layer-step"`` (means over
    the layers it is off on); ``None`` when it is on everywhere or no layer has a gate. ``layers``: per-layer stats
    dicts holding ``"gate"`` (:meth:`PlanGate.summary`)."""
    gates = [layer.get("gate") for layer in layers]
    gates = [g for g in gates if isinstance(g, dict) and g.get("by_tokens")]
    if not gates:
        return None
    seen = Counter()
    for g in gates:
        for t in g["by_tokens"]:
            seen[int(t)] += 1
    tokens = max(seen, key=lambda t: (seen[t], t))
    off = [g["by_tokens"].get(tokens) or g["by_tokens"].get(str(tokens)) for g in gates]
    off = [e for e in off if e is not None and not e["on"]]
    if not off:
        return None
    saving = sum(e["saving_ms"] for e in off) / len(off)
    cost = sum(e["cost_ms"] for e in off) / len(off)
    return (f"LYNX off on {len(off)}/{len(layers)} layers at {tokens} tokens per step: expected saving "
            f"{saving:.3g} ms <= cost {cost:.3g} ms per layer-step (gate='always' or {ENV}=always forces it on)")


def patch_note(gates: list) -> str | None:
    """One line for ``lynx_hf.patch`` when the gate measured at patch time keeps the model's own routing at some
    step sizes, e.g. ``"... runs the policy at decode step sizes 2, 4, 8 and keeps the model's own routing on 4/4 MoE
    layers at decode step sizes ... 64, 128 ..."`` (the sizes where it runs first; none: that clause left out); ``None`` when it is on
    everywhere it measured (or nothing was measured). ``gates``: one entry per patched layer, its :class:`PlanGate`
    (:func:`of` its plan) or ``None``."""
    measured = [g for g in gates if g is not None and g.decisions]
    if not measured:
        return None
    # a step size where the policy would save nothing (one token; every expert used either way) is not news
    def off(d):
        return not d.on and d.experts_saved > 0

    off_buckets = sorted({b for g in measured for b, d in g.decisions.items() if off(d)})
    if not off_buckets:
        return None
    layers = sum(1 for g in measured if any(off(d) for d in g.decisions.values()))
    # where it runs, first: three new users read the note as "LYNX is off" when their own batch ran the policy
    on_buckets = sorted({b for g in measured for b, d in g.decisions.items() if d.on})
    runs = (f"runs the policy at decode step sizes {', '.join(str(b) for b in on_buckets)} and " if on_buckets else "")
    return (f"lynx_hf: the cost gate (gate='auto') {runs}keeps the model's own routing on {layers}/{len(gates)} MoE "
            f"layers at decode step sizes (tokens, rounded up to these) {', '.join(str(b) for b in off_buckets)} on "
            f"this device (expected "
            f"saving <= measured routing cost; lynx_hf.stats(model).summary()['per_layer'][i]['gate'] has the "
            f"figures); gate='always' or {ENV}=always runs the policy on every decode step")
