"""The train stage and what only it uses: its options (config.py), its command line (cli.py), our files as
speculators' dataset (data.py), the draft model (draft.py), the run itself (stage.py: checkpoints, resume,
export, summary), what it writes (files.py), the offline and online acceptance (evaluate.py,
online_eval.py) and the figures (plots.py). Importing the package loads no torch."""
