"""`python -m pipeline.demo`: the demo (`make demo`)."""

from pipeline.demo.run import main

main()
