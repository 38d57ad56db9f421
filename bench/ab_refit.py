#!/usr/bin/env python3
"""Old against new: the end-to-end refit of two dcr binaries in the same run.

Each binary gets its own file store and publisher state in /dev/shm and one
long-running `dcr follow`; both publish the same `dcr gen` versions (qwen3-moe,
training 3%), in alternating order per version. A publish returns once the
follower acked (applied and verified), so its wall time is the refit's. Prints
each version's times, the medians, and checks both receivers against the last
version.

  bench/ab_refit.py OLD_DCR NEW_DCR [SIZE=1GB] [VERSIONS=6]

OLD_DCR: e.g. a worktree of the old commit built with
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDCR_BUILD_TESTS=OFF
  cmake --build build --target dcr
"""
import json, os, shutil, statistics, subprocess, sys, time

if len(sys.argv) < 3:
    sys.exit(__doc__)
old, new = sys.argv[1], sys.argv[2]
size = sys.argv[3] if len(sys.argv) > 3 else "1GB"
versions = int(sys.argv[4]) if len(sys.argv) > 4 else 6
work = "/dev/shm/dcr-abr"
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
env = {**os.environ, "DCR_PROGRESS": "0"}


def run(*cmd):
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"{cmd}: {p.stderr[-2000:]}")
    return p.stdout


run(new, "gen", "-o", f"{work}/run", "--family", "qwen3-moe", "--size", size, "--versions", versions,
    "--update", "training", "--rate", "0.03", "--seed", "7")
bins = {"old": old, "new": new}
followers = {}
for name, b in bins.items():
    store = f"file://{work}/store-{name}"
    run(b, "publish", "--store", store, "--state", f"{work}/state-{name}", "--version", 0, f"{work}/run/v0")
    shutil.copytree(f"{work}/run/v0", f"{work}/recv-{name}")
    followers[name] = subprocess.Popen(
        [b, "follow", "--store", store, "--id", f"r-{name}", "--poll", "0.01", "--stream-poll", "0.005",
         "--heartbeat", "0.5", f"{work}/recv-{name}"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def journal_version(name):
    try:
        with open(f"{work}/recv-{name}/.dcr-follow.json") as f:
            return json.load(f)["version"]
    except (OSError, ValueError, KeyError):
        return -1


for name in bins:  # both followers at v0 before the first publish
    while journal_version(name) < 0:
        time.sleep(0.05)
rows = {n: [] for n in bins}
for v in range(1, versions + 1):
    order = list(bins) if v % 2 else list(reversed(list(bins)))
    for name in order:
        t = time.perf_counter()
        rep = json.loads(run(bins[name], "publish", "--store", f"file://{work}/store-{name}", "--state",
                             f"{work}/state-{name}", "--version", v, "--json", f"{work}/run/v{v}"))
        wall = time.perf_counter() - t
        assert journal_version(name) == v, (name, v, journal_version(name))
        rows[name].append((wall, rep.get("encode_seconds", 0), rep.get("total_seconds", 0)))
        print(f"v{v} {name}: wall {wall:.3f} s  encode {rows[name][-1][1]:.3f}  total {rows[name][-1][2]:.3f}",
              flush=True)
for name, p in followers.items():
    p.terminate()
    p.wait()
for name in bins:
    run(bins[name], "diff", f"{work}/recv-{name}", f"{work}/run/v{versions}")
for name, r in rows.items():
    print(f"{name}: median wall {statistics.median(x[0] for x in r):.3f} s, encode "
          f"{statistics.median(x[1] for x in r):.3f}, total {statistics.median(x[2] for x in r):.3f} "
          f"(n={len(r)}); receiver equals v{versions}")
shutil.rmtree(work, ignore_errors=True)
