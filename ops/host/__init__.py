"""The scripts ops sends to the GPU host and runs there with the host's own python3: the probe and
terminator (agent.py) and the host lock's keeper (lock.py). Standard library only
(tests/test_architecture.py); the laptop side reads their source and sends it, it never imports them."""
