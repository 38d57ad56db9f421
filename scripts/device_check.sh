#!/usr/bin/env bash
# Everything of dcr that needs a GPU, in one call on a machine with one
# NVIDIA GPU (H100 or H200), within 8 minutes (docs/testing.md, "On a GPU").
#
# Such a machine, as this project gets it now and then for minutes, has
# CUDA, Python 3.12 with torch, cmake, ninja, nanobind and scikit-build-core,
# but no package registry, no vLLM and none of dcr's C++ dependencies. So
# the first half runs here and the second there:
#
#   scripts/device_check.sh --dry-run
#       here (Debian 12, with its package registry): puts what travels in
#       .device/ (the Debian packages of dcr's C++ dependencies, about 14 MB;
#       git-ignored) and lists what the GPU machine will run.
#   scripts/device_check.sh --run
#       there, through the device tool: run with carry [".device"] and
#       timeout_s 560. Unpacks the packages into a prefix, builds dcr's Python
#       package for that machine's Python and torch, runs the CUDA tests of
#       the apply loop (tests/python/test_device_apply.py and the CUDA
#       variants in test_python_trainer_side.py and test_fp8_receiver.py) and the engine apply
#       benchmark on the device, and prints one table. Logs, the benchmark's
#       JSON and its plot go to $OUT (or .device/out).
#   scripts/device_check.sh --run --no-cuda
#       here: the same second half on this CPU (the CUDA tests skip, the
#       benchmark runs on the CPU at 256MB): what --dry-run checks before a
#       GPU is spent on it.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
dev=$root/.device
out=${OUT:-$dev/out}

mode="" cuda=1
for a in "$@"; do
  case "$a" in
    --dry-run) mode=dry ;;
    --run) mode=run ;;
    --no-cuda) cuda=0 ;;
    *) echo "usage: scripts/device_check.sh --dry-run | --run [--no-cuda]" >&2; exit 2 ;;
  esac
done
[ -n "$mode" ] || { echo "usage: scripts/device_check.sh --dry-run | --run [--no-cuda]" >&2; exit 2; }

# The C++ dependencies of the Python package (scripts/setup.sh's list, less
# the test and CLI ones), with the libraries they load that a CUDA image may
# lack; the C library, libstdc++ and the compiler's own are the machine's.
packages=(nlohmann-json3-dev libfmt-dev libcli11-dev libzstd-dev libzmq3-dev cppzmq-dev libsodium-dev
          libxxhash-dev libcurl4-openssl-dev libssl-dev libexpat1-dev pkgconf)
system='^(gcc-12-base|libc6|libc6-dev|libc-dev-bin|libcrypt1|libcrypt-dev|libgcc-s1|libstdc\+\+6|linux-libc-dev|libnsl-dev|libnsl2|libtirpc-common|libtirpc-dev|libtirpc3|rpcsvc-proto|icu-devtools|libicu-dev|libicu72|libxml2|libxml2-dev|libdb5\.3|krb5-multidev|libkrb5-dev|comerr-dev|libgssrpc4|libkadm5clnt-mit12|libkadm5srv-mit12|libkdb5-10|libbsd-dev|libmd-dev|liblzma5|zlib1g)$'

steps=(
  "build: dcr's Python package against the carried packages (pip, scikit-build-core, the machine's Python and torch)"
  "tests: tests/python/test_device_apply.py (device path against host path: every mode, codec and word size, chunk edges, replicas, a torn scatter repaired, a rank following a store through a retry) and the CUDA variants of test_python_trainer_side.py (staged publisher and follower) and test_fp8_receiver.py (an FP8 rank on the device)"
  "bench: bench/engine_apply_bench.py --device cuda --size 2GB (0.1%, 1%, 3% versions: in place on the device against the staged path, and the device's own copy rate)"
)

prepare() {
  mkdir -p "$dev/debs"
  local want
  want=$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces \
           --no-enhances --no-pre-depends "${packages[@]}" 2>/dev/null | grep '^\w' | sort -u | grep -vE "$system")
  (cd "$dev/debs" && for p in $want; do ls "${p}"_*.deb >/dev/null 2>&1 || apt-get download -qq "$p" 2>/dev/null; done)
  echo "device_check: $(ls "$dev/debs" | wc -l) packages in .device/debs ($(du -sh "$dev/debs" | cut -f1)) travel with carry [\".device\"]"
}

if [ "$mode" = dry ]; then
  prepare
  echo "device_check: on the GPU machine (device tool: command 'scripts/device_check.sh --run', carry [\".device\"], timeout_s 560):"
  for s in "${steps[@]}"; do echo "  - $s"; done
  echo "device_check: check that second half here first: scripts/device_check.sh --run --no-cuda"
  exit 0
