"""The torch.optim API shared by the bf16opt optimizers, and phase two of a step.

``MixedPrecisionOptimizer`` owns param groups (validation, per-group ``precision`` and
``backend``) and lazily created state; it names no buffer.  What an update reads and writes
is its :class:`~bf16opt.algorithms.Algorithm` (``algorithm``).  A step has two phases:

1. **Plan** (nothing changes): a group whose launch was kept from its last step reuses it
   after bulk checks (``step_cache.py``); any other group is planned in full
   (``step_plan.py``): states found, converted or made aside, buckets checked, kernels compiled.
2. **Install and run** (:meth:`_step_without_grad`): raises on no user input.

So a call that raises (``step``, ``load_state_dict``, ``add_param_group``, the constructor)
leaves params, state, param groups and hooks exactly as they were.  State dicts live in
``state_dict.py``, argument checks in ``checks.py``, GradScaler's protocol in ``amp.py``; the
subclasses (``adam.py``, ``lion.py``, ``sgd.py``) add hyper-parameter checks, flags and the
per-step float32 scalars; the math lives in ``backends/reference.py`` and the kernels.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Callable, Iterator, Optional

import torch

from . import state_dict as state_dicts
from . import capture, clipping, release, step_cache, step_hooks
from .algorithms import Algorithm, KernelConfig, kernel_config
from .amp import amp_arguments, captured_amp
from .backends import backend_name, check_backend_name, resolve_backend
from .checks import (check_flag, check_implementation_flags, check_no_aliasing, check_number, check_ordered_params,
                     check_param, check_param_names, check_seed, default_seed)
from .offload import Offloader, check_offload
from .offload_copies import phase
from .precision import Precision, as_precision, plan_for
from .step_plan import float64_backend, plan_conversions, plan_step

_IMMUTABLE = frozenset((bool, int, float, str, type(None), Precision))


def _immutable(value) -> bool:
    """Whether ``value`` cannot change in place (exact types: a subclass could)."""
    kind = type(value)
    return kind in _IMMUTABLE or (kind is tuple and all(map(_immutable, value)))


#: autograd's grad mode switched directly (private; what ``torch.set_grad_enabled`` calls,
#: without making its context-manager object), else torch's
_set_grad_mode = getattr(torch._C, "_set_grad_enabled", None) or torch.set_grad_enabled


class MixedPrecisionOptimizer(torch.optim.Optimizer):
    """Base of :class:`bf16opt.Adam`, :class:`bf16opt.AdamW`, :class:`bf16opt.Lion` and
    :class:`bf16opt.SGD`."""

    #: the update's kernel description (``algorithms.py``); a state dict only loads into an
    #: optimizer of the same algorithm
    algorithm: Algorithm

    #: torch.amp.GradScaler.step hands this optimizer the loss scale and the inf check
    #: (``amp.py``) instead of unscaling the grads itself
    _step_supports_amp_scaling = True

    #: hyper-parameters every saved param group of this optimizer kind has, and ones that
    #: betray another kind (e.g. Adam's eps in a state dict offered to Lion); an empty
    #: state cannot tell the kinds apart, the groups can
    _SAVED_GROUP_KEYS: tuple = ()
    _FOREIGN_GROUP_KEYS: tuple = ()

    #: torch's step wrapper (hooks and profiler scope), entered through its C++ bindings
    profile_hook_step = staticmethod(step_hooks.profile_hook_step)

    def __init__(self, params, defaults: dict):
        if defaults.get("seed") is None:  # stochastic rounding's streams differ between optimizers
            defaults = {**defaults, "seed": default_seed()}
        self._check_hyperparameters(dict(defaults))
        check_ordered_params(params)
        self.__dict__["_constructing"] = True  # offload hooks wait until every group is accepted
        try:
            super().__init__(params, defaults)
        finally:
            del self.__dict__["_constructing"]
        release.check_sole_owner(self, self.param_groups)
        release.register(self)
        self._record_offloaded([p for group in self.param_groups if group.get("offload") == "cpu"
                                for p in group["params"]])
        self._sync_release_hooks()

    # ---- subclass interface
    def _check_hyperparameters(self, group: dict) -> None:
        raise NotImplementedError

    def _flags(self, group: dict) -> dict:
        """The algorithm's flags for a group (e.g. ``{"amsgrad": False, "maximize": True}``)."""
        raise NotImplementedError

    def _fresh_flags(self, created: set) -> dict:
        """Flags of a param whose state buffers ``created`` were made at this step."""
        return {}

    def _scalars(self, group: dict, step: int):
        """The step's float32 scalars (a NamedTuple of ``algorithm.scalars``)."""
        raise NotImplementedError

    def _live_rates(self, group: dict) -> tuple:
        """A live step's (capture.py) decoupled weight-decay rate, and the betas whose bias
        corrections it reads from a table by step, or None where the update has none."""
        raise NotImplementedError

    def _force_group_entries(self, group: dict) -> None:
        """Entries a subclass pins whatever the state dict says (AdamW: decoupled decay)."""

    # ---- param groups
    def add_param_group(self, param_group: dict) -> None:
        """Add a param group after checking its params and hyper-parameters.

        Accepts ``"precision"`` and ``"backend"`` per group, like any hyper-parameter.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        if "params" not in param_group:
            raise ValueError("param_group must have a 'params' entry (a tensor or a list of tensors)")
        group = dict(param_group)
        params = group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        check_ordered_params(params)
        params = list(params)
        named = [isinstance(p, tuple) and len(p) == 2 for p in params]
        if all(named) and params:  # (a mix: torch's own ValueError below)
            check_param_names([p[0] for p in params], len(params))
        tensors = [p[1] if is_named else p for p, is_named in zip(params, named)]
        names = [f"params[{i}] ({p[0]!r})" if is_named else f"params[{i}]"
                 for i, (p, is_named) in enumerate(zip(params, named))]
        for key, default in self.defaults.items():
            group.setdefault(key, default)
        for param, name in zip(tensors, names):
            check_param(param, name)
        groups = getattr(self, "param_groups", [])
        existing = [p for g in groups for p in g["params"]]
        check_no_aliasing(existing + tensors,
                          [f"a param of group {i}" for i, g in enumerate(groups) for _ in g["params"]]
                          + [f"{name} of the new group" if existing else name for name in names])
        devices = {p.device for p in tensors}
        if len(devices) > 1:
            raise ValueError(f"params of one param group must be on one device, got "
                             f"{sorted(str(d) for d in devices)}; put each device in its own group")
        self._check_group(group, tensors)
        if not self.__dict__.get("_constructing"):
            release.check_sole_owner(self, [*groups, {**group, "params": tensors}])
        group["params"] = params
        super().add_param_group(group)
        if self.__dict__.get("_constructing"):
            return
        try:
            if group.get("offload") == "cpu":
                self._record_offloaded(tensors)
            self._sync_release_hooks()
        except BaseException:
            self.param_groups.pop()
            if group.get("offload") == "cpu" and "_offloader_instance" in self.__dict__:
                self._offloader.release(self._offloaded_params())  # (the new params' records, if made)
            self._sync_release_hooks()
            raise

    def _offloaded_params(self) -> set:
        return {p for g in self.param_groups if g.get("offload") == "cpu" for p in g["params"]}

    def _record_offloaded(self, params: list) -> None:
        """Host buffers and grad hooks of newly offloaded params (grads start leaving during the
        first backward); on failure, those made here are released again."""
        if not params:
            return
        made = "_offloader_instance" not in self.__dict__
        try:
            for param in params:
                self._offloader.record(param)
        except BaseException:
            self._offloader.release(self._offloaded_params() - set(params))
            if made:
                del self.__dict__["_offloader_instance"]
            raise

    def _check_group(self, group: dict, params: list) -> None:
        """Validate and normalise a group in place (precision, backend, hyper-parameters)."""
        group["precision"] = self._checked_precision(group)
        check_param_names(group.get("param_names"), len(params))
        clipping.check_whole_params(group.get(clipping.KEY), params)
        for param in params:
            plan_for(group["precision"], param.dtype.to_real())  # rejects invalid dtype combinations
            if param.dtype.to_real() == torch.float64:
                float64_backend(group["backend"])
        for device in {p.device for p in params}:
            resolve_backend(group["backend"], device)

    def _checked_precision(self, group: dict) -> Precision:
        """The group's settings checked without changing anything; its Precision.

        A user may edit a group between steps (lr by a scheduler, or precision and
        backend by hand): everything is checked again here, before any param moves.
        """
        precision = as_precision(group["precision"])
        check_backend_name(group["backend"])
        check_offload(group.get("offload"), group.get("offload_threads"))
        if group.get("offload") == "cpu" and group["backend"] == "cupy":
            raise ValueError("backend='cupy' updates state on the GPU; with offload='cpu' the state "
                             "lives in host RAM and is updated by backend='numba' (or 'auto')")
        check_implementation_flags(group)
        capture.check_group(group)
        check_flag(group.get("track_precision", False), "track_precision")
        check_flag(group.get(release.KEY, False), release.KEY)
        if release.BUCKET_KEY in group:
            group[release.BUCKET_KEY] = release.check_bucket(group[release.BUCKET_KEY])  # (numpy ints: ints)
        clipping.check_max_norm(group.get(clipping.KEY))
        if "seed" in group:
            group["seed"] = check_seed(group["seed"])  # numpy integers become ints
        if group.get("sr_streams", "position") != "position":
            raise ValueError(f"sr_streams may only be 'position' (random streams named by position, as "
                             f"in format-1 state dicts), got {group['sr_streams']!r}")
        self._check_hyperparameters(group)
        return precision

    def _group_precision(self, number: int, group: dict) -> Precision:
        """:meth:`_checked_precision` of group ``number``, remembered while the group holds
        the same keys and the same values (identical objects, each of an immutable type: a
        list or tensor hyper-parameter can change in place, and is checked at every step).
        The checks read nothing but the group's values (its params aside).  A new float lr
        alone (an lr scheduler sets one every step) is checked alone: the full checks would
        pass all else as before, and raise on a bad lr with the same message."""
        memo = self._side_dict("_checked_groups")
        values = list(group.values())
        kept = memo.get(number)
        if kept is not None and kept[0] is group and list(group) == kept[1]:
            if step_cache.same_objects(values, kept[2]):
                return kept[3]
            at = kept[4]  # (lr's place in the group)
            if type(values[at]) is float and step_cache.same_objects(values[:at], kept[2][:at]) \
                    and step_cache.same_objects(values[at + 1:], kept[2][at + 1:]):
                check_number(values[at], "lr", "learning rate")
                memo[number] = (group, kept[1], values, kept[3], at)
                return kept[3]
        precision = self._checked_precision(group)
        if all(map(_immutable, (value for key, value in group.items() if key != "params"))):
            keys = list(group)  # (after seed's normalisation)
            memo[number] = (group, keys, list(group.values()), precision, keys.index("lr"))
        else:
            memo.pop(number, None)
        return precision

    # ---- state
    def _state_config(self, group: dict, param: torch.Tensor, numel: int) -> KernelConfig:
        """The configuration a param's state is kept for (state_dict.py converts into it);
        ``param``: its real view; ``numel``: the whole param's element count."""
        return kernel_config(self.algorithm, plan_for(as_precision(group["precision"]), param.dtype, numel),
                             tuple(self._flags(group).items()), bool(group.get("track_precision")))

    @property
    def _offloader(self) -> Offloader:
        """The host side of the offloaded groups (made at the first one)."""
        offloader = self.__dict__.get("_offloader_instance")
        if offloader is None:
            offloader = self.__dict__["_offloader_instance"] = Offloader(self)
        return offloader

    @property
    def _state_configs(self) -> dict:
        """param -> ((KernelConfig, device, offloaded) its state was last made or checked for, the
        state's tensors then): a cache, trusted while the state holds the same tensors."""
        return self._side_dict("_state_config_cache")

    @property
    def _group_launches(self) -> dict:
        """group number -> the group's launch kept for the next steps (step_cache.py)."""
        return self._side_dict("_group_launch_cache")

    @property
    def _precision_counts(self) -> dict:
        """param -> (numel, telemetry counts of its last step)."""
        return self._side_dict("_telemetry")

    def _side_dict(self, name: str) -> dict:
        """A dict kept beside torch's attributes; torch's pickling drops it, so it is made
        again on first use."""
        return self.__dict__.setdefault(name, {})

    # ---- step
    def step(self, closure: Optional[Callable[[], Any]] = None, *, grad_scale: Optional[torch.Tensor] = None,
             found_inf: Optional[torch.Tensor] = None):
        """Perform a single optimization step; ``closure`` re-evaluates the model (optional).

        ``grad_scale``: the loss scale the grads carry (a one-element float32 tensor); the
        kernels multiply every grad by float32(1 / grad_scale) as they read it.
        ``found_inf``: a one-element float32 tensor; non-zero skips the step (params, state
        and step counters unchanged).  torch.amp.GradScaler passes both as attributes
        (``_step_supports_amp_scaling``); a step called by hand may pass them here.
        """
        if torch.compiler.is_compiling():  # (Dynamo is tracing this frame)
            return _step_outside_compile(self, closure, grad_scale, found_inf)
        return self._step(closure, grad_scale, found_inf)  # (eager: without the exclusion's wrappers)

    def _step(self, closure, grad_scale, found_inf):
        """The step, autograd off (as under ``torch.no_grad()``, switched directly: the
        decorator's context manager adds several Python calls to every step)."""
        if torch.is_inference_mode_enabled():  # (state made here must stay writable after it)
            with torch.inference_mode(False):
                return self._step(closure, grad_scale, found_inf)
        grad_enabled = torch.is_grad_enabled()
        _set_grad_mode(False)
        try:
            return self._step_without_grad(closure, grad_scale, found_inf)
        except BaseException:
            # GradScaler sets these before step() and deletes them only after one that returned:
            # left here, a retry would unscale by the scale squared
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise
        finally:
            _set_grad_mode(grad_enabled)

    def _step_without_grad(self, closure, grad_scale, found_inf):
        if capture.capturing():
            capture.check_optimizer(self)
        hooks = self.__dict__.get("_release_hooks")
        if (hooks is not None and hooks.hooked()) or release.wanted(self.param_groups):
            loss = self._release_step(closure, grad_scale, found_inf)
        else:
            loss = self._full_step(closure, grad_scale, found_inf)
        self.__dict__["_telemetry_ended"] = True  # (the next counts recorded begin a new step's)
        return loss

    def _full_step(self, closure, grad_scale, found_inf):
        amp = None
        if capture.capturing():  # GradScaler's tensors are read by the kernels, when the graph runs
            inv_grad_scale, skip, amp = 1.0, False, captured_amp(self, grad_scale, found_inf)
        else:
            inv_grad_scale, skip = amp_arguments(self, grad_scale, found_inf)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if skip:  # inf/NaN grads: GradScaler lowers its scale; no update, but edits convert the state
            self._install_and_run(plan_conversions(self))
            return loss
        reuse = step_cache.reused_step(self, inv_grad_scale)
        if reuse.ran:  # the step ran, its group's kept launch reused in one compiled call
            return loss
        if reuse.every_group_reuses(self.param_groups):
            for group, precision, _ in reuse.answers:
                group["precision"] = precision
            for _, _, run in reuse.answers:
                run()
            return loss
        self._install_and_run(plan_step(self, inv_grad_scale, reuse.answers, amp))
        return loss

    def _install_and_run(self, plan) -> None:
        """Phase two of a step or of an update in backward: nothing has changed so far, and
        nothing here raises on user input."""
        for group, precision in plan.precisions:
            group["precision"] = precision
        for param, state in plan.states.items():
            self.state[param] = state
        for param, buffers in plan.buffers.items():
            self.state[param].update(buffers)
        for param, new_param in plan.param_writes:
            param.copy_(new_param)
        for param, new_param in plan.mirror_writes:
            self._offloader.set_mirror(param, new_param)
        for param, known in plan.known.items():  # (with the state's tensors: a hand edit is checked again)
            self._state_configs[param] = (known, tuple(self.state[param].values()))
        for number, group, settings in plan.swept:
            self._side_dict("_idle_sweeps")[number] = (group, settings)
        if plan.offloaded is not None:  # params that left the offloaded groups free their host buffers
            self._offloader.release(plan.offloaded)
        self._run_launches(plan.clips, plan.launches, plan.reused, plan.found_inf)
        if plan.built or plan.stale_launches:
            self._keep_launches(plan.built)

    def _run_launches(self, clips: list, launches: list, reused: list = (),
                      found_inf: Optional[torch.Tensor] = None) -> None:
        """The kernels of a plan, after its grads' clipping, in group order: ``reused``, the
        (launches before it, phase two) of the groups reusing their kept launches, run among
        ``launches`` where their groups are (a param in two groups, or memory shared by params
        of two groups, is updated group by group, as the reference does).  Each launch's step
        counters advance with it (in one call), so a launch that raised, or a step stopped
        between launches (an interrupt), leaves each param either stepped or untouched."""
        for grad, factor, offloaded in clips:
            if offloaded is not None:  # (its host copy may still be arriving)
                self._offloader.wait_grad(offloaded)
            grad.mul_(factor)
        waiting = iter(reused)
        due, run = next(waiting, (None, None))
        for position, (bucket, launch, originals, counters) in enumerate(launches):
            while due == position:
                run()
                due, run = next(waiting, (None, None))
            if bucket.live is not None:  # (its kernels read the advanced counters)
                capture.advance_counters(counters, found_inf)
            launch()
            if bucket.live is None:  # (after: a launch that raised leaves its counters)
                capture.advance_counters(counters, found_inf)
            if bucket.counts is not None:
                self._record_counts(bucket, originals)
        while run is not None:
            run()
            due, run = next(waiting, (None, None))

    def _record_counts(self, bucket, originals: list) -> None:
        """Keep a launched bucket's telemetry under the user's params (the kernel's may be views
        or copies of them); the first record after a step ends forgets that step's."""
        if self.__dict__.pop("_telemetry_ended", False):
            self._precision_counts.clear()
        for param, original, counts in zip(bucket.params, originals, bucket.counts.tolist()):
            self._precision_counts[original] = (param.numel(), counts)

    # ---- update in backward (release.py)
    @property
    def _release(self) -> release.ReleaseHooks:
        """The hooks of the groups that update in backward (made at the first one)."""
        hooks = self.__dict__.get("_release_hooks")
        if hooks is None:
            hooks = self.__dict__["_release_hooks"] = release.ReleaseHooks(self)
        return hooks

    def _sync_release_hooks(self) -> None:
        hooks = self.__dict__.get("_release_hooks")
        if (hooks is not None and hooks.hooked()) or release.wanted(self.param_groups):
            self._release.sync(self.param_groups)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        release.register(self)  # (a copy's params are copies too)
        self._sync_release_hooks()  # (hooks are not pickled: a copy makes its own)

    @contextlib.contextmanager
    def accumulating(self) -> Iterator["MixedPrecisionOptimizer"]:
        """Grad accumulation with ``update_in_backward=True``: backwards run inside this block
        update nothing, so their grads add up in ``.grad`` as usual; the next backward outside
        it updates each param from the sum (or ``step()`` does, if no backward follows).
        Without update in backward it changes nothing."""
        hooks = self._release
        hooks.accumulating += 1
        try:
            yield self
        finally:
            hooks.accumulating -= 1

    def _release_step(self, closure, grad_scale, found_inf):
        """step() when a group updates in backward: completes the offloaded updates under way,
        refuses what cannot be right, then updates the params that still hold grads as a
        normal step would, and syncs the hooks."""
        self._finish_pending()
        scaler = any(getattr(self, name, None) is not None for name in ("grad_scale", "found_inf"))
        release.check_step(self.param_groups, closure, grad_scale, found_inf, scaler)
        release.check_sole_owner(self, self.param_groups)  # (a group switched on since)
        loss = self._full_step(closure, grad_scale, found_inf)
        self._sync_release_hooks()
        self._release.checked = False
        return loss

    def _update_in_backward(self, number: int, first_index: int, start: int, stop: int) -> None:
        """Update the params at ``start:stop`` of group ``number`` (the optimizer's param numbers
        from ``first_index + start``) from their grads, then free the grads: a bucket of the
        hooks, in backward.  Raises before anything changes."""
        grad_enabled = torch.is_grad_enabled()
        _set_grad_mode(False)
        try:
            self._check_release_groups()
            group = self.param_groups[number]
            with phase(release.PHASES["update"], group["params"][start].is_cuda):
                release.update(self, number, group, first_index, start, stop)
        finally:
            _set_grad_mode(grad_enabled)

    def _check_release_groups(self) -> None:
        """Every group's settings that updates in backward, checked once a backward (at its
        first update): a bad one raises from the first hook, before it updates any param."""
        hooks = self._release
        if not hooks.checked:
            for number, group in enumerate(self.param_groups):
                if group.get(release.KEY):
                    self._group_precision(number, group)
                    release.check_reduced_grads(group["params"], number)
            hooks.checked = True

    @property
    def _background(self) -> release.Background:
        """The thread of the offloaded updates in backward (made at the first)."""
        background = self.__dict__.get("_background_instance")
        if background is None:
            background = self.__dict__["_background_instance"] = release.Background(self)
        return background

    def _finish_pending(self) -> None:
        """Wait for the offloaded updates started in backward (re-raising an error of one)."""
        background = self.__dict__.get("_background_instance")
        if background is not None:
            background.finish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``, once the offloaded updates of the last backward are done (a
        backward that raised left them running); then the hooks of ``update_in_backward``
        follow the groups' settings (a group switched on updates from its next backward)."""
        self._finish_pending()
        if release.wanted(self.param_groups):
            release.check_sole_owner(self, self.param_groups)  # (a group switched on since)
        super().zero_grad(set_to_none)
        self._sync_release_hooks()

    def _keep_launches(self, built: list) -> None:
        """Keep the launches this step built for the next steps to reuse; forget those of
        groups that changed beyond reuse, or are gone, and what is kept of params no longer
        in the optimizer (their tensors are released)."""
        kept = self._group_launches
        for number, material in built:
            launch = None if material is None else step_cache.build(self, material)
            if launch is None:
                kept.pop(number, None)
            else:
                kept[number] = launch
        for number in [number for number in kept if number >= len(self.param_groups)]:
            del kept[number]
        self._forget_removed_params()

    def _forget_removed_params(self) -> None:
        """Forget what the side dicts hold of params no longer in any group (a group or param
        taken out of ``param_groups``): they must not keep its tensors alive."""
        for name in ("_checked_groups", "_idle_sweeps"):  # (they hold groups: and so their params)
            memo = self.__dict__.get(name)
            for number in [number for number in memo or () if number >= len(self.param_groups)]:
                del memo[number]
        caches = [self.__dict__[name] for name in ("_state_config_cache", "_telemetry", "_shard_offsets")
                  if self.__dict__.get(name)]
        if caches:
            live = {id(param) for group in self.param_groups for param in group["params"]}
            for cache in caches:
                for param in [param for param in cache if id(param) not in live]:
                    del cache[param]

    # ---- telemetry and inspection
    def precision_stats(self) -> dict:
        """Precision telemetry of the last step that updated tracked params (needs
        ``track_precision=True``).

        Returns ``{param index: {counter: fraction}}`` for the params that step updated, plus
        ``"total"`` over them, with the algorithm's counters: ``swallowed`` (non-zero updates that left
        the stored master weights unchanged) and ``<moment>_underflow`` (non-zero moments
        stored as zero), as fractions of each param's elements.
        """
        if not any(group.get("track_precision") for group in self.param_groups):
            raise RuntimeError("precision_stats() needs the optimizer built with track_precision=True")
        names = self.algorithm.counters
        stats, totals, elements = {}, [0] * len(names), 0
        index = 0
        for group in self.param_groups:
            for param in group["params"]:
                if param in self._precision_counts:
                    numel, counts = self._precision_counts[param]
                    stats[index] = {name: c / max(numel, 1) for name, c in zip(names, counts)}
                    totals = [t + c for t, c in zip(totals, counts)]
                    elements += numel
                index += 1
        stats["total"] = {name: t / max(elements, 1) for name, t in zip(names, totals)}
        return stats

    def __repr__(self) -> str:
        """torch's repr, with the backend each group's params run on (``backend="auto"`` resolved)."""
        text = super().__repr__()
        lines = text.split("\n")
        out, number = [], -1
        for line in lines:
            out.append(line)
            if line.startswith("Parameter Group "):
                number += 1
                out.append(f"    runs on: {self.group_backends()[number]}")
        return "\n".join(out)

    def group_backends(self) -> list:
        """The backend each param group runs on now, by name (``"numba"``, ``"cupy"`` or
        ``"reference"``; ``"auto"`` resolved for its params' device, offloaded groups on the
        host; ``"none"`` for a group without params).  float64 params run on the reference:
        a group of them is ``"reference"``, a group with others too, e.g.
        ``"numba (float64 params: reference)"``."""
        names = []
        for group in self.param_groups:
            params = group["params"]
            if not params:
                names.append("none")
                continue
            device = torch.device("cpu") if group.get("offload") == "cpu" else params[0].device
            wide = [p.dtype.to_real() == torch.float64 for p in params]
            name = "reference" if all(wide) else backend_name(group["backend"], device)
            mixed = name != "reference" and any(wide)
            names.append(f"{name} (float64 params: reference)" if mixed else name)
        return names

    # ---- state dict
    def state_dict(self) -> dict:
        """torch's state dict, with plain-type ``precision`` entries and a format tag.

        State tensors keep their storage dtypes (bf16 moments stay bf16); a q8 moment of a
        DTensor param is its rank's row of a rank table (``q8_sharded.py``), so that DCP saves
        every rank's blocks.
        """
        self._finish_pending()
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = OrderedDict()  # (run below, on the finished dict)
        try:
            saved = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        saved = state_dicts.save(saved, self.algorithm.name, type(self).__name__, self.param_groups)
        for hook in post_hooks.values():  # as torch: a hook may edit the dict or return another
            result = hook(self, saved)
            if result is not None:
                saved = result
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a bf16opt or torch.optim state dict, converting into this optimizer's dtypes.

        Hyper-parameters come from the state dict (as in torch); precision, backend and
        implementation flags stay this optimizer's own.  Every state tensor is encoded
        into the dtype this optimizer's precision gives it (round to nearest even), so
        a state dict saved with one preset, or by ``torch.optim``, loads into another.
        A master copy missing from the state dict is taken from the param.  The load writes a
        param only where its new plan keeps part of the master in it (a remainder plan), or
        where a master joined from a remainder is not the param's rounding (a copy plan); a
        saved copy leaves the param as it is, so a param edited since wins at the next step.
        Anything that does not fit raises before the optimizer changes.
        """
        if torch.is_inference_mode_enabled():  # (the loaded state must stay writable after it)
            with torch.inference_mode(False):
                return self.load_state_dict(state_dict)
        self._finish_pending()
        if isinstance(state_dict, dict):  # (as torch: hooks editing it leave the caller's dict alone)
            state_dict = state_dict.copy()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        plan = state_dicts.plan_load(self._load_target(), state_dict)
        self.param_groups[:] = plan.groups
        self.state = plan.state
        self._state_configs.clear()
        self._group_launches.clear()  # (they would be rebuilt anyway; this releases the old state now)
        if "_release_hooks" in self.__dict__:
            self._release.launches.clear()
            self._release.pending.clear()
        with torch.no_grad():
            for param, new_param in plan.param_writes:
                param.copy_(new_param)
        state_dicts.warn_if_older_format(plan)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _load_target(self) -> state_dicts.LoadTarget:
        def normalise_group(group: dict, params: list) -> None:
            self._force_group_entries(group)
            self._check_group(group, params)

        def in_use() -> set:  # (a state dict of another live optimizer is copied, not shared)
            return state_dicts.storages_of(state for other in release.other_optimizers(self)
                                           for state in other.state.values())

        return state_dicts.LoadTarget(type(self).__name__, self.algorithm.name, self.param_groups,
                                      self._SAVED_GROUP_KEYS, self._FOREIGN_GROUP_KEYS, normalise_group,
                                      self._state_config, lambda value: self._offloader.to_host(value),
                                      in_use)


def _run_step(optimizer: MixedPrecisionOptimizer, closure, grad_scale, found_inf):
    return optimizer._step(closure, grad_scale, found_inf)


# torch.compile: a step is Python bookkeeping around raw-pointer kernel calls (Numba, CuPy),
# which Dynamo cannot trace.  Excluded from tracing with torch's lazy wrapper, as torch.optim
# does; taken only while Dynamo traces ``step``, as an eager step needs none of its wrappers.
_step_outside_compile = torch._disable_dynamo(_run_step)


__all__ = ["MixedPrecisionOptimizer", "Precision"]
