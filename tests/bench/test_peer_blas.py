#!/usr/bin/env python3
"""The PyTorch peer's setup (bench/peer.py) without PyTorch: the BLAS decision refuses the reference
BLAS (the 40x artefact: PyTorch measured on Debian's libblas3 at 2.5k img/s) or selects OpenBLAS for
the peer alone, and the OPENBLAS_CORETYPE candidates follow the CPU's flags and the OpenBLAS build.
Fake update-alternatives outputs, file systems and /proc/cpuinfo flags stand in for the machine.

    python3 tests/bench/test_peer_blas.py

One end-to-end check runs where /usr/bin/python3 has torch and Debian's reference BLAS is installed:
torch_throughput.py started on the reference BLAS must refuse (skipped otherwise).
"""
import os
import subprocess
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import peer  # noqa: E402

LIB = "/usr/lib/x86_64-linux-gnu"
REFERENCE = f"{LIB}/blas/libblas.so.3"
OPENBLAS = f"{LIB}/openblas-pthread/libblas.so.3"


def alternatives(value):
    """update-alternatives --query output as Debian 12 prints it, selecting value."""
    return (f"Name: libblas.so.3-x86_64-linux-gnu\nLink: {LIB}/libblas.so.3\nStatus: manual\n"
            f"Best: {OPENBLAS}\nValue: {value}\n\nAlternative: {REFERENCE}\nPriority: 10\n\n"
            f"Alternative: {OPENBLAS}\nPriority: 100\n")


def no_links(path):
    return path


# /proc/cpuinfo flags of the two machines sessions get, and of two older CPUs.
EPYC = ("fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi1 bmi2 avx512f avx512dq avx512ifma avx512cd "
        "avx512bw avx512vl avx512_bf16 avx512vbmi avx512_vnni")
SAPPHIRE_RAPIDS = EPYC + " amx_bf16 avx512_fp16 amx_tile amx_int8"
HASWELL = "fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi1 bmi2"
SANDY_BRIDGE = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx"
OPENBLAS_0_3_21 = {"Haswell", "Zen", "SkylakeX", "Cooperlake"}


def cpuinfo(flags):
    return f"processor\t: 0\nmodel name\t: test\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: fpu\n"


