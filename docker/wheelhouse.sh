#!/usr/bin/env bash
# Fill a wheelhouse with exactly the wheels a lock file names (hash-checked), for an offline image build:
#   docker/wheelhouse.sh LOCK DEST PYTHON_VERSION GLIBC_MINOR
#   e.g. docker/wheelhouse.sh requirements/image.lock wheelhouse 3.12 39   (the CUDA image: Ubuntu 24.04)
# Run on a machine with PyPI access; copy DEST next to the Dockerfile on the offline host and build with
# --build-arg OFFLINE=1. pip targets the image's Python and glibc, not this machine's: --platform takes
# exact tags, so every manylinux tag up to the image's glibc is listed. A lock pin PyPI does not carry
# (image-ci.lock's torch==X+cpu) is found where pip's own configuration points it: this machine's pip
# finds the CPU torch on local disk (find-links); elsewhere set PIP_EXTRA_INDEX_URL to the PyTorch CPU index.
set -euo pipefail
if [ $# -ne 4 ]; then
  echo "usage: $0 LOCK DEST PYTHON_VERSION GLIBC_MINOR   (e.g. requirements/image.lock wheelhouse 3.12 39)" >&2
  exit 2
fi
LOCK="$1" DEST="$2" PYVER="$3" GLIBC_MINOR="$4"
PIP="${PIP:-python3 -m pip}"
[ -r "$LOCK" ] || { echo "error: lock file $LOCK not readable; pass requirements/image.lock or image-ci.lock" >&2; exit 2; }
platforms=(--platform any --platform linux_x86_64 --platform manylinux1_x86_64 --platform manylinux2010_x86_64
           --platform manylinux2014_x86_64)
for minor in $(seq 5 "$GLIBC_MINOR"); do
  platforms+=(--platform "manylinux_2_${minor}_x86_64")
done
mkdir -p "$DEST"
# One fill of a wheelhouse at a time (CI fills it in the background while the image tests may start their
# own, idempotent fill): a second one waits here, then finds every wheel present.
exec 9>"$DEST/.fill.lock"
flock 9
# shellcheck disable=SC2086  # PIP may be a command with arguments
if ! $PIP download --quiet --no-deps --require-hashes --only-binary=:all: --python-version "$PYVER" \
  --implementation cp "${platforms[@]}" -d "$DEST" -r "$LOCK"; then
  echo "error: pip could not fetch every wheel of $LOCK (a +cpu torch is not on PyPI: give pip a folder" \
       "or index holding it, e.g. PIP_FIND_LINKS=DIR or PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)" >&2
  exit 1
fi
echo "$DEST: $(find "$DEST" -maxdepth 1 -name '*.whl' | wc -l) wheels, $(du -sh "$DEST" | cut -f1)"
