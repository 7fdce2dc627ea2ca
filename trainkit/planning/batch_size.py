"""``find_batch_size``: the largest global batch whose compiled train step fits the device
memory, found from the compiler's memory analysis (:mod:`trainkit.planning.plan`), never by
running into an out-of-memory error. Every process compiles the same steps against the same
limit (the smallest of the processes'), so all get the same answer without a trial run that
one of them might fail alone.

The search is a bisection over the candidate sizes (powers of two times the smallest batch the
strategy can split, by default), which assumes that a larger batch never needs less memory:
``ceil(log2(n + 1))`` compiles for ``n`` sizes. It ends on a size that fits next to the next size
up, which does not (or on the largest size allowed).

>>> sizes = candidate_sizes(8, 100)
>>> sizes, bisect(sizes, lambda size: size <= 40)
([8, 16, 32, 64], 2)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from trainkit import distributed
from trainkit.planning import ladder as ladder_lib
from trainkit.planning import plan as plan_lib
from trainkit.strategies import Strategy


def candidate_sizes(unit: int, max_batch_size: int, powers_of_two: bool = True, rows: int | None = None) -> list[int]:
    """The sizes searched: ``unit * 2**k`` (or every multiple of ``unit``) up to ``max_batch_size``,
    and no larger than the data (``rows``, when known): its one batch of all rows, rounded up to
    a multiple of ``unit``, is the last size, as ``fit`` caps a larger batch there.

    >>> candidate_sizes(8, 2**16, rows=1500)[-3:]
    [512, 1024, 1504]
    """
    if max_batch_size < unit:
        raise ValueError(
            f"max_batch_size={max_batch_size} is below {unit}, the smallest batch the strategy can split "
            "(its devices x grad_accum_steps): pass a larger max_batch_size."
        )
    whole = None if rows is None else -(-rows // unit) * unit  # one batch of all the data
    if whole is not None and whole <= max_batch_size:
        sizes = candidate_sizes(unit, whole, powers_of_two)
        return sizes if sizes[-1] == whole else [*sizes, whole]
    if not powers_of_two:
        return list(range(unit, max_batch_size + 1, unit))
    sizes = [unit]
    while sizes[-1] * 2 <= max_batch_size:
        sizes.append(sizes[-1] * 2)
    return sizes


def bisect(sizes: Sequence[int], fits: Callable[[int], bool]) -> int:
    """The index of the largest size that ``fits`` (``-1``: none), calling ``fits`` on
    ``ceil(log2(len(sizes) + 1))`` sizes at most; ``fits`` must be monotone (true, then false)."""
    low, high = -1, len(sizes)  # sizes[low] fits (or none is known to), sizes[high] does not (or past the end)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(sizes[middle]):
            low = middle
        else:
            high = middle
    return low


@dataclasses.dataclass(frozen=True)
class BatchSizeSearch:
    """What :meth:`trainkit.Trainer.find_batch_size` found.

    Attributes:
        batch_size: the largest global batch that fits (use it as ``fit(batch_size=...)``).
        strategy: the strategy the answer's plan recommends (``"auto"``'s pick at that batch).
        memory_limit: the per-device bytes searched against (the plan keeps ``headroom`` of it free).
        needed: per-device bytes of each compiled size (the best candidate's), by batch size.
        seconds: the whole search; ``compile_seconds``: each size's plan.
        plans: each compiled size's :class:`~trainkit.planning.plan.MemoryPlan` (under the measure, if added).
        added: the memory measure the answer needs (``"remat"``, ...; :mod:`trainkit.planning.ladder`): not even
            the smallest batch fit without it. ``None``: none.
        headroom: the fraction of ``memory_limit`` kept free (``find_batch_size(headroom=...)``).
    """

    batch_size: int
    strategy: str
    memory_limit: int
    needed: dict[int, int]
    seconds: float
    compile_seconds: dict[int, float]
    plans: dict[int, plan_lib.MemoryPlan] = dataclasses.field(repr=False)
    added: str | None = None
    headroom: float = 1 - plan_lib.HEADROOM

    def __int__(self) -> int:
        return self.batch_size

    def __str__(self) -> str:
        budget = (1 - self.headroom) * self.memory_limit
        tried = ", ".join(
            f"{size}: {plan_lib.gib(need)}{'' if need <= budget else ' (too big)'}"
            for size, need in sorted(self.needed.items())
        )
        largest = " (the largest size allowed)" if self.batch_size == max(self.needed) else ""
        return (
            f"batch_size={self.batch_size}{largest} on {self.strategy}: {plan_lib.gib(self.needed[self.batch_size])} "
            f"per device, within {1 - self.headroom:.0%} of {plan_lib.gib(self.memory_limit)} (a headroom of "
            f"{self.headroom:.0%} kept free: find_batch_size(headroom=...); compiled: {tried}); "
            f"{len(self.plans)} compiles in {self.seconds:.2f} s"
            + (f" (added {self.added}: not even the smallest batch fit without it)" if self.added else "")
        )


def search(
    plan_at: Callable[[int, int, Sequence[Strategy] | None], plan_lib.MemoryPlan],
    sizes: Sequence[int],
    memory_limit: int | None,
    default_limit: int,
    rungs: Callable[[], list[ladder_lib.Rung]] | None = None,
    headroom: float = 1 - plan_lib.HEADROOM,
) -> BatchSizeSearch:
    """Bisects ``sizes`` with ``plan_at(size, limit, candidates)`` (a plan of the train step at a
    global batch of ``size`` rows against ``limit`` bytes per device, under ``candidates``, or
    ``None``: the trainer's own); a size fits when its plan recommends a strategy. The limit is
    the smallest of the processes' (``memory_limit``, else each one's ``default_limit``).

    When not even the smallest size fits, each of ``rungs()`` (:mod:`trainkit.planning.ladder`,
    cheapest first) is applied to the candidates that were only too big there, and the first
    under which the smallest size fits is bisected: the answer's strategy carries the measure,
    and ``added`` names it. ``headroom``: the fraction of the limit the plans keep free (said in the answer)."""
    limit = min(int(v) for v in distributed.gather_json(int(memory_limit or default_limit)))
    start, seconds = time.perf_counter(), {}

    def bisected(among: Sequence[Strategy] | None) -> tuple[int, dict[int, plan_lib.MemoryPlan]]:
        plans: dict[int, plan_lib.MemoryPlan] = {}

        def fits(size: int) -> bool:
            began = time.perf_counter()
            plans[size] = plan_at(size, limit, among)
            seconds[size] = time.perf_counter() - began
            return plans[size].recommended is not None

        if among is None:
            return bisect(sizes, fits), plans
        if not fits(sizes[0]):  # a measure: the smallest size first, one compile
            return -1, plans
        return 1 + bisect(sizes[1:], fits), plans

    index, plans = bisected(None)
    first, added, tried = plans, None, []
    too_big = [row.strategy for row in plans[sizes[0]].rows if row.too_big] if index < 0 else []
    for rung in rungs() if rungs is not None and too_big else []:
        among = [measured for measured in map(rung.applied, too_big) if measured is not None]
        if among:
            index, plans = bisected(among)
            tried.append(rung.name)
            if index >= 0:
                added = rung.name
                break
    if index < 0:
        nor = f" (nor with {' or '.join(tried)})" if tried else ""
        smallest = f"{sizes[0]} row{'s' if sizes[0] > 1 else ''}"
        raise ValueError(
            f"Not even the smallest batch, {smallest}, fits{nor}: {first[sizes[0]].reason()}. Pass remat='full', a "
            "lower precision or grad_accum_steps=k, a strategy that shards the state (FSDP), or a larger memory_limit."
        )
    best = plans[sizes[index]].recommended
    assert best is not None  # the size fits: it has a recommended row
    answer = min(distributed.gather_json(sizes[index]))  # the same everywhere, as it must be
    elapsed = time.perf_counter() - start
    return BatchSizeSearch(answer, best.name, limit, _needed(plans), elapsed, seconds, plans, added, headroom)


def _needed(plans: dict[int, plan_lib.MemoryPlan]) -> dict[int, int]:
    """The bytes per device each planned size needs: its recommended row's, else its smallest row's."""
    needed = {}
    for size, plan in plans.items():
        rows = [r for r in plan.rows if r.error is None]
        chosen = plan.recommended or min(rows, key=lambda r: r.total_bytes, default=None)
        if chosen is not None:
            needed[size] = chosen.total_bytes
    return needed
