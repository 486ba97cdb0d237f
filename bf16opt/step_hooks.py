"""torch's step wrapper (``Optimizer.profile_hook_step``) entered through its C++ bindings:
the step pre- and post-hooks, global and the optimizer's, around the step, in the scope
``Optimizer.step#<class>.step`` that profilers see.

torch's own wrapper enters that scope through ``record_function``, whose operator dispatch is
a noticeable share of a short step (docs/performance.md); this one calls the binding behind
it (private), and falls back to torch's wrapper where the binding or the hook dicts are
missing, or while torch.compile traces the step.
"""

from __future__ import annotations

import functools
from itertools import chain
from typing import Callable

import torch
from torch.optim import optimizer as torch_optimizer

__all__ = ["profile_hook_step"]

#: torch.optim.optimizer's dicts of the hooks registered for every optimizer's step (private)
_GLOBAL_STEP_HOOKS = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
#: the C++ bindings behind ``torch.autograd.profiler.record_function``'s enter and exit
#: (private), or None
_SCOPE = tuple(getattr(torch._C._autograd, name, None) for name in
               ("_record_function_with_args_enter", "_record_function_with_args_exit"))
_SCOPE = _SCOPE if all(map(callable, _SCOPE)) else None


def profile_hook_step(func: Callable) -> Callable:
    """``func`` (an optimizer's ``step``) with torch's hooks and profiler scope around it."""
    profiled = torch.optim.Optimizer.profile_hook_step(func)
    if _SCOPE is None or \
            not all(isinstance(getattr(torch_optimizer, name, None), dict) for name in _GLOBAL_STEP_HOOKS):
        return profiled
    enter_scope, exit_scope = _SCOPE

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():  # (Dynamo traces torch's scope, not the binding)
            return profiled(*args, **kwargs)
        self = args[0]
        scope = enter_scope(f"Optimizer.step#{self.__class__.__name__}.step")
        try:
            pre_hooks, post_hooks = (getattr(torch_optimizer, name) for name in _GLOBAL_STEP_HOOKS)
            args, kwargs = _run_pre_hooks(chain(pre_hooks.values(), self._optimizer_step_pre_hooks.values()),
                                          func, self, args, kwargs)
            out = func(*args, **kwargs)
            self._optimizer_step_code()
            for post_hook in chain(self._optimizer_step_post_hooks.values(), post_hooks.values()):
                post_hook(self, args, kwargs)
            return out
        finally:
            exit_scope(scope)

    return wrapper


def _run_pre_hooks(hooks, func, optimizer, args, kwargs) -> tuple:
    """The step's (args, kwargs) after each pre-hook, which may replace them (torch's rule and message)."""
    for pre_hook in hooks:
        result = pre_hook(optimizer, args, kwargs)
        if result is not None:
            if isinstance(result, tuple) and len(result) == 2:
                args, kwargs = result
            else:
                raise RuntimeError(f"{func} must return None or a tuple of (new_args, new_kwargs), "
                                   f"but got {result}.")
    return args, kwargs
