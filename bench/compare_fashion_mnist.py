"""Fashion-MNIST recipes side by side: Tessera's examples 01 (LeNet-5) and 02 (ResNet-20) against
the same recipe in PyTorch 1.13 (bench/fashion_mnist_pytorch.py), on the same threads. Prints one
JSON object with test accuracy (mean over seeds), training wall time and images/s (medians) of
both, and the accuracy gap in points.

    /usr/bin/python3 bench/compare_fashion_mnist.py --build build --models lenet,resnet20 --threads 2 --seeds 1,2,3

PyTorch runs with the peer setup of bench/peer.py, as in compare_pytorch.py: on OpenBLAS (refused
where it is not installed), OPENBLAS_NUM_THREADS=1, OPENBLAS_L2_SIZE unset, and per model the
OMP_WAIT_POLICY and OPENBLAS_CORETYPE fastest for that model's training steps, probed with short
runs of torch_throughput.py (a full recipe per trial would take hours). "pytorch_config" in each
entry records the setup and every trial.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = {"lenet": "01_fashion_mnist_lenet", "resnet20": "02_fashion_mnist_resnet"}


def run_tessera(build, model, threads, epochs, seed):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        subprocess.run([os.path.join(build, "examples", EXAMPLES[model]), f"--threads={threads}", f"--epochs={epochs}",
                        f"--metrics={metrics}", "--progress=0", f"--seed={seed}"], check=True, stdout=sys.stderr)
        with open(metrics) as f:
            epochs_run = [json.loads(line) for line in f]
    seconds = sum(e["seconds"] for e in epochs_run)
    images = 60000 * len(epochs_run)
    return {"test_accuracy": epochs_run[-1]["test_accuracy"], "train_seconds": seconds,
            "images_per_second": images / seconds, "per_epoch_test_accuracy": [e["test_accuracy"] for e in epochs_run]}


def probe_torch(setup, model, threads, coretype, policy, malloc):
    """images/s of a short torch_throughput.py run of the model's training steps."""
    out = json.loads(peer.run_child(["/usr/bin/python3", os.path.join(HERE, "torch_throughput.py"), "--models", model,
                                     "--threads", str(threads)], setup.env(coretype, policy, malloc)))
    return out["results"][0]["images_per_second"], out["peer"]["openblas"].get("corename")


def run_torch(env, model, threads, epochs, seed):
    out = peer.run_child(["/usr/bin/python3", os.path.join(HERE, "fashion_mnist_pytorch.py"), "--model", model,
                          "--threads", str(threads), "--epochs", str(epochs), "--seed", str(seed)], env)
    lines = out.strip().splitlines()
    print("\n".join(lines[:-1]), file=sys.stderr)
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--models", default="lenet,resnet20")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--seeds", default="1", help="comma-separated; runs alternate Tessera/PyTorch per seed")
    peer.add_arguments(ap)
    args = ap.parse_args()
    setup = peer.peer_or_exit(args.coretypes)
    report = []
    for model in args.models.split(","):
        best, trials = peer.choose_config(lambda c, p, m: probe_torch(setup, model, args.threads, c, p, m),
                                          setup.candidates)
        env = setup.env_of(best)
        ours, theirs = [], []
        for seed in [int(s) for s in args.seeds.split(",")]:
            ours.append(run_tessera(args.build, model, args.threads, args.epochs, seed))
            theirs.append(run_torch(env, model, args.threads, args.epochs, seed))
        summary = lambda runs, key: statistics.mean(r[key] for r in runs)  # noqa: E731
        entry = {"model": model, "epochs": args.epochs, "threads": args.threads, "seeds": args.seeds,
                 "tessera": {"mean_test_accuracy": summary(ours, "test_accuracy"),
                             "median_train_seconds": statistics.median(r["train_seconds"] for r in ours),
                             "median_images_per_second": statistics.median(r["images_per_second"] for r in ours),
                             "runs": ours},
                 "pytorch": {"mean_test_accuracy": summary(theirs, "test_accuracy"),
                             "median_train_seconds": statistics.median(r["train_seconds"] for r in theirs),
                             "median_images_per_second": statistics.median(r["images_per_second"] for r in theirs),
                             "runs": [{k: r[k] for k in ("test_accuracy", "train_seconds", "images_per_second")}
                                      for r in theirs]},
                 "pytorch_config": setup.record(best, trials, theirs[-1].get("peer"))}
        entry["accuracy_gap_points"] = 100 * (entry["tessera"]["mean_test_accuracy"]
                                              - entry["pytorch"]["mean_test_accuracy"])
        entry["speed_ratio"] = (entry["tessera"]["median_images_per_second"]
                                / entry["pytorch"]["median_images_per_second"])
        print(json.dumps(entry), file=sys.stderr)
        report.append(entry)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
