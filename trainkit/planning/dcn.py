"""The bytes a compiled multi-slice TPU program sends between slices, over the data-center
network (DCN): libtpu lowers each collective that crosses slices to host-transfer ``send``s of
its megascale runtime. A send inside a loop (a scan over layers: the gradients of stacked blocks,
a pipeline's ticks) is counted once per iteration: the loop's trip count is read from its
condition (``counter < N``) and the counter's start.

>>> hlo = '''
... %cond (p: (s32[])) -> pred[] {
...   %p = (s32[]) parameter(0)
...   %i = s32[] get-tuple-element(%p), index=0
...   %n = s32[] constant(8)
...   ROOT %lt = pred[] compare(%i, %n), direction=LT
... }
... %body (q: (s32[])) -> (s32[]) {
...   %s = (f32[4,8]{1,0}, u32[], token[]) send(%x, %t), frontend_attributes={h="xla_megascale_runtime"}
... }
... ENTRY %main () -> s32[] {
...   %zero = s32[] constant(1)
...   %init = (s32[]) tuple(%zero)
...   %w = (s32[]) while(%init), condition=%cond, body=%body
... }
... '''
>>> dcn_traffic(hlo)  # 7 iterations (1 to 8) of a 128-byte send
896
"""

from __future__ import annotations

import math
import re

_HEADER = re.compile(r"^(?:ENTRY )?%(?P<name>\S+) \(.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%(?P<name>\S+) = (?P<type>.*?) (?P<op>[a-z][\w-]*)\((?P<args>[^)]*)\)(?P<rest>.*)$"
)
_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|f16|bf16|s32|u32|f32|s64|u64|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4}
_BYTES |= {"s64": 8, "u64": 8, "f64": 8}
_CALLED = re.compile(r"\b(?:calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def _computations(hlo_text: str) -> tuple[dict[str, list[re.Match[str]]], str | None]:
    """Each computation's instructions, and the entry computation's name."""
    found: dict[str, list[re.Match[str]]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header["name"]
            found[current] = []
            entry = current if line.startswith("ENTRY") else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            instruction = _INSTRUCTION.match(line)
            if instruction:
                found[current].append(instruction)
    return found, entry


def _trip_count(
    condition: list[re.Match[str]], start: str, constants: dict[str, int], tuples: dict[str, list[str]]
) -> int:
    """Iterations of a while loop whose condition is ``counter < N`` (1 when it is not that)."""
    compare = next((i for i in condition if i["op"] == "compare" and "direction=LT" in i["rest"]), None)
    if compare is None:
        return 1
    bound = next((constants[a.strip("% ")] for a in compare["args"].split(",") if a.strip("% ") in constants), None)
    first = tuples.get(start, [None])[0]
    begin = constants.get(first, 0) if first is not None else 0
    return max(bound - begin, 1) if bound is not None else 1


def dcn_traffic(hlo_text: str) -> int:
    """Bytes a compiled multi-slice program sends to other slices per step (0 within one slice)."""
    computations, entry = _computations(hlo_text)
    constants, tuples = {}, {}
    for instructions in computations.values():
        for i in instructions:
            if i["op"] == "constant" and re.fullmatch(r"-?\d+", i["args"].strip()):
                constants[i["name"]] = int(i["args"])
            elif i["op"] == "tuple":
                tuples[i["name"]] = [a.strip().lstrip("%") for a in i["args"].split(",")]
    multiplier: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        if name not in computations or multiplier.get(name, 0) >= times:
            return
        multiplier[name] = times
        for i in computations[name]:
            rest = i["rest"]
            body = re.search(r"body=%([\w.\-]+)", rest)
            if i["op"] == "while" and body:
                condition = re.search(r"condition=%([\w.\-]+)", rest)
                trips = _trip_count(
                    computations.get(condition[1], []) if condition else [],
                    i["args"].strip().lstrip("%"),
                    constants,
                    tuples,
                )
                visit(body[1], times * trips)
            for called in _CALLED.findall(rest):
                visit(called, times)
            for branches in _BRANCHES.findall(rest):
                for branch in branches.split(","):
                    visit(branch.strip().lstrip("%"), times)

    if entry is not None:
        visit(entry, 1)
    total = 0
    for name, instructions in computations.items():
        for i in instructions:
            if i["op"] == "send" and "xla_megascale_runtime" in i["rest"]:
                shapes = _SHAPE.findall(i["type"])[:1]  # (buffer, context, token): the buffer
                sent = sum(_BYTES[d] * math.prod(int(x) for x in dims.split(",") if x) for d, dims in shapes)
                total += sent * multiplier.get(name, 1)
    return total
