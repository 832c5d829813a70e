#!/usr/bin/env python3
"""Ranks on separate hosts: Gloo or MPI ranks in Linux network namespaces joined by a bridge.

Run by tests/meson.build as root (exit 77, Meson's "skipped", when not root, or where network
namespaces, veth pairs, bridges or tc cannot be used). Builds, per run, a small switched network
inside namespaces this test creates and always deletes (also on SIGTERM or SIGINT):

    tsn-<pid>-sw        a bridge br0 with ports p0, p1, p2
    tsn-<pid>-0/1/2     one "host" each: eth0 (a veth to port pI), 10.77.0.(I+1)/24, and lo

Nothing outside these namespaces is touched; the ranks share this machine's filesystem (the Gloo
file store and the programs), as cluster nodes share NFS. Scenarios (--launch tessera-run, as Gloo's ranks start, or mpirun):

  conformance    the conformance suite on 3 ranks, one per host (Gloo: tools/tessera-run --hosts
                 with --rsh 'ip netns exec {host} sh -c' --iface eth0; MPI: mpirun --host with an
                 `ip netns exec` rsh agent and the TCP transport); the traffic must cross the bridge
  bandwidth      all_reduce of 4 MiB between hosts 0 and 1, first over the bare link, then with
                 host 1's link limited to 100 Mbit/s each way by tc's token bucket filter (tbf);
                 the bus bandwidth (= buffer / time on 2 ranks) must lie within [40%, 105%] of the
                 limit: above it the limit would not be what bounds the traffic; 50% is one direction
                 after the other (MPI's default one TCP connection per peer), less a margin for a
                 loaded machine. How close each transport comes to the limit (Gloo and MPI with
                 --mca btl_tcp_links 2 reach 75-100% on a quiet one) is a benchmark figure, kept in
                 the results JSON, not a pass/fail bound (a CI run measured 67% once); each call
                 must move the buffer each way across the link; the bare link must be faster than
                 twice the limit
  link down      3 ranks loop over 64 MiB all_reduces (TESSERA_COMM_TIMEOUT=5); host 1's eth0 is
                 taken down mid-loop. Every rank -- the two cut off from rank 1 and rank 1 itself --
                 must end within 2x the timeout with a CommError that names the operation, its rank
                 and a peer it lost (rank 1 for ranks 0 and 2). Gloo ranks are started directly, not
                 through tessera-run, which would stop the others at the first failure before they
                 report. MPI ranks write their error to TESSERA_ERROR_DIR (mpirun's output path to
                 host 1 is cut too). Under mpirun the first rank to time out ends the job
                 (MPI_Abort): a rank that abort reaches before its own timeout fires reports the
                 SIGTERM and names its collective instead, but rank 1 and one of ranks 0 and 2
                 must name the lost peer. mpirun itself must end once the link is back up (it
                 waits for its daemon on host 1 until then).

Every wait is bounded. --results FILE writes the measured numbers as JSON.
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

SKIP = 77
HOSTS = 3
SUBNET = "10.77.0"
TIMEOUT = 5.0        # TESSERA_COMM_TIMEOUT of the link-down scenario
RATE_MBIT = 100      # the token bucket's rate
BANDWIDTH_BYTES = 4 << 20
MPIRUN_AFTER_LINK_UP = 30.0  # seconds mpirun may take to end once its daemon is reachable again
failures = []
results = {}


def check(ok, what, detail=""):
    print(("ok    " if ok else "FAIL  ") + what + ("" if ok else "\n      " + detail.strip().replace("\n", "\n      ")))
    sys.stdout.flush()
    if not ok:
        failures.append(what)
    return ok


def run(argv, timeout=20, check_status=True):
    done = subprocess.run(argv, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check_status and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit status {done.returncode}: "
                           f"{done.stderr.decode('utf-8', 'replace').strip()}")
    return done.stdout.decode("utf-8", "replace")


class Network:
    """The namespaces, bridge and links of one run; down() removes everything up() made."""

    def __init__(self, hosts):
        self.tag = f"tsn-{os.getpid()}"
        self.hosts = [f"{self.tag}-{i}" for i in range(hosts)]
        self.switch = f"{self.tag}-sw"
        self.made = []

    def address(self, i):
        return f"{SUBNET}.{i + 1}"

    def up(self):
        for ns in [self.switch] + self.hosts:
            run(["ip", "netns", "add", ns])
            self.made.append(ns)
        sw = ["ip", "-n", self.switch]
        run(sw + ["link", "set", "lo", "up"])
        run(sw + ["link", "add", "name", "br0", "type", "bridge"])
        run(sw + ["link", "set", "br0", "up"])
        for i, ns in enumerate(self.hosts):
            # Both ends are made inside their namespaces: no interface ever appears outside them.
            run(["ip", "link", "add", "name", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}",
                 "netns", self.switch])
            run(sw + ["link", "set", f"p{i}", "master", "br0"])
            run(sw + ["link", "set", f"p{i}", "up"])
            run(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0"])
            run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def link(self, i, state):
        run(["ip", "-n", self.hosts[i], "link", "set", "eth0", state])

    def limit(self, i, mbit):
        """Token bucket on both directions of host i's link: its eth0 and the switch's port."""
        for ns, dev in ((self.hosts[i], "eth0"), (self.switch, f"p{i}")):
            run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                 f"{mbit}mbit", "burst", "64kb", "latency", "20ms"])

    def unlimit(self, i):
        for ns, dev in ((self.hosts[i], "eth0"), (self.switch, f"p{i}")):
            run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check_status=False)

    def port_bytes(self, only=None):
        """Bytes the switch's ports have carried (received plus sent): all ports, or port `only`."""
        total = 0
        for i in range(len(self.hosts)) if only is None else [only]:
            for direction in ("rx_bytes", "tx_bytes"):
                text = run(["ip", "netns", "exec", self.switch, "cat", f"/sys/class/net/p{i}/statistics/{direction}"])
                total += int(text.strip() or 0)
        return total

    def down(self):
        for ns in self.made:
            kill_namespace_processes(ns)
        for ns in reversed(self.made):
            run(["ip", "netns", "del", ns], check_status=False)
        self.made = []


