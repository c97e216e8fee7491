"""Values derived from a parameter once and kept on it: a kernel that needs a weight's scales in
another dtype (the NPU's quantised ops), or a fact about its values (the CPU's int8 kernels: is
any weight -128?), pays for it on the first call, not on every step."""

from __future__ import annotations

import torch

_DERIVED_ATTR = "_atb_plugin_derived"


def derived_once(t: torch.Tensor, key, derive):
    """``derive(t)`` computed once per (parameter version, ``key``, view) and kept on the parameter
    ``t`` is or views: a layer that hands its op a fresh view each call (``weight_scale.view(-1)``)
    still hits the cache. Only for parameters: the data of a step's inputs can change without a
    version bump (numpy-filled buffers), which is why the NPU's ``_host_copy_once`` keys on the
    object. Inference tensors have no version counter (they cannot be modified in place outside
    inference mode)."""
    owner = t if t._base is None else t._base
    try:
        counter = owner._version
    except RuntimeError:
        counter = None
    version = (counter, owner.data_ptr(), tuple(owner.shape), owner.dtype)
    cache = getattr(owner, _DERIVED_ATTR, None)
    if cache is None or cache[0] != version:
        cache = (version, {})
        setattr(owner, _DERIVED_ATTR, cache)
    entry = (key, t.data_ptr(), tuple(t.shape), t.stride())
    if entry not in cache[1]:
        cache[1][entry] = derive(t)
    return cache[1][entry]