class BlasDecision(unittest.TestCase):
    def decide(self, alternatives_text, env=None, openblas_dir=None, exists=lambda p: False):
        env = env or {}
        libblas, how = peer.resolve_libblas(env, alternatives_text, exists=exists, realpath=no_links)
        return peer.choose_blas(env, libblas, how, openblas_dir)

    def test_reference_blas_without_openblas_is_refused_with_the_package_to_install(self):
        with self.assertRaises(peer.PeerSetupError) as caught:
            self.decide(alternatives(REFERENCE))
        message = str(caught.exception)
        self.assertIn("refusing to time PyTorch", message)
        self.assertIn(REFERENCE, message)
        self.assertIn(f"{REFERENCE} (reference BLAS", message)
        self.assertIn("apt-get install libopenblas0-pthread", message)

    def test_no_blas_at_all_is_refused(self):
        with self.assertRaises(peer.PeerSetupError) as caught:
            self.decide(None)
        self.assertIn("apt-get install libopenblas0-pthread", str(caught.exception))

    def test_reference_blas_with_openblas_installed_selects_openblas_for_the_peer_only(self):
        additions, record = self.decide(alternatives(REFERENCE), env={"LD_LIBRARY_PATH": "/opt/x"},
                                         openblas_dir=f"{LIB}/openblas-pthread")
        self.assertEqual(additions, {"LD_LIBRARY_PATH": f"{LIB}/openblas-pthread:/opt/x"})
        self.assertEqual(record["libblas_default_kind"], "reference")
        self.assertEqual(record["selected"], OPENBLAS)
        self.assertIn("for the peer only", record["selected_by"])

    def test_openblas_selected_by_the_system_is_used_as_it_is(self):
        additions, record = self.decide(alternatives(OPENBLAS), openblas_dir=f"{LIB}/openblas-pthread")
        self.assertEqual(additions, {})
        self.assertEqual(record["selected"], OPENBLAS)

    def test_ld_library_path_wins_over_the_system_choice(self):
        # The loader searches LD_LIBRARY_PATH first: a reference BLAS there is what the peer gets.
        env = {"LD_LIBRARY_PATH": f"{LIB}/blas"}
        with self.assertRaises(peer.PeerSetupError):
            self.decide(alternatives(OPENBLAS), env=env, exists=lambda p: p == f"{LIB}/blas/libblas.so.3")
        additions, _ = self.decide(alternatives(OPENBLAS), env=env, openblas_dir=f"{LIB}/openblas-pthread",
                                   exists=lambda p: p == f"{LIB}/blas/libblas.so.3")
        self.assertTrue(additions["LD_LIBRARY_PATH"].startswith(f"{LIB}/openblas-pthread:"))

    def test_the_system_link_is_followed_without_update_alternatives(self):
        links = {f"{LIB}/libblas.so.3": f"{LIB}/blas/libblas.so.3.11.0"}
        libblas, how = peer.resolve_libblas({}, None, exists=lambda p: p in links, realpath=lambda p: links.get(p, p))
        self.assertEqual((libblas, how), (f"{LIB}/blas/libblas.so.3.11.0", f"{LIB}/libblas.so.3"))
        self.assertEqual(peer.blas_kind(libblas), "reference")

    def test_blas_kinds(self):
        self.assertEqual(peer.blas_kind(f"{LIB}/openblas-pthread/libopenblasp-r0.3.21.so"), "openblas")
        self.assertEqual(peer.blas_kind(f"{LIB}/blas/libblas.so.3.11.0"), "reference")
        self.assertEqual(peer.blas_kind(f"{LIB}/libmkl_rt.so"), "other")
        self.assertEqual(peer.blas_kind(None), "none")

    def test_peer_environment(self):
        setup = object.__new__(peer.Peer)
        setup.base_env = {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "1048576", "OMP_WAIT_POLICY": "ACTIVE",
                          "OPENBLAS_NUM_THREADS": "8", "HOME": "/root"}
        setup.blas_env = {"LD_LIBRARY_PATH": f"{LIB}/openblas-pthread"}
        env = setup.env()
        self.assertEqual(env, {"HOME": "/root", "OPENBLAS_NUM_THREADS": "1",
                               "LD_LIBRARY_PATH": f"{LIB}/openblas-pthread"})
        env = setup.env("SkylakeX", "PASSIVE")
        self.assertEqual((env["OPENBLAS_CORETYPE"], env["OMP_WAIT_POLICY"]), ("SkylakeX", "PASSIVE"))
        self.assertNotIn("OPENBLAS_L2_SIZE", env)
        self.assertNotIn("GLIBC_TUNABLES", env)
        env = setup.env_of({"OPENBLAS_CORETYPE": "unset", "OMP_WAIT_POLICY": "unset", "malloc": "retain"})
        self.assertEqual(env["GLIBC_TUNABLES"], peer.RETAIN_TUNABLES)
        self.assertNotIn("OPENBLAS_CORETYPE", env)
        env = setup.env_of({"OPENBLAS_CORETYPE": "unset", "OMP_WAIT_POLICY": "unset", "malloc": "jemalloc"})
        self.assertEqual((env["LD_PRELOAD"], env["MALLOC_CONF"]), (peer.JEMALLOC_LIBRARY, peer.JEMALLOC_CONF))
        self.assertNotIn("GLIBC_TUNABLES", env)

    def test_jemalloc_probed_only_where_installed(self):
        self.assertEqual(peer.available_mallocs(lambda p: False), ("default", "retain"))
        self.assertEqual(peer.available_mallocs(lambda p: p == peer.JEMALLOC_LIBRARY), ("default", "retain", "jemalloc"))


