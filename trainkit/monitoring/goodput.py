"""The goodput ledger as a person reads it: the table ``fit`` prints at its end (``verbose`` >= 1),
with the largest loss named and what to do about it.

>>> from trainkit.record.ledger import Goodput
>>> print(report(Goodput({"startup": 1.0, "input": 4.1, "step": 4.9}, wall_seconds=10.0)))
Where the time went: 10.0 s, goodput 49.0% (training steps)
  startup   1.00 s  10.0%
  input     4.10 s  41.0%
  step      4.90 s  49.0%
41% of the time waiting for input: read ahead, more workers, or a faster source.
"""

from __future__ import annotations

import statistics

from trainkit.record.ledger import Goodput

#: what the largest loss means, and what to do about it
ADVICE = {
    "startup": "starting up: a fixed strategy skips 'auto''s measured plan, and a later run of the same "
    "script reuses its pick",
    "compile": "compiling: keep the persistent compilation cache on (TRAINKIT_COMPILATION_CACHE) and the "
    "batch shapes fixed",
    "input": "waiting for input: read ahead, more workers, or a faster source",
    "validation": "validating: validate less often (validation_freq, validation_interval) or on fewer "
    "batches (validation_steps)",
    "checkpoint": "writing checkpoints: save less often (save_freq)",
    "lost": "recomputing steps lost to a restart: back up more often (BackupAndRestore(save_freq=...))",
    "skipped": "updates SpikeSkip threw away: lower the learning rate, or look at the data of those batches",
}
#: a loss smaller than this share of the wall time is not named
NAMED_SHARE = 0.05


def _advice(bucket: str) -> str:
    if bucket.startswith("callbacks/"):
        name = bucket.split("/", 1)[1]
        return f"in {name}'s hooks: make them cheaper or run them less often"
    return ADVICE.get(bucket, bucket)


#: buckets under this share of the wall time are left out of the table (kept in the record)
SHOWN_SHARE = 0.001


def _seconds(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def report(goodput: Goodput) -> str:
    """The table of :class:`~trainkit.record.ledger.Goodput`'s buckets, the largest loss named
    with what to do, and on several processes the straggler of each bucket."""
    wall = goodput.wall_seconds
    lines = [f"Where the time went: {wall:.1f} s, goodput {100 * goodput.goodput:.1f}% (training steps)"]
    shown = {name: s for name, s in goodput.buckets.items() if wall > 0 and s >= SHOWN_SHARE * wall}
    width = max((len(name) for name in shown), default=0)
    for name, seconds in shown.items():
        share = 100 * seconds / wall
        lines.append(f"  {name:<{width}}  {seconds:>6.2f} s  {share:4.1f}%")
    if goodput.lost_steps:
        lines.append(f"{goodput.lost_steps} steps were recomputed after {goodput.restarts} restart(s).")
    if goodput.step_median is not None and goodput.step_p99 is not None:
        lines.append(f"Step time: median {_seconds(goodput.step_median)}, p99 {_seconds(goodput.step_p99)}.")
    lines += _stragglers(goodput)
    top = goodput.top_loss()
    if top is not None and top[1] >= NAMED_SHARE:
        lines.append(f"{100 * top[1]:.0f}% of the time {_advice(top[0])}.")
    return "\n".join(lines)


def _stragglers(goodput: Goodput) -> list[str]:
    """On several processes: the process that spent the most in each bucket where it spent a
    tenth more than the median process, and every process's step-time spread."""
    if len(goodput.processes) < 2:
        return []
    lines = []
    for name, index in goodput.stragglers.items():
        values = [p.buckets.get(name, 0.0) for p in goodput.processes]
        typical, most = statistics.median(values), max(values)
        if name != "step" and most > 1.1 * typical and most - typical > 0.01 * goodput.wall_seconds:
            lines.append(f"Process {index} spent the most in {name}: {most:.2f} s (median process {typical:.2f} s).")
    spreads = [
        f"{p.index}: {_seconds(p.step_median)} / {_seconds(p.step_p99)}"
        for p in goodput.processes
        if p.step_median is not None and p.step_p99 is not None
    ]
    if spreads:
        lines.append("Step time per process (median / p99): " + ", ".join(spreads) + ".")
    return lines
