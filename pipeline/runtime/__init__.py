"""The process and the stack it runs on: how a stage's process ends (process_exit.py), the settings of the
vLLM CPU build (vllm_cpu.py) and which of our patches the installed packages carry (patchset.py). Imports no
stage."""
