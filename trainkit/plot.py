"""``python -m trainkit.plot LOGDIR_OR_CSV -o curves.png``: the entry point of
:mod:`trainkit.monitoring.plot` (training curves from TensorBoard logs or a CSV file)."""

import sys

from trainkit.monitoring.plot import main, plot_curves, read_series

__all__ = ["main", "plot_curves", "read_series"]

if __name__ == "__main__":
    sys.exit(main())
