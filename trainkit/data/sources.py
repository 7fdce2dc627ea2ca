"""``tk.sources``: the public names of data sources: the protocol every input of ``fit`` /
``evaluate`` / ``predict`` becomes, and the adapters that turn a data library's dataset into one,
chosen by the input's type (as Keras's data adapters are).

Two kinds, by how the rows can be reached:

- **Random access** (:class:`RandomAccessSource`): in-memory arrays, grain's ``MapDataset``,
  a Hugging Face ``datasets.Dataset``, a torch map-style ``Dataset``. trainkit orders,
  shuffles (by seed and epoch), batches and pads the rows itself, each process reads only its
  part of every global batch, and a resume starts at the saved batch index without reading
  the batches before it. The same rows in the same order as the array path, so the same
  parameters.
- **Iterators of batches** (:class:`trainkit.data.IterableDataset`): a Python iterable, grain's
  ``IterDataset`` / ``DataLoader`` / ``DatasetIterator``, a torch ``DataLoader``, a
  ``tf.data.Dataset``. The pipeline batches and shuffles; with several processes each
  process's pipeline yields its own part of every global batch. An iterator with grain's
  ``get_state()`` / ``set_state()`` is saved in trainkit's checkpoints and resumed without
  replaying; any other one is resumed by skipping the batches already trained.

>>> import numpy as np
>>> source = RandomAccessSource([(np.full(2, i, np.float32), i) for i in range(5)])
>>> isinstance(source, DataSource), source.steps(2)
(True, 3)
"""

from trainkit.data.adapters import adapt
from trainkit.data.iterable import IterableDataset
from trainkit.data.random_access import LABEL_COLUMNS, HuggingFaceSource, RandomAccessSource
from trainkit.data.source import DataSource

__all__ = ["DataSource", "RandomAccessSource", "HuggingFaceSource", "IterableDataset", "adapt", "LABEL_COLUMNS"]
