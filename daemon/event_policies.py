"""Which models the parser admits, their validation policies and their ``k``. Pure: no I/O.

:class:`ModelPolicies` is the parser's per-model state. ``policy_for(model)`` (the daemon's
settings) gives a model's :class:`~daemon.event_records.ModelPolicy`, or None to reject it as
``unknown_model``; ``max_models`` bounds how many distinct models are admitted (the first ones
seen, plus those restored with :meth:`ModelPolicies.admit`). A model's ``k`` comes from its
policy or, when the policy has none, is learned from its first vector by the general parse path
(:mod:`daemon.event_general`).

Memory is bounded in the number of admitted models: policies are cached for every admitted
model, and for at most :data:`OTHER_POLICIES` others (rejected, or not admitted yet), oldest
forgotten first, so that a stream of distinct model names does not grow the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, KeysView, Sequence
from itertools import repeat
from operator import is_

from daemon.event_records import ModelPolicy

__all__ = ["OTHER_POLICIES", "ModelPolicies"]

OTHER_POLICIES = 4096    # policies cached for models that are not admitted
_UNKNOWN = object()


class ModelPolicies:
    """Admission, policies and ``k`` of the models a parser has seen.

    Parameters
    ----------
    policy_for : callable
        ``policy_for(model)`` -> :class:`ModelPolicy`, or None to reject the model.
    max_models : int or None
        At most this many models are admitted by :meth:`admit_new` (None: no bound).

    Attributes
    ----------
    admitted : set of str
        The admitted models.
    k : dict
        Each model's ``k``: configured, learned, or restored with :meth:`set_k`.
    """

    __slots__ = ("_canon", "_others", "_policies", "_policy_for", "admitted", "k",
                 "max_models")

    def __init__(self, policy_for: Callable[[str], ModelPolicy | None],
                 max_models: int | None = None):
        self._policy_for = policy_for
        self.max_models = max_models
        #: policies of admitted models (as many as are admitted: bounded by ``max_models`` plus
        #: the models restored) and, at most :data:`OTHER_POLICIES` of them, of other models
        #: (rejected, or not admitted yet), oldest forgotten first
        self._policies: dict[str, ModelPolicy | None] = {}
        self._others: dict[str, ModelPolicy | None] = {}
        # one object per distinct policy of the admitted models: a batch of many models
        # tells "one policy" by identity (no hashing per model)
        self._canon: dict[ModelPolicy, ModelPolicy] = {}
        self.k: dict[str, int] = {}
        self.admitted: set[str] = set()

    # ---------------------------------------------------------------- mutators
    def admit(self, model: str, k: int | None = None) -> None:
        """Admit ``model`` (e.g. restored from a checkpoint), optionally with its learned ``k``.
        Not bounded by ``max_models``."""
        self.admitted.add(model)
        if k:
            self.set_k(model, k)
        pol = self._others.pop(model, _UNKNOWN)
        if pol is not _UNKNOWN:
            self._cache(model, pol)

    def set_k(self, model: str, k: int) -> None:
        """Set ``model``'s learned ``k``; ``0`` (a state whose outcomes came first) is none."""
        if k:
            self.k[model] = int(k)

    def admit_new(self, model: str, pol: ModelPolicy) -> bool:
        """Admit ``model`` (not admitted yet, policy ``pol``) unless ``max_models`` models
        already are; False if not admitted."""
        if self.max_models is not None and len(self.admitted) >= self.max_models:
            return False
        self.admitted.add(model)
        self._cache(model, pol)
        return True

    def admit_all(self, new_models: Iterable[str],
                  looked_up: Iterable[tuple[str, ModelPolicy | None]]) -> None:
        """Commit what a batch looked up with :meth:`peek`: admit ``new_models`` (checked with
        :meth:`has_room`) and cache the ``(model, policy)`` pairs of ``looked_up``, as
        :meth:`policy` and :meth:`admit_new` would have one model at a time."""
        self.admitted.update(new_models)
        for model, pol in looked_up:
            self._cache(model, pol)

    # ---------------------------------------------------------------- queries
    def policy(self, model: str) -> ModelPolicy | None:
        """``model``'s policy (None: rejected), looked up once and cached."""
        pol = self._policies.get(model, _UNKNOWN)
        if pol is _UNKNOWN:
            pol = self._others.get(model, _UNKNOWN)
            if pol is _UNKNOWN:
                pol = self._policy_for(model)
                self._cache(model, pol)
        return pol

    def peek(self, model: str) -> tuple[ModelPolicy | None, bool]:
        """``(policy, cached)``: ``model``'s policy with nothing changed; ``cached`` False when
        it is not yet cached as an admitted model's (then :meth:`admit_all` caches it)."""
        pol = self._policies.get(model, _UNKNOWN)
        if pol is not _UNKNOWN:
            return pol, True
        pol = self._others.get(model, _UNKNOWN)
        if pol is _UNKNOWN:
            pol = self._policy_for(model)
        return pol, False

    def cached(self, models: Sequence[str]) -> list[ModelPolicy] | None:
        """The policies of ``models`` when every one is cached as an admitted model's and none
        rejects it (then :meth:`peek` would return each with ``cached`` True), else None. A
        few C-level passes: no Python work per model. Equal policies are one object."""
        out = list(map(self._policies.get, models))  # None: not cached, or rejected
        if any(map(is_, out, repeat(None))):
            return None
        return out

    def has_room(self, n_new: int) -> bool:
        """Whether ``n_new`` more models can be admitted under ``max_models``."""
        return self.max_models is None or len(self.admitted) + n_new <= self.max_models

    def cached_admitted(self) -> KeysView[str]:
        """The models whose policy is cached as admitted (always within :attr:`admitted`)."""
        return self._policies.keys()

    def n_cached_others(self) -> int:
        """How many policies of models not admitted are cached (at most
        :data:`OTHER_POLICIES`)."""
        return len(self._others)

    # ---------------------------------------------------------------- internals
    def _cache(self, model: str, pol: ModelPolicy | None) -> None:
        """Remember ``model``'s policy (and, once admitted, its configured ``k`` unless one is
        known). Policies of models not admitted go to a bounded cache (200,000 distinct model
        names grew an unbounded one by 127 MiB)."""
        if model in self.admitted:
            self._others.pop(model, None)
            self._policies[model] = pol if pol is None else self._canon.setdefault(pol, pol)
            if pol is not None and pol.k is not None:
                self.k.setdefault(model, int(pol.k))
            return
        others = self._others
        if model not in others and len(others) >= OTHER_POLICIES:
            del others[next(iter(others))]
        others[model] = pol
