"""Independent plain-Python references of the policies, written from docs/design.md (not from the code)."""

import math


def greedy_by_hand(s, own, start, k, threshold):
    """Independent plain-Python reference of the routing-mass greedy (lynx_hf/kernels/routing_torch.py):
    fixed-point relative weights W[t][e] = round(2**24 * exp(s - max) / sum over own top-k), gain of e
    = sum over tokens of max(0, W[t][e] - k-th largest W[t] inside S (0 if fewer)); add the best
    candidate (lowest id on ties) while gain >= threshold or |S| < k."""
    rows = s.tolist()
    weights = []
    for t, row in enumerate(rows):
        m = max(row)
        ex = [math.exp(v - m) for v in row]
        z = sum(ex[e] for e in own[t])
        weights.append([round(x / z * 2**24) for x in ex])
    union = sorted({e for r in own for e in r})
    S = set(start)
    while True:
        gains = {}
        for e in union:
            if e in S:
                continue
            total = 0
            for w in weights:
                inside = sorted((w[j] for j in S), reverse=True)
                kth = inside[k - 1] if len(inside) >= k else 0
                total += max(0, w[e] - kth)
            gains[e] = total
        if not gains:
            return S
        best = max(gains, key=lambda e: (gains[e], -e))
        if gains[best] >= threshold or len(S) < k:
            S.add(best)
        else:
            return S
