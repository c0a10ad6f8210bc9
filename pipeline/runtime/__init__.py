"""The process and the stack it runs on: how a stage's process ends (process_exit.py), the settings of the
vLLM CPU build (vllm_cpu.py), which of our patches the installed packages carry (patchset.py), whether the
installed vLLM can extract (vllm_checks.py) and the launcher of a data-parallel stage (torchrun.py). Imports
no stage."""
