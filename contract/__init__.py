"""The facts that cross the line between ops (the laptop) and pipeline (the container on the GPU host).

Owns what both sides must agree on and nothing else: the stage table (``stages``), which samples a host of
several owns (``shards``), which backend ``auto`` means (``backends``) and the routed experts it weighs
(``experts``), the versioned summary record that a stage writes and ops reads (``summary``), the size of an
extracted set on disk (``sizes``) and the environment variables ops passes into a stage container
(``env``). Standard library only: ops imports it without the ML stack, pipeline without the SSH/Docker
stack (tests/test_architecture.py holds all three to that). A fact written here is written nowhere else; a
change here is a change to the contract between the two sides.
"""
