"""The EAGLE-3 data pipeline: prepare, extract, weights, train, verify.

Runs inside the image (or any Python env with torch/transformers). Never imports fabric, paramiko or docker.
"""
