"""Recording what MoE blocks see during decode (for tests that replay or compare the calls)."""

from __future__ import annotations

import torch


def clone_tree(x):
    """A detached copy of ``x``: tensors cloned, tuples / lists / dicts copied recursively, anything else as is."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(clone_tree(v) for v in x)
    if isinstance(x, dict):
        return {k: clone_tree(v) for k, v in x.items()}
    return x


class BlockRecorder:
    """While ``decode`` is true: every call of ``blocks`` as ``(block, args, kwargs, output)`` in ``calls`` and the
    inputs of every call of ``pre_hooked`` (e.g. offloaded experts modules) as ``(module, args)`` in
    ``pre_calls``, cloned. ``close()`` removes the hooks."""

    def __init__(self, blocks, pre_hooked=()):
        self.decode = False
        self.calls, self.pre_calls = [], []
        self.handles = [b.register_forward_hook(self._block, with_kwargs=True) for b in blocks]
        self.handles += [m.register_forward_pre_hook(self._pre) for m in pre_hooked]

    def _block(self, module, args, kwargs, output):
        if self.decode:
            self.calls.append((module, clone_tree(args), clone_tree(kwargs), clone_tree(output)))

    def _pre(self, module, args):
        if self.decode:
            self.pre_calls.append((module, clone_tree(args)))

    def close(self):
        for h in self.handles:
            h.remove()
