#!/usr/bin/env bash
# Tests dcr as users install it: builds the wheel (scripts/build_wheel.sh),
# installs it into a fresh venv that sees neither the source tree nor a build
# directory, and runs there, from a directory outside the tree:
#   - tests/wheel: the CLI's --version, the libraries it links, a
#     publish/follow round trip, HTTPS against a server's certificate;
#   - the Python tests that need only the package and the CLI (below), the
#     vLLM backend's among them against a vLLM installed into that venv.
#
#   scripts/test_wheel.sh [--wheel FILE]   test FILE instead of building one
#   scripts/test_wheel.sh --list           the tests/python files it runs
#                                          (scripts/test.sh runs them only here)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

# The tests/python files that run against the installed wheel: they import
# dcr and run the dcr command and nothing else of the tree.
tree_tests=(test_python_package.py test_python_refit_models.py test_python_store_refit.py test_python_follower.py
            test_timeline.py test_store_cli.py test_vllm.py)
helpers=(conftest.py vllm_job.py)

wheel=""
case "${1:-}" in
  "") ;;
  --wheel) wheel=$(realpath "$2") ;;
  --list) printf '%s\n' "${tree_tests[@]}"; exit 0 ;;
  *) echo "usage: scripts/test_wheel.sh [--wheel FILE | --list]" >&2; exit 2 ;;
esac
if [ -z "$wheel" ]; then
  rm -rf build-wheel/dist
  scripts/build_wheel.sh --out build-wheel/dist
  wheel=$(ls build-wheel/dist/dcr-*.whl)
fi

# openssl makes the HTTPS test's certificate; readelf lists what a binary links.
scripts/install_debian_packages.sh openssl binutils
work=$(mktemp -d /tmp/dcr-wheel-test.XXXXXX)
trap 'rm -rf "$work"' EXIT
echo "== test_wheel: a fresh venv in $work with $(basename "$wheel")"
python3 -m venv "$work/venv"
# The wheel and its dependencies (numpy, at the version the tree's venv has,
# which torch and vLLM there were installed against)...
numpy_version=$(.venv/bin/python -c "import numpy; print(numpy.__version__)")
"$work/venv/bin/pip" install -q --disable-pip-version-check "$wheel" "numpy==$numpy_version" 2>&1 \
  | { grep -v "^WARNING: Location" || true; }
# ...and what the tests use besides (torch, vLLM, transformers, safetensors,
# pytest) borrowed from the tree's venv, after the venv's own packages on
# sys.path: installing vLLM afresh takes minutes. The dcr that .venv holds
# is shadowed, and tests/wheel checks that dcr comes from this venv.
site=$("$work/venv/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
.venv/bin/python -c "import sysconfig; print(sysconfig.get_path('purelib'))" >"$site/zz_dcr_test_borrowed.pth"

mkdir -p "$work/tests"
cp tests/wheel/*.py "$work/tests/"
for t in "${tree_tests[@]}" "${helpers[@]}"; do cp "tests/python/$t" "$work/tests/"; done
cd "$work/tests"
echo "== test_wheel: dcr --version: $("$work/venv/bin/dcr" --version | head -1)"
echo "== test_wheel: python -c 'import dcr': $("$work/venv/bin/python" -c 'import dcr; print(dcr.__file__)')"
echo "== test_wheel: the tests, from $PWD"
env -u PYTHONPATH -u DCR_FAULTS_BIN DCR_BIN="$work/venv/bin/dcr" DCR_REQUIRE_VLLM=1 PATH="$work/venv/bin:$PATH" \
  "$work/venv/bin/python" -m pytest -q -p no:cacheprovider --rootdir "$PWD" .
