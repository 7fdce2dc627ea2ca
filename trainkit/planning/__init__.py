"""Planning: the compiled memory and cost plan of a step under each strategy, and what builds on it
(the ladder of memory measures, ``find_batch_size``, compile-only targets, the budget of comparing,
the remembered pick); below ``program`` (imports ``core``, ``distributed``, ``attn``, ``data``,
``strategies``): a plan reads the step it is given, never the setup."""