def kill_namespace_processes(ns):
    """SIGKILL whatever still runs in a namespace this test made (ranks, orted), bounded."""
    for _ in range(20):
        try:
            pids = [int(p) for p in run(["ip", "netns", "pids", ns], check_status=False).split()]
        except (subprocess.SubprocessError, ValueError):
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def remove_stale_namespaces():
    """Namespaces of earlier runs of this test whose process is gone (killed with SIGKILL)."""
    for line in run(["ip", "netns", "list"], check_status=False).splitlines():
        m = re.match(r"^(tsn-(\d+)-(?:\d+|sw))\b", line)
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            kill_namespace_processes(m.group(1))
            run(["ip", "netns", "del", m.group(1)], check_status=False)


def can_run():
    """None when this machine allows the test, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    probe = f"tsn-{os.getpid()}-probe"
    try:
        run(["ip", "netns", "add", probe])
    except (RuntimeError, subprocess.SubprocessError) as error:
        return f"cannot create a network namespace: {error}"
    try:
        run(["ip", "-n", probe, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb"])
        run(["ip", "-n", probe, "link", "add", "name", "br", "type", "bridge"])
        run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "va", "root", "tbf", "rate", "1mbit",
             "burst", "64kb", "latency", "20ms"])
    except (RuntimeError, subprocess.SubprocessError) as error:
        return f"veth, bridge or tc tbf not available: {error}"
    finally:
        run(["ip", "netns", "del", probe], check_status=False)
    return None


class Process:
    """A process with its output collected by threads (so pipes never fill up)."""

    def __init__(self, argv, env):
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.lines = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in iter(self.proc.stdout.readline, b""):
            self.lines.append(line.decode("utf-8", "replace"))

    def text(self):
        return "".join(self.lines)

    def wait(self, seconds):
        try:
            self.proc.wait(timeout=max(0.0, seconds))
        except subprocess.TimeoutExpired:
            return None
        self.thread.join(timeout=5)
        return self.proc.returncode

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def base_env(extra=None):
    env = dict(os.environ)
    for k in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(k, None)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.update(extra or {})
    return env


class Launch:
    """How a backend starts `program` on the first `count` hosts: a Process."""

    def __init__(self, args, net, workdir):
        self.args, self.net, self.workdir = args, net, workdir
        if args.launch == "mpirun":
            # Open MPI's rsh launcher runs `agent <host> orted ...` and expects a remote shell. Each
            # host also gets its own hostname (a UTS namespace), as a real host has: Open MPI keys
            # its session directory in the shared /tmp by hostname, and daemons of one name race
            # to create it ("mkdir ... File exists", seen in 1 of 8 runs before this).
            self.agent = os.path.join(workdir, "netns-agent")
            with open(self.agent, "w") as f:
                f.write('#!/bin/sh\nhost="$1"; shift\n'
                        'exec ip netns exec "$host" unshare --uts \\\n'
                        '  sh -c \'hostname "$0" && exec sh -c "$1"\' "$host" "$*"\n')
            os.chmod(self.agent, 0o755)

    def start(self, count, program, program_args=(), timeout=60.0, extra=None):
        hosts = self.net.hosts[:count]
        env = base_env(dict(TESSERA_COMM_TIMEOUT=f"{timeout:g}", **(extra or {})))
        if self.args.launch == "tessera-run":
            argv = [sys.executable, self.args.launcher, "--hosts", ",".join(hosts),
                    "--rsh", "ip netns exec {host} sh -c", "--iface", "eth0", "--timeout", f"{timeout:g}",
                    "--grace", "2", "--", program, *program_args]
            return Process(argv, env)
        # mpirun runs in host 0 (its daemons must reach it); every rank through the agent, TCP
        # only (shared memory would bypass the network), on eth0.
        argv = ["ip", "netns", "exec", hosts[0], self.args.mpirun, "--host", ",".join(f"{h}:1" for h in hosts),
                "-n", str(count), "--mca", "plm_rsh_agent", self.agent, "--mca", "btl", "tcp,self",
                "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0"]
        for k in sorted(env):
            if k.startswith("TESSERA_"):
                argv += ["-x", k]
        return Process(argv + [program, *program_args], env)


def scenario_conformance(args, net, launch):
    before = net.port_bytes()
    start = time.monotonic()
    job = launch.start(HOSTS, args.conformance)
    try:
        code = job.wait(150)
        took = time.monotonic() - start
        text = job.text()
        crossed = net.port_bytes() - before
        summaries = re.findall(r"rank (\d+): (\d+) checks, (\d+) failed", text)
        passed = sorted(r for r, _, failed in summaries if failed == "0")
        check(code == 0 and passed == [str(r) for r in range(HOSTS)],
              f"{args.backend} conformance on {HOSTS} hosts: every rank passes ({took:.1f} s, status {code}, "
              f"passed: ranks {', '.join(passed) or 'none'})", text)
        # The suite all_reduces 64 MiB among other things: far more than could go anywhere but the bridge.
        check(crossed > 64 << 20, f"{args.backend} conformance: the traffic crossed the bridge "
              f"({crossed / 2**20:.0f} MiB through its ports)")
        results["conformance"] = {"hosts": HOSTS, "seconds": round(took, 2), "status": code,
                                  "bridge_MiB": round(crossed / 2**20, 1),
                                  "checks_per_rank": [int(c) for _, c, _ in summaries]}
    finally:
        job.kill()


def measure(args, net, launch, label, seconds, extra=None):
    """Runs the bandwidth program on hosts 0 and 1; its JSON line plus the bytes that crossed host
    1's link per all_reduce and direction (the switch port's counters, over the warm-up call and
    the timed ones)."""
    before = net.port_bytes(1)
    job = launch.start(2, args.bandwidth, ["--bytes", str(BANDWIDTH_BYTES), "--seconds", str(seconds)], extra=extra)
    try:
        code = job.wait(seconds + 60)
        text = job.text()
        found = [json.loads(m) for m in re.findall(r"(\{\"bench\": \"netns_all_reduce\".*\})", text)]
        if not check(code == 0 and len(found) == 1, f"{args.backend} bandwidth ({label}): the measurement ran "
                     f"(status {code})", text):
            return None
        crossed = net.port_bytes(1) - before
        found[0]["link_bytes_per_call_each_way"] = round(crossed / 2 / (found[0]["iterations"] + 1))
        return found[0]
    finally:
        job.kill()


def scenario_bandwidth(args, net, launch):
    bare = measure(args, net, launch, "bare link", 1.0)
    net.limit(1, RATE_MBIT)
    try:
        limited = measure(args, net, launch, f"{RATE_MBIT} Mbit/s token bucket", 3.0)
        # Open MPI's TCP transport with its default one connection per peer does not keep both
        # directions of the link busy at once (measured here: 47% of the limit, with any of its
        # all_reduce algorithms); with two connections per peer it does.
        links2 = measure(args, net, launch, f"{RATE_MBIT} Mbit/s, btl_tcp_links 2", 3.0,
                         extra={"OMPI_MCA_btl_tcp_links": "2"}) if args.launch == "mpirun" else None
    finally:
        net.unlimit(1)
    if bare is None or limited is None:
        return
    rate = RATE_MBIT * 1e6 / 8 / 1e6  # MB/s each way
    # On 2 ranks every all_reduce algorithm moves the whole buffer each way (bus bandwidth =
    # buffer / time), so the link bounds it by the rate: at best (both directions at once) the
    # rate itself, at worst (one direction after the other) half of it.
    # The lower bound is a sanity floor, not a speed target (see the header comment).
    runs = [("", limited, 0.4)]
    if links2 is not None:
        runs.append((", btl_tcp_links 2", links2, 0.4))
    for label, run_, lower in runs:
        bus, each_way = run_["busbw_MBps"], run_["link_bytes_per_call_each_way"]
        check(lower * rate <= bus <= 1.05 * rate,
              f"{args.backend} bandwidth{label}: all_reduce of {BANDWIDTH_BYTES >> 20} MiB on 2 hosts over the "
              f"{RATE_MBIT} Mbit/s link: bus bandwidth {bus:.2f} MB/s, {bus / rate:.0%} of the limit's {rate:.1f} MB/s "
              f"each way (median of {run_['iterations']} calls, {run_['median_s'] * 1e3:.0f} ms each; "
              f"accepted: {lower:.0%} to 105%)")
        check(0.9 * BANDWIDTH_BYTES <= each_way <= 1.5 * BANDWIDTH_BYTES,
              f"{args.backend} bandwidth{label}: each call moved the buffer across the limited link: "
              f"{each_way / 2**20:.2f} MiB each way per call")
    bare_bus = bare["busbw_MBps"]
    check(bare_bus > 2 * rate, f"{args.backend} bandwidth: the bare link is faster: {bare_bus:.0f} MB/s "
          f"({bare['median_s'] * 1e3:.1f} ms per call), so the limit is what was measured")
    results["bandwidth"] = {"bytes": BANDWIDTH_BYTES, "ranks": 2, "limit_Mbit": RATE_MBIT, "limit_MBps_each_way": rate,
                            "tbf": "rate 100mbit burst 64kb latency 20ms, both directions of host 1's link",
                            "limited": limited, "bare": bare,
                            "busbw_fraction_of_limit": round(limited["busbw_MBps"] / rate, 3)}
    if links2 is not None:
        results["bandwidth"].update(limited_btl_tcp_links_2=links2, btl_tcp_links_2_fraction_of_limit=round(
            links2["busbw_MBps"] / rate, 3))


def fault_patterns(args, r):
    """(operation and rank named, peer named) for rank r's error after host 1's link went down."""
    # A rank started by tessera-run (Gloo) throws a CommError; under mpirun, MPI's watchdog prints
    # "tessera: CommError: ...", or a rank whose call check (the exchange before a call) timed out
    # ends the job "after: MpiComm ...".
    cls = args.class_name if args.launch == "mpirun" else f"CommError: {args.class_name}"
    op = rf"{cls} all_reduce\(float32 x 16777216, avg\)( call check)? on rank {r} of {HOSTS}"
    # Ranks 0 and 2 lost rank 1; rank 1 lost everyone. The peer is named by Gloo's error
    # ("peer: rank q") or by the stall report ("no answer: rank q (...)", "not reached: rank q").
    others = "1" if r != 1 else "[02]"
    peer = rf"\(peer: rank {others}\)|(no answer|not reached): (.*; )?rank {others} \("
    return op, peer


def scenario_link_down_gloo(args, net, workdir):
    store = tempfile.mkdtemp(prefix="store-", dir=workdir)
    ranks = []
    for r, host in enumerate(net.hosts):
        env = base_env({"TESSERA_RANK": str(r), "TESSERA_WORLD_SIZE": str(HOSTS), "TESSERA_STORE": "file://" + store,
                        "TESSERA_GLOO_IFACE": "eth0", "TESSERA_COMM_TIMEOUT": f"{TIMEOUT:g}"})
        ranks.append(Process(["ip", "netns", "exec", host, args.fault, "allreduce"], env))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(any("ready" in l for l in p.lines) for p in ranks) \
                and all(p.proc.poll() is None for p in ranks):
            time.sleep(0.02)
        if not check(all(any("ready" in l for l in p.lines) for p in ranks), "gloo link down: all 3 ranks started",
                     "\n".join(p.text() for p in ranks)):
            return
        time.sleep(0.3)  # in the middle of the loop
        down_at = time.monotonic()
        net.link(1, "down")
        ended = {}
        for r, p in enumerate(ranks):
            code = p.wait(down_at + 2 * TIMEOUT + 1 - time.monotonic())
            took = time.monotonic() - down_at
            text = p.text()
            op, peer = fault_patterns(args, r)
            check(code == 3 and took <= 2 * TIMEOUT,
                  f"gloo link down: rank {r} ends with a CommError within 2x the timeout ({took:.2f} s, status {code})",
                  text)
            check(re.search(op, text) is not None and re.search(peer, text) is not None,
                  f"gloo link down: rank {r}'s error names the operation, its rank and the lost peer", text)
            error = next((l.strip() for l in p.lines if "CommError" in l), "(none)")
            print("      " + error)
            ended[r] = {"seconds_after_link_down": round(took, 2), "status": code, "error": error}
        results["link_down"] = {"timeout_s": TIMEOUT, "ranks": ended}
    finally:
        for p in ranks:
            p.kill()


def process_gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # ended, not yet reaped
    except (FileNotFoundError, ProcessLookupError):
        return True


def scenario_link_down_mpi(args, net, launch, workdir):
    errors = tempfile.mkdtemp(prefix="errors-", dir=workdir)
    job = launch.start(HOSTS, args.fault, ["allreduce"], timeout=TIMEOUT, extra={"TESSERA_ERROR_DIR": errors})
    link_is_down = False
    try:
        deadline = time.monotonic() + 60
        pids = {}
        while time.monotonic() < deadline and len(pids) < HOSTS and job.proc.poll() is None:
            pids = {int(m.group(1)): int(m.group(2)) for l in list(job.lines)
                    for m in [re.search(r"rank (\d+) ready pid (\d+)", l)] if m}
            time.sleep(0.02)
        if not check(len(pids) == HOSTS, "mpi link down: all 3 ranks started", job.text()):
            return
        time.sleep(0.3)
        down_at = time.monotonic()
        net.link(1, "down")
        link_is_down = True
        ended, own, killed = {}, [], []
        for r in range(HOSTS):
            while not process_gone(pids[r]) and time.monotonic() < down_at + 2 * TIMEOUT + 1:
                time.sleep(0.05)
            took = time.monotonic() - down_at
            gone = process_gone(pids[r])
            path = os.path.join(errors, f"rank{r}.txt")
            text = open(path).read() if os.path.exists(path) else "(no error file)"
            op, peer = fault_patterns(args, r)
            check(gone and took <= 2 * TIMEOUT, f"mpi link down: rank {r} ends within 2x the timeout "
                  f"({took:.2f} s{'' if gone else ', still running'})", job.text())
            if re.search(op, text) and "timed out after 5 s" in text and re.search(peer, text):
                own.append(r)
            elif re.search(r"received SIGTERM .*; its last collective was "
                           r"MpiComm all_reduce\(float32 x 16777216, avg\)", text):
                killed.append(r)  # the job's abort (another rank's error) reached it before its own timeout
            print("      " + (text.strip().splitlines() or ["(none)"])[0])
            ended[r] = {"seconds_after_link_down": round(took, 2), "error": text.strip()}
        # Under mpirun the first rank to time out ends the job (MPI_Abort; mpi.hpp): a rank that
        # the abort reaches first says so and names its collective. Rank 1 is cut off from the
        # abort and always reports itself; of ranks 0 and 2 at least one must name rank 1.
        check(sorted(own + killed) == list(range(HOSTS)) and 1 in own and (0 in own or 2 in own),
              f"mpi link down: every rank's TESSERA_ERROR_DIR file names the operation: with its rank, the "
              f"timeout and the lost peer (ranks {own}), or as the collective the job's abort ended (ranks {killed})",
              "\n".join(f"--- rank {r} ---\n{e['error']}" for r, e in ended.items()) + "\n--- mpirun output ---\n"
              + job.text())
        # mpirun cannot end while its daemon on host 1 is cut off (Open MPI waits for it); with
        # the link back it must.
        net.link(1, "up")
        link_is_down = False
        up_at = time.monotonic()
        code = job.wait(MPIRUN_AFTER_LINK_UP)
        check(code is not None and code != 0, f"mpi link down: mpirun ends, non-zero, once the link is back "
              f"({time.monotonic() - up_at:.1f} s, status {code})", job.text())
        results["link_down"] = {"timeout_s": TIMEOUT, "ranks": ended, "named_own_error": own, "ended_by_abort": killed,
                                "mpirun_end_after_link_up_s": round(time.monotonic() - up_at, 2), "mpirun_status": code}
    finally:
        if link_is_down:
            net.link(1, "up")
        job.kill()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", required=True, help="the backend's name in the backend list (labels)")
    parser.add_argument("--class-name", required=True, help="the communicator class its errors name (GlooComm)")
    parser.add_argument("--launch", choices=["mpirun", "tessera-run"], required=True,
                        help="how its ranks start on several hosts: mpirun --host, or tessera-run --hosts")
    parser.add_argument("--conformance", required=True, help="tests/comm/conformance_main.cpp built for the backend")
    parser.add_argument("--bandwidth", required=True, help="tests/net/bandwidth_main.cpp built for the backend")
    parser.add_argument("--fault", required=True, help="tests/comm/fault_main.cpp built for the backend")
    parser.add_argument("--launcher", help="tools/tessera-run (--launch tessera-run)")
    parser.add_argument("--mpirun", default="mpirun")
    parser.add_argument("--only", choices=["conformance", "bandwidth", "link-down"], action="append",
                        help="run only these scenarios (repeatable)")
    parser.add_argument("--results", help="write the measured numbers here as JSON")
    args = parser.parse_args()
    if args.launch == "tessera-run" and not args.launcher:
        parser.error("--launch tessera-run needs --launcher")
    why = can_run()
    if why:
        print(f"skipped: {why}")
        return SKIP

    def stop(signum, _frame):
        raise SystemExit(128 + signum)  # unwinds through the finally blocks that delete the network
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)

    remove_stale_namespaces()
    net = Network(HOSTS)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tessera-netns-") as workdir:
        try:
            net.up()
            launch = Launch(args, net, workdir)
            only = args.only or ["conformance", "bandwidth", "link-down"]
            if "conformance" in only:
                scenario_conformance(args, net, launch)
            if "bandwidth" in only:
                scenario_bandwidth(args, net, launch)
            if "link-down" in only:
                if args.launch == "tessera-run":
                    scenario_link_down_gloo(args, net, workdir)
                else:
                    scenario_link_down_mpi(args, net, launch, workdir)
        finally:
            net.down()
    results.update(backend=args.backend, seconds=round(time.monotonic() - started, 1), failed=list(failures))
    if args.results:
        with open(args.results, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
    print(f"{len(failures)} failed ({time.monotonic() - started:.1f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
