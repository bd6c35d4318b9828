"""The host changes a real test node makes, recorded before they are made and reverted after.

A real node (containerd, runc, the kubelet, kube-proxy, CNI) changes global host state: bridges,
iptables chains, cgroups, mounts, ``/run/containerd``, ``/var/log/containers``, and processes
(containerd shims, containers) that outlive their parent. Each change is written to a ledger file
under ``LEDGER_DIR`` *before* it is made, so ``revert()`` can undo it after a clean stop and
``revert_stale()`` after a crash (the next start, or a test session's end, finds ledgers whose
owner process is gone). ``snapshot()`` reads the same kinds of state, for before/after checks.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

LEDGER_DIR = Path("/run/dsv4-real-nodes")
CGROUP_ROOT = Path("/sys/fs/cgroup")
IPTABLES = ("iptables", "ip6tables")
IPTABLES_TABLES = ("filter", "nat", "mangle")
# What the node components create outside the work dir on their own (paths fixed in their code).
FIXED_DIRS = (Path("/run/containerd"), Path("/var/log/containers"), Path("/var/log/pods"))
# Processes of a real node, by executable name (for snapshot(); revert() goes by pid and cgroup).
NODE_PROCESS_NAMES = frozenset(
    {"containerd", "containerd-shim", "containerd-shim-runc-v2", "runc"}
    | {"kubelet", "kube-proxy", "coredns", "pause"}
)


@dataclass
class Ledger:
    """Everything one real-node session changed or may change on the host."""

    path: Path
    owner_pid: int
    owner_start: str
    work_dir: str
    bridges: list[str] = field(default_factory=list)
    cgroup_names: list[str] = field(default_factory=list)
    """Top-level cgroup directory names (the kubelet's ``cgroupRoot``), in every hierarchy."""
    sockets: list[str] = field(default_factory=list)
    """containerd sockets: shims and their containers are found by this address."""
    pids: dict[str, str] = field(default_factory=dict)
    """pid -> process start time (so a reused pid is never signalled)."""
    chains_before: dict[str, list[str]] = field(default_factory=dict)
    """``<cmd>/<table>`` -> the chains that existed before: the others are ours."""
    fixed_dirs_before: list[str] = field(default_factory=list)
    mount_roots: list[str] = field(default_factory=list)
    """Dirs outside the work dir (a containerd root kept in the cache) whose mounts are ours."""
    nft_tables: list[str] = field(default_factory=list)
    """``inet <name>``: the NetworkPolicy controllers' nftables tables (removed on a clean stop by
    the controller itself; after a crash, by ``revert()``)."""

    @classmethod
    def create(cls, work_dir: Path) -> Ledger:
        LEDGER_DIR.mkdir(parents=True, exist_ok=True)
        me = os.getpid()
        ledger = cls(
            path=LEDGER_DIR / f"{me}-{int(time.time() * 1000)}.json",
            owner_pid=me,
            owner_start=_start_time(me) or "",
            work_dir=str(work_dir),
            chains_before={k: sorted(v) for k, v in _chains().items()},
            fixed_dirs_before=[str(d) for d in FIXED_DIRS if d.exists()],
        )
        ledger.save()
        return ledger

    @classmethod
    def load(cls, path: Path) -> Ledger:
        data = json.loads(path.read_text())
        data["path"] = path
        return cls(**data)

    def save(self) -> None:
        data = asdict(self)
        data["path"] = str(self.path)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.path)

    def add(self, kind: str, value: str) -> None:
        """Record a change before making it (kind: bridges, cgroup_names, sockets, mount_roots,
        nft_tables)."""
        items: list[str] = getattr(self, kind)
        if value not in items:
            items.append(value)
            self.save()

    def add_pid(self, pid: int) -> None:
        self.pids[str(pid)] = _start_time(pid) or ""
        self.save()

    def owner_alive(self) -> bool:
        start = _start_time(self.owner_pid)
        return start is not None and start == self.owner_start

    # ---- revert --------------------------------------------------------------------------------

    def revert(self) -> list[str]:
        """Undo everything recorded, processes first; returns what could not be undone."""
        problems: list[str] = []
        self._kill_processes()
        for cmd, table, chain in self._new_chains():
            _drop_chain(cmd, table, chain)
        for table in self.nft_tables:
            if table in _nft_tables():
                subprocess.run(["nft", "delete", "table", *table.split()], capture_output=True)
        for mount in sorted(self._mounts(), key=len, reverse=True):
            if subprocess.run(["umount", mount], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", mount], capture_output=True)
        for name in self.bridges:
            subprocess.run(["ip", "link", "del", name], capture_output=True)
        for cg in self._cgroup_dirs():
            _remove_cgroup_tree(cg)
        for d in FIXED_DIRS:
            if str(d) not in self.fixed_dirs_before and d.exists():
                if _mounts_under(d):
                    problems.append(f"{d} still has mounts")
                else:
                    shutil.rmtree(d, ignore_errors=True)
        problems += [f"cgroup {cg} left" for cg in self._cgroup_dirs()]
        problems += [f"bridge {b} left" for b in self.bridges if _link_exists(b)]
        problems += [f"mount {m} left" for m in self._mounts()]
        problems += [f"iptables {c} -t {t} chain {n} left" for c, t, n in self._new_chains()]
        problems += [f"nftables table {t} left" for t in set(self.nft_tables) & _nft_tables()]
        if not problems:
            self.path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                LEDGER_DIR.rmdir()
        return problems

    def _kill_processes(self) -> None:
        victims = {int(p) for p, st in self.pids.items() if st and _start_time(int(p)) == st}
        # containerd shims are daemons (reparented to init): found by the socket they serve.
        for pid, cmdline in _processes():
            if any(s in cmdline for s in self.sockets):
                victims.add(pid)
        for cg in self._cgroup_dirs():
            victims |= _cgroup_pids(cg)
        victims.discard(os.getpid())
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in victims:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(_alive(p) for p in victims):
                time.sleep(0.1)
            victims = {p for p in victims if _alive(p)}
            # Pods' processes in our cgroups are SIGKILLed at once (the kubelet is gone).
            for cg in self._cgroup_dirs():
                victims |= _cgroup_pids(cg)
            if not victims:
                return

    def _mounts(self) -> list[str]:
        roots = [Path(self.work_dir), *map(Path, self.mount_roots)]
        return sorted({m for r in roots for m in _mounts_under(r)})

    def _cgroup_dirs(self) -> list[Path]:
        return [
            CGROUP_ROOT / h.name / name
            for name in self.cgroup_names
            for h in hierarchies()
            if (CGROUP_ROOT / h.name / name).is_dir()
        ]

    def _new_chains(self) -> list[tuple[str, str, str]]:
        before = {k: set(v) for k, v in self.chains_before.items()}
        return [
            (cmd, table, chain)
            for key, chains in _chains().items()
            for chain in sorted(chains - before.get(key, set()))
            for cmd, table in [key.split("/")]
        ]


def revert_stale() -> list[str]:
    """Revert the ledgers of sessions whose owner died (a crashed test run); returns problems."""
    problems: list[str] = []
    if not LEDGER_DIR.is_dir():
        return problems
    for path in sorted(LEDGER_DIR.glob("*.json")):
        try:
            ledger = Ledger.load(path)
        except (OSError, ValueError, TypeError):
            continue
        if not ledger.owner_alive():
            problems += ledger.revert()
    return problems


# ---- host state, for before/after checks ------------------------------------------------------


def snapshot() -> dict[str, list[str]]:
    """Processes, links, iptables chains and rules, mounts, cgroups and fixed dirs, as sorted
    strings: two snapshots around a test tier must be equal."""
    rules: list[str] = []
    for cmd in IPTABLES:
        for table in IPTABLES_TABLES:
            res = subprocess.run([cmd, "-t", table, "-S"], capture_output=True, text=True)
            rules += [f"{cmd}/{table}: {r}" for r in res.stdout.splitlines()]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {
        "processes": sorted(
            f"{pid} {name}" for pid, name in _process_names() if name in NODE_PROCESS_NAMES
        ),
        "links": sorted(re.sub(r"^\d+: ", "", ln).split(":")[0] for ln in links.splitlines()),
        "iptables": sorted(rules),
        "mounts": sorted(_all_mounts()),
        "cgroups": sorted(
            f"{h.name}/{d.name}" for h in hierarchies() for d in h.iterdir() if d.is_dir()
        ),
        "dirs": sorted(str(d) for d in FIXED_DIRS if d.exists()),
        "nftables": sorted(t for t in _nft_tables() if t.startswith("inet ")),
    }


def diff(before: dict[str, list[str]], after: dict[str, list[str]]) -> dict[str, list[str]]:
    """What ``after`` has that ``before`` lacked, per kind (empty when nothing was left)."""
    out = {k: sorted(set(after.get(k, [])) - set(before.get(k, []))) for k in after}
    return {k: v for k, v in out.items() if v}


# ---- helpers ---------------------------------------------------------------------------------


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _processes() -> list[tuple[int, str]]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                out.append(
                    (int(d.name), (d / "cmdline").read_bytes().replace(b"\0", b" ").decode())
                )
    return out


def _process_names() -> list[tuple[int, str]]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                out.append((int(d.name), (d / "comm").read_text().strip()))
    return out


def hierarchies() -> list[Path]:
    if not CGROUP_ROOT.is_dir():
        return []
    if (CGROUP_ROOT / "cgroup.procs").exists():  # pure cgroup v2
        return [CGROUP_ROOT]
    return [h for h in CGROUP_ROOT.iterdir() if h.is_dir() and not h.is_symlink()]


def _cgroup_pids(cg: Path) -> set[int]:
    pids: set[int] = set()
    for procs in cg.rglob("cgroup.procs"):
        with contextlib.suppress(OSError, ValueError):
            pids |= {int(p) for p in procs.read_text().split()}
    return pids


def _remove_cgroup_tree(cg: Path) -> None:
    dirs = sorted((p for p in cg.rglob("*") if p.is_dir()), key=lambda p: len(p.parts))
    for d in [*reversed(dirs), cg]:
        with contextlib.suppress(OSError):
            d.rmdir()


def _all_mounts() -> list[str]:
    # mountinfo field 5 is the mount point (octal escapes for spaces and the like).
    text = Path("/proc/self/mountinfo").read_text()
    return [ln.split()[4] for ln in text.splitlines()]


def _mounts_under(root: Path) -> list[str]:
    prefix = str(root).rstrip("/") + "/"
    return [m for m in _all_mounts() if m.startswith(prefix) or m == str(root)]


def _link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


def _chains() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for cmd in IPTABLES:
        if shutil.which(cmd) is None:
            continue
        for table in IPTABLES_TABLES:
            res = subprocess.run([cmd, "-t", table, "-S"], capture_output=True, text=True)
            out[f"{cmd}/{table}"] = {
                ln.split()[1] for ln in res.stdout.splitlines() if ln.startswith("-N ")
            }
    return out


def _nft_tables() -> set[str]:
    """``<family> <name>`` of every nftables table (empty without the ``nft`` tool)."""
    if shutil.which("nft") is None:
        return set()
    res = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True)
    return {ln.removeprefix("table ").strip() for ln in res.stdout.splitlines() if ln.strip()}


def _drop_chain(cmd: str, table: str, chain: str) -> None:
    """Delete every rule that jumps to ``chain`` (in any chain), then flush and delete it."""
    rules = subprocess.run([cmd, "-t", table, "-S"], capture_output=True, text=True).stdout
    for rule in rules.splitlines():
        parts = shlex.split(rule)
        if parts[:1] == ["-A"] and re.search(rf"(^| )-[jg] {re.escape(chain)}( |$)", rule):
            subprocess.run([cmd, "-t", table, "-D", *parts[1:]], capture_output=True)
    subprocess.run([cmd, "-t", table, "-F", chain], capture_output=True)
    subprocess.run([cmd, "-t", table, "-X", chain], capture_output=True)
