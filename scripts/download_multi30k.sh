#!/usr/bin/env bash
# Fetch the Multi30k task-1 raw files (train/val/test_2016_flickr, de/en/fr) into data/multi30k,
# checked against the sha256 sums in transformer_cli/download.py.
# Usage: scripts/download_multi30k.sh [DEST] [extra tcli download options, e.g. --base-url URL]
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-data/multi30k}"
shift || true
exec python -m transformer_cli download multi30k --dest "$dest" "$@"
