"""ops: drive a GPU host from the operator's machine (SSH, Docker, GPU cleanup, stage runs).

Never imports torch, transformers, vllm or pipeline: the host side runs pipeline inside the image.
"""
