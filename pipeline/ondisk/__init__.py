"""The on-disk contract between stages: every file a stage writes and the next one reads (formats.py), one
way to read each kind and what a damaged one is (readers.py, sample_buffer.py for many at once), atomic
writes (atomic.py), the output-directory policy every stage uses (outdir.py) and the record each output
carries of how it was made (provenance.py). Imports no stage."""
