"""Network namespaces on one bridge, each node's links shaped with tc tbf (root;
iproute2). Shared by bench/relay_bench.py and bench/scale/.

Every node is a namespace with one veth into a hub namespace's bridge. Its
downlink (the hub side of its veth) and, when asked, its uplink (its own side)
each get a `tbf` qdisc at the node's rate: a node's NIC, full duplex."""

from __future__ import annotations

import subprocess


class Net:
    PREFIX = "dcrb"

    def __init__(self, link_mbps: float | None = None, host_address: str | None = None):
        """host_address: also join this machine's own namespace to the bridge, at
        this address (unshaped): services on the host (radosgw) reach the nodes."""
        self.default_mbps = link_mbps
        self.names: list[str] = []
        self.count = 0
        self.host_veth = None
        subprocess.run(["ip", "link", "del", "dcrbhost"], capture_output=True)  # left by an interrupted run
        self.hub = f"{self.PREFIX}-hub"
        for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n"):
            if ns.startswith(self.PREFIX + "-"):  # left by an interrupted run
                subprocess.run(["ip", "netns", "del", ns.split()[0]])
        self.ip("netns", "add", self.hub)
        self.names.append(self.hub)
        self.ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        self.ip("-n", self.hub, "link", "set", "br0", "up")
        if host_address:
            self.ip("link", "add", "dcrbhost", "type", "veth", "peer", "name", "dcrbhostp")
            self.host_veth = "dcrbhost"
            self.ip("link", "set", "dcrbhostp", "netns", self.hub)
            self.ip("-n", self.hub, "link", "set", "dcrbhostp", "master", "br0", "up")
            self.ip("addr", "add", f"{host_address}/16", "dev", "dcrbhost")
            self.ip("link", "set", "dcrbhost", "up")

    @staticmethod
    def ip(*args: str) -> None:
        p = subprocess.run(["ip", *args], capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"ip {' '.join(args)} failed: {p.stderr.strip()}")

    @staticmethod
    def shape(ns: str, dev: str, mbps: float) -> None:
        # burst: at least one 10 ms of the rate, as tbf needs at HZ timers.
        burst = max(64 << 10, int(mbps * 1e6 / 100))
        p = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                            f"{mbps * 8:.3f}mbit", "burst", str(burst), "latency", "400ms"],
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"tc tbf on {ns} {dev} failed: {p.stderr.strip()}")

    def node(self, name: str, down_mbps: float | None = None, up_mbps: float | None = None) -> tuple[str, str]:
        """A namespace for `name`: its downlink shaped to down_mbps (default: the
        net's rate), its uplink to up_mbps (None: not shaped); (namespace, address)."""
        self.count += 1
        k = self.count
        ns, addr = f"{self.PREFIX}-{name}", f"10.88.{k // 250}.{k % 250 + 1}"
        self.ip("netns", "add", ns)
        self.names.append(ns)
        self.ip("link", "add", f"dcrbh{k}", "type", "veth", "peer", "name", f"dcrbn{k}")
        self.ip("link", "set", f"dcrbh{k}", "netns", self.hub)
        self.ip("link", "set", f"dcrbn{k}", "netns", ns)
        self.ip("-n", self.hub, "link", "set", f"dcrbh{k}", "master", "br0", "up")
        self.ip("-n", ns, "addr", "add", f"{addr}/16", "dev", f"dcrbn{k}")
        self.ip("-n", ns, "link", "set", f"dcrbn{k}", "up")
        self.ip("-n", ns, "link", "set", "lo", "up")
        down = down_mbps if down_mbps is not None else self.default_mbps
        if down:  # traffic to the node leaves the hub through dcrbh<k>
            self.shape(self.hub, f"dcrbh{k}", down)
        if up_mbps:
            self.shape(ns, f"dcrbn{k}", up_mbps)
        return ns, addr

    @staticmethod
    def wrap(ns: str, args: list) -> list:
        return ["ip", "netns", "exec", ns, *map(str, args)]

    def drop(self, ns: str) -> None:
        """Removes a node (its veth goes with its namespace)."""
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.names.remove(ns)

    def close(self) -> None:
        for ns in reversed(self.names):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.names = []
        if self.host_veth:
            subprocess.run(["ip", "link", "del", self.host_veth], capture_output=True)
            self.host_veth = None
