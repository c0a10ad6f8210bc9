"""Speculative decoding measured in vLLM: acceptance, speed and greedy equality of a draft against the same
engine without speculation and with n-gram prompt lookup. ``measure.py`` owns the engine runs (one process
each) and their arithmetic; ``report.py`` the table and the plot. Used by ``pipeline evaluate`` and by
``pipeline train --online-eval``."""
