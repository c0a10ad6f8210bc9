"""Environment variables ops sets for a stage container and the pipeline reads back into its provenance."""

from __future__ import annotations

# the digest of the image the stage runs in (the image holds no record of its own digest)
IMAGE_DIGEST_ENV = "EAGLE_OPS_IMAGE_DIGEST"
# the product commit the image was built from (the Dockerfile bakes it in; the image holds no .git)
COMMIT_ENV = "EAGLE_OPS_COMMIT"
