#!/usr/bin/env python3
"""The image pipeline against torchvision's DataLoader on the same JPEG files, as JSON.

    /usr/bin/python3 bench/image_pipeline.py [--build build-dev] [--images 1024] [--runs 5]
                                             [--workers 1,2] [--train-steps 8] [--out FILE]

Data: an ImageNet-like folder made once (and reused) under --data (default
/tmp/tessera-bench-images): --images JPEG files (quality 90, 4:2:0, PIL's defaults) of 400-500 x
300-400 pixels, smooth colour fields with edges and noise (what a photo's JPEG costs to decode,
not a flat image), in 10 class folders.

Pipeline alone, per worker count W, alternating the two frameworks run by run (--runs each):
  tessera      build/bench/image_pipeline --workers=W (decode threads; libjpeg-turbo)
  torchvision  ImageFolder + Compose([RandomResizedCrop(224), RandomHorizontalFlip(), ToTensor(),
               Normalize(imagenet)]) + DataLoader(batch 32, shuffle, num_workers=W,
               persistent_workers=True, prefetch_factor=2): PIL (with libjpeg-turbo) decodes
both with one warm-up epoch, then one timed epoch; images/s, the medians and their ratio.
The peer at its best: persistent workers (no restart per epoch), torch.set_num_threads(1) in the
workers (DataLoader's default) and in the main process, which only collates. Its BLAS does not
matter here (no matrix products), so bench/peer.py's BLAS selection is not needed; the versions
of torch, torchvision, Pillow and Pillow's libjpeg are recorded.

Training: image_pipeline --train-steps=N, ResNet-50 b16 on 2 threads with one decoding worker:
the fraction of step time spent waiting for data (goal 0), and the step time against the same
steps on a batch held in memory (what decoding on the same 2 cores costs). Median of 3 runs.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import ROOT, cpu_model, default_result  # noqa: E402

TORCH_PEER = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
from torch.utils.data import DataLoader
import torchvision.datasets as datasets
import torchvision.transforms as T
folder, workers, batch, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
transform = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(),
                       T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
data = datasets.ImageFolder(folder, transform)
loader = DataLoader(data, batch_size=batch, shuffle=True, num_workers=workers, persistent_workers=workers > 0,
                    prefetch_factor=2 if workers > 0 else None, drop_last=False)
for images, labels in loader:  # warm-up epoch: workers start
    pass
count = 0
start = time.perf_counter()
for images, labels in loader:
    count += images.shape[0]
seconds = time.perf_counter() - start
print(json.dumps({"mode": "pipeline", "framework": "torchvision", "workers": workers, "batch": batch, "size": size,
                  "images": count, "seconds": seconds, "images_per_second": count / seconds}))
"""


def make_images(folder, count):
    """ImageNet-like JPEGs, made once: reused when the folder's manifest matches."""
    import numpy as np
    from PIL import Image
    manifest = os.path.join(folder, "manifest.json")
    want = {"images": count, "version": 1}
    if os.path.exists(manifest) and json.load(open(manifest)) == want:
        return
    rng = np.random.default_rng(1)
    for c in range(10):
        os.makedirs(os.path.join(folder, f"class_{c}"), exist_ok=True)
    for i in range(count):
        h, w = int(rng.integers(300, 401)), int(rng.integers(400, 501))
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        f = rng.uniform(0.01, 0.08, 6)
        img = np.stack([128 + 100 * np.sin(x * f[0] + y * f[1]), 128 + 90 * np.cos(x * f[2] - y * f[3]),
                        128 + 80 * np.sin((x + y) * f[4]) * np.cos(x * f[5])], axis=-1)
        img += np.where(((x // 37 + y // 29) % 2) == 0, 30, -30)[..., None]
        img += rng.normal(0, 10, img.shape)
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(
            os.path.join(folder, f"class_{i % 10}", f"{i:05d}.jpg"), quality=90)
    json.dump(want, open(manifest, "w"))


def run_json(cmd, env=None):
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def peer_versions():
    code = ("import json, torch, torchvision, PIL; from PIL import features; print(json.dumps({'torch': torch.__version__,"
            " 'torchvision': torchvision.__version__, 'pillow': PIL.__version__, 'pillow_libjpeg_turbo':"
            " features.check_feature('libjpeg_turbo'), 'pillow_jpeg': features.version('jpg')}))")
    return json.loads(subprocess.run(["/usr/bin/python3", "-c", code], capture_output=True, text=True, check=True).stdout)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=os.path.join(ROOT, "build-dev"))
    p.add_argument("--data", default="/tmp/tessera-bench-images")
    p.add_argument("--images", type=int, default=1024)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--workers", default="1,2")
    p.add_argument("--train-steps", type=int, default=8)
    p.add_argument("--out", default=default_result("image_pipeline"))
    a = p.parse_args()
    binary = os.path.join(a.build, "bench", "image_pipeline")
    if not os.path.exists(binary):
        raise SystemExit(f"{binary} is missing: build it with ninja -C {a.build} bench/image_pipeline")
    make_images(a.data, a.images)
    peer_env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    results = {"cpu": cpu_model(), "cores": os.cpu_count(), "images": a.images, "folder": a.data,
               "peer": dict(peer_versions(), config="DataLoader(batch 32, shuffle, persistent_workers, prefetch_factor 2), "
                            "torch.set_num_threads(1), OMP_NUM_THREADS=1"),
               "date": time.strftime("%Y-%m-%d %H:%M"), "pipeline": [], "train": None}
    for w in [int(x) for x in a.workers.split(",")]:
        tess, torch = [], []
        for r in range(a.runs):
            tess.append(run_json([binary, f"--folder={a.data}", f"--workers={w}"])["images_per_second"])
            torch.append(run_json(["/usr/bin/python3", "-c", TORCH_PEER, a.data, str(w), "32", "224"],
                                  env=peer_env)["images_per_second"])
            print(f"workers {w} run {r + 1}: tessera {tess[-1]:.0f} img/s, torchvision {torch[-1]:.0f} img/s",
                  file=sys.stderr)
        row = {"workers": w, "tessera_images_per_second": statistics.median(tess),
               "torchvision_images_per_second": statistics.median(torch), "tessera_runs": tess, "torchvision_runs": torch}
        row["ratio"] = row["tessera_images_per_second"] / row["torchvision_images_per_second"]
        results["pipeline"].append(row)
        print(f"workers {w}: tessera {row['tessera_images_per_second']:.0f} img/s vs torchvision "
              f"{row['torchvision_images_per_second']:.0f}: {row['ratio']:.2f}x (goal >= 1.5)", file=sys.stderr)
    if a.train_steps > 0:
        runs = [run_json([binary, f"--folder={a.data}", f"--train-steps={a.train_steps}", "--workers=1", "--threads=2"])
                for _ in range(3)]
        runs.sort(key=lambda r: r["data_wait_fraction"])
        results["train"] = dict(runs[1], runs=runs)
        print(f"ResNet-50 b16, 1 worker: data wait {100 * runs[1]['data_wait_fraction']:.2f}% of step time (goal 0); "
              f"step {runs[1]['median_step_seconds']:.3f} s vs {runs[1]['median_step_seconds_synthetic']:.3f} s on a batch "
              f"in memory", file=sys.stderr)
    text = json.dumps(results, indent=1)
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text + "\n")
        print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