class Coretypes(unittest.TestCase):
    def candidates(self, flags, accepted=OPENBLAS_0_3_21):
        return peer.coretype_candidates(peer.cpu_flags(cpuinfo(flags)), accepted)

    def test_epyc_with_avx512_bf16(self):
        self.assertEqual(self.candidates(EPYC), ["unset", "Haswell", "Zen", "SkylakeX", "Cooperlake"])

    def test_sapphire_rapids_only_where_openblas_knows_it(self):
        self.assertEqual(self.candidates(SAPPHIRE_RAPIDS), ["unset", "Haswell", "Zen", "SkylakeX", "Cooperlake"])
        self.assertEqual(self.candidates(SAPPHIRE_RAPIDS, OPENBLAS_0_3_21 | {"SapphireRapids"})[-1], "SapphireRapids")
        self.assertNotIn("SapphireRapids", self.candidates(EPYC, OPENBLAS_0_3_21 | {"SapphireRapids"}))

    def test_no_avx512_kernels_without_avx512(self):
        self.assertEqual(self.candidates(HASWELL), ["unset", "Haswell", "Zen"])
        self.assertEqual(self.candidates(SANDY_BRIDGE), ["unset"])
        self.assertEqual(self.candidates(EPYC, set()), ["unset"])

    def test_names_found_in_the_openblas_library(self):
        blob = b"\x7fELF\0junk\0Prescott\0Haswell\0Zen\0SkylakeX\0Cooperlake\0Unknown\0Zenith\0"
        self.assertEqual(peer.openblas_corenames(blob), OPENBLAS_0_3_21)
        self.assertEqual(peer.openblas_corenames(b"\0Haswell\0sapphirerapids\0"), {"Haswell", "SapphireRapids"})

    def test_malloc_then_wait_policy_then_coretypes(self):
        speed = {("unset", "unset"): 68.0, ("unset", "PASSIVE"): 70.0, ("unset", "ACTIVE"): 50.0,
                 ("Haswell", "PASSIVE"): 42.0, ("Zen", "PASSIVE"): 39.5, ("SkylakeX", "PASSIVE"): 72.6}
        calls = []

        def run(coretype, policy, malloc):
            calls.append((coretype, policy, malloc))
            retained = 1.5 if malloc == "retain" else 1.0  # page faults avoided
            return speed[(coretype, policy)] * retained, "Cooperlake" if coretype == "unset" else coretype

        best, trials = peer.choose_config(run, ["unset", "Haswell", "Zen", "SkylakeX", "Cooperlake"],
                                          mallocs=("default", "retain"))
        # malloc first, then the policies and core types with the fastest of each; Cooperlake is
        # what OpenBLAS detected by itself: the same configuration, not run again.
        self.assertEqual(calls, [("unset", "unset", "default"), ("unset", "unset", "retain"),
                                 ("unset", "PASSIVE", "retain"), ("unset", "ACTIVE", "retain"),
                                 ("Haswell", "PASSIVE", "retain"), ("Zen", "PASSIVE", "retain"),
                                 ("SkylakeX", "PASSIVE", "retain")])
        self.assertEqual((best["OPENBLAS_CORETYPE"], best["OMP_WAIT_POLICY"], best["malloc"]),
                         ("SkylakeX", "PASSIVE", "retain"))
        self.assertEqual(len(trials), 7)
        self.assertEqual(trials[0]["openblas_corename"], "Cooperlake")

    def test_retaining_malloc_kept_only_when_faster(self):
        best, trials = peer.choose_config(lambda c, p, m: (10.0 if m == "default" else 9.0, "Cooperlake"), ["unset"],
                                          mallocs=("default", "retain"))
        self.assertEqual(best["malloc"], "default")
        self.assertEqual([t["malloc"] for t in trials], ["default", "retain", "default", "default"])


