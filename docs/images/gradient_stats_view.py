"""Draws docs/images/gradient_stats.png from a digits example run's TensorBoard files, read with
TensorBoard's own reader (what its Scalars tab shows):

    python examples/digits_cnn.py --devices 8 --out /tmp/digits
    python docs/images/gradient_stats_view.py /tmp/digits/tensorboard/gradient_stats/train
"""

import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def main(run_dir: str) -> None:
    events = EventAccumulator(run_dir)
    events.Reload()
    tags = events.Tags()["scalars"]
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for axis, kind in zip(axes, ("grad_norm", "update_ratio", "param_norm")):
        for tag in sorted(t for t in tags if t.startswith(kind + "/")):
            points = events.Scalars(tag)
            axis.plot([p.step for p in points], [p.value for p in points], label=tag.split("/", 1)[1])
        axis.set_title(kind + " by layer")
        axis.set_xlabel("step")
        axis.set_yscale("log")
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    out = pathlib.Path(__file__).with_name("gradient_stats.png")
    figure.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1])
