#!/usr/bin/env bash
# Installs the wheel into clean Debian root filesystems, made by debootstrap
# (minbase: no compiler, no -dev package), and uses it there in a chroot:
#   bookworm (Debian 12, glibc 2.36, Python 3.11): pip install the wheel into
#     a venv, then `dcr --version`, `import dcr` and a publish/follow round trip
#     through the package's Python API, compared bit for bit;
#   bullseye (Debian 11, glibc 2.31, Python 3.9, which a cp311 wheel does not
#     install into): the wheel's dcr command alone, --version and a CLI
#     publish/follow round trip, compared by `dcr diff`.
# Needs root and deb.debian.org; each root filesystem is kept under
# build-wheel/rootfs and made once.
#
#   scripts/test_wheel_rootfs.sh [WHEEL]    default: the newest in dist/
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=$(realpath "${1:-$(ls -t dist/dcr-*manylinux*.whl | head -1)}")
[ "$(id -u)" = 0 ] || { echo "test_wheel_rootfs: needs root (debootstrap, chroot)" >&2; exit 1; }
scripts/install_debian_packages.sh debootstrap

# make_root SUITE PACKAGES: a minbase root filesystem of SUITE with PACKAGES.
make_root() {
  local suite=$1 packages=$2 dir=build-wheel/rootfs/$1
  if [ ! -f "$dir/.made" ]; then
    echo "== test_wheel_rootfs: debootstrap $suite (minbase + $packages)" >&2
    rm -rf "$dir" && mkdir -p "$dir"
    debootstrap --variant=minbase --include="$packages" "$suite" "$dir" http://deb.debian.org/debian >"$dir.log" 2>&1 \
      || { tail -20 "$dir.log" >&2; exit 1; }
    touch "$dir/.made"
  fi
  # This machine's resolver and CA bundle (it may hold a proxy's CA), which
  # pip in the chroot verifies PyPI with.
  cp /etc/resolv.conf "$dir/etc/resolv.conf"
  cp /etc/ssl/certs/ca-certificates.crt "$dir/etc/ssl/certs/ca-certificates.crt"
  echo "$dir"
}

# in_root DIR CMD: CMD in a chroot of DIR with /proc, /dev and /tmp of its own.
in_root() {
  local dir=$1
  shift
  unshare --mount --fork bash -c '
    mount -t proc proc "$0/proc" && mount --rbind /dev "$0/dev" && mount -t tmpfs tmpfs "$0/tmp"
    exec chroot "$0" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/root DCR_PROGRESS=0 \
      PIP_CERT=/etc/ssl/certs/ca-certificates.crt bash -euo pipefail -c "$1"
  ' "$dir" "$*"
}

# round_trip: a CLI publish/follow round trip of two versions, compared by dcr diff.
round_trip='
  cd /tmp
  dcr gen -o run --family llama --size 8MB --versions 2 --update training --rate 0.03 >/dev/null
  for v in 0 1 2; do dcr publish --store file:///tmp/store --version $v --state state run/v$v >/dev/null; done
  dcr follow --store file:///tmp/store --id cli --until 2 --poll 0.05 cli >/dev/null
  dcr diff --summary run/v2 cli >/dev/null && echo "CLI publish/follow round trip: bit-exact"
'

root=$(make_root bookworm python3,python3-venv,ca-certificates)
cp "$wheel" "$root/root/"
echo "== test_wheel_rootfs: bookworm ($(in_root "$root" 'ldd --version | head -1'); -dev packages:" \
  "$(in_root "$root" 'dpkg -l | grep -c -- "-dev " || true'))"
in_root "$root" "
  rm -rf /root/venv && python3 -m venv /root/venv
  /root/venv/bin/pip install -q --disable-pip-version-check /root/$(basename "$wheel")
  . /root/venv/bin/activate
  dcr --version
  $round_trip
  python - <<'EOF'
import threading, dcr
print('import dcr:', dcr.__file__)
# The same run through the package: a publisher and a follower in one process.
store = dcr.open_store('file:///tmp/pystore')
pub = dcr.Publisher(store, '/tmp/pystate', ack_timeout_s=60)
pub.publish(0, '/tmp/run/v0')
fol = dcr.Follower(store, '/tmp/py', id='py', poll_s=0.02)
th = threading.Thread(target=fol.run, kwargs={'until': 2, 'timeout_s': 60})
th.start()
for v in (1, 2):
    pub.publish(v, '/tmp/run/v%d' % v)
th.join(90)
assert not th.is_alive()
EOF
  dcr diff --summary /tmp/run/v2 /tmp/py >/dev/null && echo 'Python publish/follow round trip: bit-exact'
"

root=$(make_root bullseye ca-certificates)
rm -rf "$root/root/wheel" && python3 -m zipfile -e "$wheel" "$root/root/wheel"
install -m 755 "$root"/root/wheel/dcr-*.data/scripts/dcr "$root/usr/local/bin/dcr"
echo "== test_wheel_rootfs: bullseye ($(in_root "$root" 'ldd --version | head -1')): the wheel's dcr command"
in_root "$root" "dcr --version; $round_trip"
echo "test_wheel_rootfs: ok"
