"""The PyTorch twins of Tessera's models, with the same architecture and initialization, used by
the side-by-side benchmark and the Fashion-MNIST recipe comparison (never by the library or CI)."""
import os
import sys

import torch
import torch.nn as nn
import torchvision

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # noqa: E402


def blas_library():
    """The BLAS this PyTorch process actually uses, as {'sgemm_from', 'libtorch_cpu', 'mapped'}
    (bench/peer.py); exits unless it is OpenBLAS. Debian's PyTorch takes it from libblas.so.3,
    which on a fresh machine is the reference BLAS at ~2 GFLOP/s."""
    return peer.verify_torch_blas(torch)


# Every side-by-side script imports this module: none measures PyTorch on the reference BLAS.
BLAS = blas_library()


def mlp(in_features=784, hidden=(512, 256), classes=10):
    layers, width = [nn.Flatten()], in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def lenet5(in_channels=1, image=28, classes=10):
    after = (image // 2 - 4) // 2
    return nn.Sequential(
        nn.Conv2d(in_channels, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(16 * after * after, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, classes))


class BasicBlock(nn.Module):
    """CIFAR ResNet block with option-B (1x1 conv + BN) projection, like Tessera's BasicBlock."""

    def __init__(self, cin, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or cin != planes:
            self.downsample = nn.Sequential(nn.Conv2d(cin, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.downsample is None else self.downsample(x)))


class CifarResNet(nn.Module):
    def __init__(self, depth=20, in_channels=1, classes=10):
        super().__init__()
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        cin = 16
        for stage, planes in enumerate((16, 32, 64)):  # torchvision names: layer1.0.conv1.weight, ...
            blocks = []
            for b in range(n):
                blocks.append(BasicBlock(cin, planes, 2 if stage > 0 and b == 0 else 1))
                cin = planes
            setattr(self, f"layer{stage + 1}", nn.Sequential(*blocks))
        self.fc = nn.Linear(64, classes)
        for m in self.modules():  # Kaiming-normal (fan_out) like Tessera's ResNets
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def resnet20(in_channels=1, classes=10):
    return CifarResNet(20, in_channels, classes)


def resnet50(classes=1000):
    return torchvision.models.resnet50(num_classes=classes)


def param_groups(model, weight_decay):
    """Weight decay on weights only (no BN parameters, no biases), as in Tessera's recipe."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