fi

# ---- the second half: on the GPU machine (or here with --no-cuda) ----------
mkdir -p "$out"
[ -d "$dev/debs" ] || { echo "device_check: no .device/debs: run --dry-run here first and carry .device" >&2; exit 2; }
python=python3
[ "$cuda" = 1 ] || python=$root/.venv/bin/python
work=$(mktemp -d /tmp/dcr-device.XXXXXX)
prefix=$work/prefix
declare -a table
t0=$(date +%s)
note() { table+=("$1"); echo "== $1"; }
lap() { echo $(($(date +%s) - t0)); }  # seconds since the step began (t0 is reset after each note)

echo "== the machine"
{ uname -a; cat /etc/os-release 2>/dev/null | head -2; ldd --version 2>&1 | head -1; g++ --version | head -1
  "$python" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
} 2>&1 | tee "$out/machine.txt"
if [ "$cuda" = 1 ] && ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "device_check: torch sees no CUDA device here; use --no-cuda for the CPU rehearsal" >&2
  exit 2
fi

for f in "$dev"/debs/*.deb; do dpkg -x "$f" "$prefix"; done
lib=$prefix/usr/lib/x86_64-linux-gnu
export PKG_CONFIG=$prefix/usr/bin/pkgconf PKG_CONFIG_SYSROOT_DIR=$prefix
export PKG_CONFIG_LIBDIR=$lib/pkgconfig:$prefix/usr/share/pkgconfig
export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# pkgconf wants the private requirements of libzmq and libcurl (krb5,
# libbsd, libxml2, ...), which only a static link uses: empty stand-ins.
stubs=$prefix/stub-pkgconfig
mkdir -p "$stubs"
export PKG_CONFIG_LIBDIR=$PKG_CONFIG_LIBDIR:$stubs
for _ in 1 2 3 4 5; do
  missing=$("$PKG_CONFIG" --exists --print-errors libzstd libzmq libsodium libcurl openssl expat 2>&1 |
            sed -n "s/^Package '\([^']*\)', required by .*/\1/p" | sort -u || true)
  [ -n "$missing" ] || break
  for m in $missing; do printf 'Name: %s\nDescription: stand-in (dynamic link)\nVersion: 99\n' "$m" > "$stubs/$m.pc"; done
done
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
set +e
timeout 300 "$python" -m pip install -q --no-build-isolation --no-deps --no-index --target "$work/site" \
  -Cbuild-dir="$work/build" -Ccmake.define.CMAKE_PREFIX_PATH="$prefix/usr" \
  -Ccmake.define.OPENSSL_ROOT_DIR="$prefix/usr" "$root" > "$out/build.log" 2>&1
rc=$?
set -e
if [ $rc != 0 ]; then
  note "build | FAILED (rc $rc) in $(lap) s | $out/build.log"
  tail -40 "$out/build.log"
  printf '%s\n' "${table[@]}"
  exit 1
fi
note "build | ok | $(lap) s"
t0=$(date +%s)
export PYTHONPATH=$work/site PYTHONUNBUFFERED=1

set +e
sel=(tests/python/test_device_apply.py tests/python/test_python_trainer_side.py tests/python/test_fp8_receiver.py)
filter=(-k "cuda")
[ "$cuda" = 1 ] || filter=(-k "cpu and (device or staged)")
timeout 180 "$python" -m pytest -q -p no:cacheprovider "${sel[@]}" "${filter[@]}" > "$out/tests.log" 2>&1
rc=$?
note "tests | $( [ $rc = 0 ] && echo ok || echo "FAILED (rc $rc)" ) | $(lap) s | $(tail -1 "$out/tests.log")"
t0=$(date +%s)
[ $rc = 0 ] || tail -60 "$out/tests.log"

device=cuda size=2GB
[ "$cuda" = 1 ] || { device=cpu; size=256MB; }
timeout 240 "$python" bench/engine_apply_bench.py --device "$device" --size "$size" --dir "$work/bench" \
  --json "$out/engine_apply.json" --plot "$out/engine_apply.png" > "$out/bench.log" 2>&1
brc=$?
note "bench | $( [ $brc = 0 ] && echo ok || echo "FAILED (rc $brc)" ) | $(lap) s | $out/bench.log"
set -e
cat "$out/bench.log"
echo
echo "| step | result | seconds | detail |"
echo "|---|---|---|---|"
printf '| %s |\n' "${table[@]}"
rm -rf "$work"
[ $rc = 0 ] && [ $brc = 0 ]
