"""Pieces every benchmark script shares: where results go and which machine measured them
(results committed under bench/results/ name the CPU model, the machine kind varies by session)."""
import datetime
import os
import platform

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_model():
    """The CPU's model name from /proc/cpuinfo ("AMD EPYC", "Intel(R) Xeon(R) Platinum 8481C ...")."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def default_result(name):
    """bench/results/<name>_<today>.json."""
    return os.path.join(ROOT, "bench", "results", f"{name}_{datetime.date.today().isoformat()}.json")