class TesseraCoretype(unittest.TestCase):
    """Tessera is benchmarked at its best too: a core type the shell forces (this machine sets
    OPENBLAS_CORETYPE=Haswell) is one trial, not a handicap."""

    SPEED = {"Haswell": 20.0, "Cooperlake": 30.0, "SkylakeX": 31.0, "Zen": 15.0}

    def fake_run(self, seen):
        def run(env):
            core = env.get("OPENBLAS_CORETYPE", "Cooperlake")  # 'unset': OpenBLAS detects Cooperlake
            seen.append((env.get("OPENBLAS_CORETYPE"), env.get("OPENBLAS_L2_SIZE")))
            return self.SPEED[core], f"OpenBLAS {core}, one thread per call"
        return run

    def test_inherited_then_unset_then_cores_not_yet_run(self):
        seen = []
        base = {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "512", "PATH": "/bin"}
        best, trials, env = peer.choose_tessera_config(
            self.fake_run(seen), ["unset", "Haswell", "Zen", "SkylakeX", "Cooperlake"], base)
        # inherited (Haswell, L2 kept), unset (detects Cooperlake, L2 dropped), Zen, SkylakeX;
        # Haswell and Cooperlake already ran, so they are not run again. Then SkylakeX's idle
        # spin: short, default, short.
        self.assertEqual(seen[:4], [("Haswell", "512"), (None, None), ("Zen", None), ("SkylakeX", None)])
        self.assertEqual(seen[4:], [("SkylakeX", None)] * 3)
        self.assertEqual([t["OPENBLAS_CORETYPE"] for t in trials],
                         ["inherited", "unset", "Zen", "SkylakeX", "SkylakeX", "SkylakeX", "SkylakeX"])
        self.assertEqual(best["OPENBLAS_CORETYPE"], "SkylakeX")
        self.assertEqual(best["KMP_BLOCKTIME"], "unset")  # the fake runs do not care: the default stays
        self.assertEqual(env["OPENBLAS_CORETYPE"], "SkylakeX")
        self.assertNotIn("OPENBLAS_L2_SIZE", env)
        self.assertEqual(env["PATH"], "/bin")
        record = peer.tessera_record(best, trials, base)
        self.assertEqual(record["inherited"], {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "512"})
        self.assertEqual(record["openblas_corename"], "SkylakeX")

    def test_nothing_inherited_starts_with_unset(self):
        seen = []
        best, trials, env = peer.choose_tessera_config(self.fake_run(seen), ["unset", "Haswell"], {})
        self.assertEqual([t["OPENBLAS_CORETYPE"] for t in trials], ["unset", "Haswell", "unset", "unset", "unset"])
        self.assertEqual(best["OPENBLAS_CORETYPE"], "unset")
        self.assertNotIn("OPENBLAS_CORETYPE", env)

    def spin_run(self, speeds, blocktimes):
        """A run whose speed is the next of speeds[KMP_BLOCKTIME or 'unset'] in turn."""
        turns = {k: iter(v) for k, v in speeds.items()}

        def run(env):
            blocktimes.append(env.get("KMP_BLOCKTIME"))
            return next(turns[env.get("KMP_BLOCKTIME", "unset")]), "OpenBLAS Cooperlake, one thread per call"
        return run

    def test_short_idle_spin_kept_when_faster_on_average(self):
        blocktimes = []
        # The default's first run is the core type's trial; one fast default run among slow ones
        # loses to two steady short-spin runs (means 30 against 33).
        run = self.spin_run({"unset": [36.0, 24.0], peer.IDLE_SPIN_MS: [33.0, 33.0]}, blocktimes)
        best, trials, env = peer.choose_tessera_config(run, ["unset"], {"PATH": "/bin"})
        self.assertEqual(blocktimes, [None, peer.IDLE_SPIN_MS, None, peer.IDLE_SPIN_MS])
        self.assertEqual(best["KMP_BLOCKTIME"], peer.IDLE_SPIN_MS)
        self.assertEqual(best["images_per_second"], 33.0)
        self.assertEqual(env["KMP_BLOCKTIME"], peer.IDLE_SPIN_MS)
        self.assertEqual([t.get("KMP_BLOCKTIME") for t in trials], [None, peer.IDLE_SPIN_MS, "unset", peer.IDLE_SPIN_MS])
        self.assertEqual(peer.tessera_record(best, trials, {})["KMP_BLOCKTIME"], peer.IDLE_SPIN_MS)

    def test_default_spin_kept_when_faster(self):
        blocktimes = []
        run = self.spin_run({"unset": [80.0, 78.0], peer.IDLE_SPIN_MS: [40.0, 41.0]}, blocktimes)
        best, trials, env = peer.choose_tessera_config(run, ["unset"], {})
        self.assertEqual(best["KMP_BLOCKTIME"], "unset")
        self.assertEqual(best["images_per_second"], 80.0)
        self.assertNotIn("KMP_BLOCKTIME", env)

    def test_shell_wait_setting_is_kept_and_not_probed(self):
        for var, value in (("KMP_BLOCKTIME", "0"), ("OMP_WAIT_POLICY", "PASSIVE")):
            blocktimes = []
            run = self.spin_run({"unset": [10.0], "0": [10.0]}, blocktimes)
            best, trials, env = peer.choose_tessera_config(run, ["unset"], {var: value})
            self.assertEqual(len(blocktimes), 1)
            self.assertEqual(best["KMP_BLOCKTIME"], "inherited")
            self.assertEqual(env[var], value)
            self.assertEqual(peer.tessera_record(best, trials, {var: value})["inherited"], {var: value})

    def test_gemm_core(self):
        self.assertEqual(peer.gemm_core("OpenBLAS Cooperlake, one thread per call (Eigen gebp below 2^20)"),
                         "Cooperlake")
        self.assertIsNone(peer.gemm_core("Eigen gebp"))
        self.assertIsNone(peer.gemm_core(None))


