"""Training curves as a PNG: train against validation for the loss and each metric (matplotlib,
the ``monitoring`` extra). From a ``History``, a Keras ``CSVLogger`` file, a
``CSVMetricsLogger`` file, or a TensorBoard log directory:

    python -m trainkit.plot LOGDIR_OR_CSV -o curves.png

>>> series = {"loss": [1.0, 0.5], "val_loss": [1.1, 0.7], "accuracy": [0.5, 0.8]}
>>> panels(series)
{'loss': ['loss', 'val_loss'], 'accuracy': ['accuracy']}
>>> list(panels({"accuracy": [0.5], "loss": [1.0]}))
['loss', 'accuracy']
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from trainkit.core.local_path import LocalPath, require_local
from trainkit.distributed import atomic

#: Epoch-level logs that are not curves worth a panel.
SKIPPED = ("epoch", "learning_rate", "steps_per_second", "examples_per_second", "tokens_per_second")


def panels(series: Mapping[str, Sequence[float]]) -> dict[str, list[str]]:
    """One panel per metric name (``val_`` twins with their training series), in log order."""
    grouped: dict[str, list[str]] = {}
    for name in series:
        base = name.removeprefix("val_")
        if base in SKIPPED or not len(series[name]):
            continue
        grouped.setdefault(base, []).append(name)
    order = sorted(grouped, key=lambda base: base != "loss")  # the loss first, then the logs' order
    return {base: sorted(grouped[base], key=lambda n: n.startswith("val_")) for base in order}


def plot_curves(series: Mapping[str, Sequence[float]], path: LocalPath, title: str | None = None) -> Any:
    """Draws ``series`` (``{"loss": [...], "val_loss": [...], ...}``, one value per epoch) to
    ``path`` (PNG) and returns the matplotlib figure: one panel per metric, a training line and
    a validation line (dashed) in each."""
    path = require_local(path, "the plot's path")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    groups = panels(series)
    if not groups:
        raise ValueError(f"Nothing to plot: the series {sorted(series)} hold no metric with values.")
    columns = min(3, len(groups))
    rows = math.ceil(len(groups) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
    for ax, (base, names) in zip(axes.flat, groups.items()):
        for name in names:
            values = list(series[name])
            validation = name.startswith("val_")
            ax.plot(
                range(1, len(values) + 1),
                values,
                linestyle="--" if validation else "-",
                marker="o",
                markersize=3,
                label="validation" if validation else "train",
            )
        ax.set_title(base)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    for ax in list(axes.flat)[len(groups) :]:
        ax.set_visible(False)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    with atomic.staged(path) as temporary:  # the old plot stays whole if this one fails
        figure.savefig(temporary, dpi=100)
    plt.close(figure)
    return figure


def read_series(source: LocalPath) -> dict[str, list[float]]:
    """Per-epoch series from a Keras ``CSVLogger`` file (``epoch,loss,...``), a
    ``CSVMetricsLogger`` file (``step,run,name,value``: one point per logged step) or a
    TensorBoard log directory (``train/`` and ``validation/`` runs, ``epoch_*`` tags)."""
    source = os.fspath(source)
    if os.path.isdir(source):
        return _read_tensorboard(source)
    with open(source, newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and set(rows[0]) == {"step", "run", "name", "value"}:
        series: dict[str, list[float]] = {}
        for row in rows:
            name = ("val_" if row["run"] == "validation" else "") + row["name"]
            series.setdefault(name, []).append(float(row["value"]))
        return series
    return {
        key: [float(row[key]) for row in rows if row.get(key) not in (None, "", "NA")]
        for key in (rows[0] if rows else {})
        if key != "epoch"
    }


def _read_tensorboard(directory: str) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series: dict[str, list[float]] = {}
    for run, prefix in (("train", ""), ("validation", "val_")):
        path = os.path.join(directory, run)
        if not os.path.isdir(path):
            continue
        events = EventAccumulator(path, size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            if tag.startswith("epoch_"):
                series[prefix + tag.removeprefix("epoch_")] = [e.value for e in events.Scalars(tag)]
    if not series:
        raise ValueError(f"{directory} holds no train/ or validation/ run with epoch_* scalars.")
    return series


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainkit.plot", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a CSVLogger / CSVMetricsLogger file or a TensorBoard log directory")
    parser.add_argument("-o", "--output", default="curves.png")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    try:
        series = read_series(args.source)
        if not any(series.values()):
            raise ValueError("it holds no metric values")
        plot_curves(series, args.output, title=args.title or os.path.basename(os.path.normpath(args.source)))
    except (OSError, ValueError, KeyError, UnicodeDecodeError, csv.Error) as error:
        print(f"python -m trainkit.plot: cannot plot {args.source!r}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {', '.join(panels(series))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
