"""Pieces every benchmark script shares: where results go and which machine measured them
(results committed under bench/baselines/ name the CPU model, the machine kind varies by session)."""
import datetime
import json
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


# The flags that decide which kernels run (AVX-512 and its bf16 dot products, AMX).
FLAGS_OF_NOTE = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def cpu_details(cpuinfo_text=None):
    """What "AMD EPYC" leaves out: family and model numbers tell the generations apart (AMD family 25
    is Zen 3/4, 26 is Zen 5; Intel family 6 model 143 is Sapphire Rapids), with the flags of note
    and the core count. Results of different sessions compare only within one generation."""
    if cpuinfo_text is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo_text = f.read()
        except OSError:
            cpuinfo_text = ""
    fields = {}
    for line in cpuinfo_text.splitlines():
        if not line.strip():
            break  # the first processor's block is enough
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())

    def number(key):
        return int(fields[key]) if fields.get(key, "").isdigit() else None
    return {"model_name": fields.get("model name", platform.processor() or "unknown"),
            "vendor": fields.get("vendor_id", ""), "family": number("cpu family"), "model": number("model"),
            "stepping": number("stepping"), "flags_of_note": [f for f in FLAGS_OF_NOTE if f in flags],
            "cores": os.cpu_count()}


def default_result(name):
    """bench/out/<name>_<today>.json."""
    return os.path.join(ROOT, "bench", "out", f"{name}_{datetime.date.today().isoformat()}.json")


def write_result(result, out):
    """Prints the result as JSON and, where out names a file, writes it there too."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text + "\n")