def missing_peer_packages():
    """The Debian packages the end-to-end check needs and this machine lacks: the peer's models
    (bench/torch_models.py) import torchvision as well as torch, so torch alone is not enough."""
    missing = [] if os.path.exists(REFERENCE) else ["libblas3"]
    for module, package in (("torch", "python3-torch"), ("torchvision", "python3-torchvision")):
        found = os.path.exists("/usr/bin/python3") and subprocess.run(
            ["/usr/bin/python3", "-c", f"import {module}"], capture_output=True).returncode == 0
        if not found:
            missing.append(package)
    return missing


MISSING = missing_peer_packages()


@unittest.skipIf(MISSING, f"the PyTorch peer is not installed: apt-get install {' '.join(MISSING)}")
class InsideThePeer(unittest.TestCase):
    def test_torch_on_the_reference_blas_refuses(self):
        # LD_LIBRARY_PATH puts the reference BLAS first for this process alone; TESSERA_PEER_REEXEC
        # stops the script from re-executing itself onto OpenBLAS, so the in-process check must catch it.
        env = dict(os.environ, LD_LIBRARY_PATH=f"{LIB}/blas", TESSERA_PEER_REEXEC="1", OPENBLAS_NUM_THREADS="1")
        out = subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "bench", "torch_throughput.py"), "--models", "mlp",
                              "--steps", "1", "--warmup", "1", "--threads", "1"], capture_output=True, text=True,
                             env=env, timeout=300)
        self.assertNotEqual(out.returncode, 0, out.stdout)
        self.assertIn("refusing to time PyTorch", out.stderr)
        self.assertIn("blas/libblas.so.3", out.stderr)
        self.assertIn("(reference BLAS", out.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
