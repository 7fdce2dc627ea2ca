"""Monitoring: loggers, throughput and MFU, plots, and inspection of where the state lives
(imports ``core``, ``loop``, ``distributed``)."""
