"""A hybrid model's KV cache groups: which of a replica's events the index follows.

vLLM (0.33) announces a block once per KV cache group (``group_idx``), and says each group's kind
on its stores (``kv_cache_spec_kind``, vLLM's ``KVCacheSpecKind``; a removal carries the group
only, so a replica's groups are remembered from its stores). The groups evict on their own, and
the kinds hold different things:

- full attention (``full_attention``, ``mla_attention``, ``sink_full_attention``): every block of
  the prompt, a prefix chain. A prefix is reusable on a replica only where **every** such group
  holds it (vLLM's hybrid coordinator looks a prompt up in each and takes the shortest hit). The
  index follows the stores of the lowest-numbered full-attention group (the others announce the
  same hashes), and the removals of **all** of them: a block one of them evicted is no longer a
  hit there, whatever the others hold, so the replica stops holding it;
- sliding window (``sliding_window``, ``sliding_window_mla``, ``chunked_local_attention``) and
  state (``mamba``): blocks that are no prefix chain (only the last window, or the state at some
  positions, is kept); their events are counted (``other_group``) and change nothing held. A hit
  also needs them (the window before the hit point, the state at it), which kvlens does not check:
  for a hybrid model what the index holds is an upper bound of what a replica could reuse;
- anything else (``encoder_only_attention``, ``cross_attention``, ``unknown``, a kind vLLM adds
  later, or a group whose kind was never seen) is not followed either.

An event without a group (older vLLM, SGLang, TensorRT-LLM) is group 0, and group 0 without a
kind is full attention (a model of one group: what every engine before 0.33 sent). vLLM 0.33's
GPU block pool sends ``group_idx`` but no kind (only its CPU offload's stores name one), and
numbers a hybrid model's groups in the order their kinds first appear among the layers, so a
model whose first layer is a sliding-window one has the window's group as group 0: the kinds
are then **declared** (``declared``, the fleet's model's groups as the engine's
``get_kv_cache_group_metadata()`` names them), every replica's groups taken from them until a
store of its own names a group's kind. A replica with any other group or kind (declared or said)
is **hybrid**: its payloads are read by msgspec (the compiled reader leaves every event of another
group or kind), since its removals of group 0 need the group's kind, which the compiled reader
does not keep.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

PREFIX_KINDS: Final = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
WINDOW_KINDS: Final = frozenset({"sliding_window", "sliding_window_mla", "chunked_local_attention"})
STATE_KINDS: Final = frozenset({"mamba"})
MAX_GROUPS: Final = 64  # groups remembered a replica (vLLM's models have a handful); past it: not followed
MAX_KIND_CHARS: Final = 64  # a longer kind is kept as "unknown" (no engine's name is that long)

FOLLOW: Final = "follow"  # applied to the index
OTHER: Final = "other"  # counted as another group's, not applied


class KVCacheGroups:
    """Each replica's groups and their kinds, as its stores said (bounded: :data:`MAX_GROUPS` a
    replica); fed and read under the index's lock."""

    def __init__(self, declared: Sequence[str] = ()) -> None:
        """``declared``: each group's kind, by group number, for every replica (none: learnt from
        the stores only)."""
        if len(declared) > MAX_GROUPS:
            raise ValueError(f"at most {MAX_GROUPS} KV cache groups can be declared")
        self._declared = {number: _kept(kind) for number, kind in enumerate(declared)}
        self._kinds: dict[str, dict[int, str]] = {}
        self._followed: dict[str, int] = {}  # the lowest full-attention group, when not 0
        self.hybrid: set[str] = set()
        # declared other than one full-attention group: every replica is hybrid
        self._all_hybrid = len(declared) > 1 or any(kind not in PREFIX_KINDS for kind in declared)
        self._declared_followed = _lowest_prefix(self._declared)

    def is_hybrid(self, replica: str) -> bool:
        """Whether ``replica``'s payloads need the groups' kinds (msgspec's path)."""
        return self._all_hybrid or replica in self.hybrid

    def role(self, replica: str, group: int | None, kind: str | None, *, store: bool) -> str:
        """:data:`FOLLOW` or :data:`OTHER` for an event of ``group`` (``kind`` as a store says it;
        None on removals)."""
        number = 0 if group is None else group
        if kind is not None or number != 0:
            self._learn(replica, number, kind)
        kinds = self._kinds.get(replica, self._declared)
        known = kinds.get(number)
        prefix = known in PREFIX_KINDS or (known is None and number == 0)
        if not prefix:
            return OTHER
        if store:
            return FOLLOW if number == self._followed.get(replica, self._declared_followed) else OTHER
        return FOLLOW

    def _learn(self, replica: str, number: int, kind: str | None) -> None:
        if number != 0 or kind not in PREFIX_KINDS:
            self.hybrid.add(replica)
        kinds = self._kinds.setdefault(replica, dict(self._declared))
        if kind is None or (number not in kinds and len(kinds) >= MAX_GROUPS):
            return
        kinds[number] = _kept(kind)
        self._followed[replica] = _lowest_prefix(kinds)

    def forget(self, replica: str) -> None:
        """A replica gone: what its stores said goes (the declared kinds stay, for every one)."""
        self._kinds.pop(replica, None)
        self._followed.pop(replica, None)
        self.hybrid.discard(replica)


def _kept(kind: str) -> str:
    return kind if len(kind) <= MAX_KIND_CHARS else "unknown"


def _lowest_prefix(kinds: dict[int, str]) -> int:
    """The group whose stores are followed: the lowest full-attention one (group 0 when no kind is
    said for it: full attention, as before 0.33; 0 when none is, and then none is followed)."""
    prefix = [group for group, kind in kinds.items() if kind in PREFIX_KINDS]
    if 0 not in kinds:
        prefix.append(0)
    return min(prefix) if prefix else 0
