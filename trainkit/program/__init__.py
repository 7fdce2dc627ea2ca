"""Program: what one setup compiles and runs: the initial state, the steps under a strategy,
``"auto"``'s choice, the setup and its input (imports ``core``, ``objective``, ``data``,
``strategies``, ``distributed``, and ``planning`` for the compiled memory plan)."""
