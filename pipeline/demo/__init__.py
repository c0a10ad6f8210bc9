"""The demo and its built-in models: `make demo`'s stage sequence and `pipeline demo-assets` (run.py), the
tiny random targets of every supported architecture with the demo tokenizer and conversations (tiny.py),
and the learned tiny target trained on the standard library's text (learned.py). Tests and benchmarks
build their models here too; no stage imports it."""
