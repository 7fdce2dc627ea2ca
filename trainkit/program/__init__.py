"""Program: what one setup compiles: the initial state, the steps under a strategy, the
compiled memory plan and ``"auto"`` (imports ``core``, ``objective``, ``data``, ``strategies``,
``distributed``)."""
