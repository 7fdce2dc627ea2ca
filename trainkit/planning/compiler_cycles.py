"""The cycles a TPU's compiler estimates for a compiled program, summed as the program runs them.

A TPU's compiled text carries, per instruction, the compiler's own estimate of its cycles
(``"estimated_cycles"`` in its backend config). A step runs its entry computation's instructions
once, the one branch a conditional takes (a remat block's ``cond``), a loop's body as many times as
it turns (the compiler's known trip count, else the bound its condition compares with):
:func:`executed_cycles` sums them so, collectives left out (the plan times their bytes over the
links). The plan turns the sum into seconds at the rate a real step on the chip was measured to
retire them (``core.chips.Roofline.cycle_rate``).

>>> text = '''
... %branch_a (p: f32[]) -> f32[] {
...   %m = f32[] multiply(%p, %p), backend_config={"estimated_cycles":"40"}
... }
...
... %branch_b (p: f32[]) -> f32[] {
...   %n = f32[] negate(%p), backend_config={"estimated_cycles":"10"}
... }
...
... %cond (t: (s32[], f32[])) -> pred[] {
...   %bound = s32[] constant(12)
...   %i = s32[] get-tuple-element(%t), index=0
...   ROOT %lt = pred[] compare(%i, %bound), direction=LT
... }
...
... ENTRY %main (x: f32[], i: s32[]) -> f32[] {
...   %a = f32[] add(%x, %x), backend_config={"estimated_cycles":"5"}
...   %c = f32[] conditional(%i, %a, %a), branch_computations={%branch_a, %branch_b}
...   %r = f32[] all-reduce(%c), to_apply=%sum, backend_config={"estimated_cycles":"99"}
...   %w = (s32[], f32[]) while(%t), condition=%cond, body=%branch_b
... }
... '''
>>> executed_cycles(text), executed_cycles("ENTRY %main (x: f32[]) -> f32[] {\\n}\\n")
(165, None)
"""

from __future__ import annotations

import functools
import re

_ESTIMATED = re.compile(r'"estimated_cycles":"(\d+)"')
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_LOOP = re.compile(r"\swhile\(.*?condition=%([\w.\-]+), body=%([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CONSTANT = re.compile(r"%([\w.\-]+) = s32\[\]\S* constant\((\d+)\)")
_BELOW = re.compile(r"compare\(%[\w.\-]+, %([\w.\-]+)\), direction=LT")
#: the collectives' op names in compiled text (``plan`` times their bytes over the links)
COLLECTIVE_OPS = "all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute"
_COLLECTIVE = re.compile(rf"\s(?:{COLLECTIVE_OPS})(?:-start|-done)?\(")


def computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    """Each computation of a compiled module's text, by name, to its instruction lines; and the
    entry computation's name (``None``: the text has none)."""
    found: dict[str, list[str]] = {}
    current, entry = None, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            words = line.split(" ")
            current = words[1 if line.startswith("ENTRY") else 0].lstrip("%")
            entry = current if line.startswith("ENTRY") else entry
            found[current] = []
        elif current is not None and " = " in line:
            found[current].append(line)
    return found, entry


def executed_cycles(text: str) -> int | None:
    """The compiler's estimated cycles of one run of the module ``text`` (see the module's
    docstring), or ``None`` where it estimates none (not a TPU's compiled text)."""
    if '"estimated_cycles"' not in text:
        return None
    found, entry = computations(text)
    if entry is None:
        return None

    @functools.cache
    def cycles(name: str) -> int:
        total = 0
        for line in found.get(name, ()):
            if _COLLECTIVE.search(line):
                continue
            estimate = _ESTIMATED.search(line)
            total += int(estimate[1]) if estimate else 0
            branches = _BRANCHES.search(line)
            if branches:
                total += max(cycles(branch.strip().lstrip("%")) for branch in branches[1].split(","))
            loop = _LOOP.search(line)
            if loop:
                trips = _TRIPS.search(line)
                total += cycles(loop[2]) * (int(trips[1]) if trips else bound(found.get(loop[1], [])))
        return total

    return cycles(entry)


def bound(condition: list[str]) -> int:
    """A loop's trips read from its condition (a counter from 0 compared ``LT`` with a constant, as a
    scan compiles), once where the condition is another."""
    constants: dict[str, str] = {}
    for line in condition:
        constant = _CONSTANT.search(line)
        if constant:
            constants[constant[1]] = constant[2]
    for line in condition:
        below = _BELOW.search(line)
        if below and below[1] in constants:
            return int(constants[below[1]])
    return 1
