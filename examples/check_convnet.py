"""``zerodp check`` on a plain ``nn.Module``: a small conv net with BatchNorm (docs/check.md).

    python examples/check_convnet.py                  # stages 0-3 on 2 CPU ranks, SGD with momentum
    zerodp check --model examples.check_convnet:build --input-shape 3,32,32 --optimizer sgd \\
        --optimizer-args lr=0.05,momentum=0.9,weight_decay=1e-4

BatchNorm's running statistics are buffers: each forward starts from rank 0's (guide §12.4), and
the reference keeps them as rank 0 leaves them, so they are compared too.
"""

import sys

import torch.nn as nn

import zerodp


def block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.MaxPool2d(2))


class ConvNet(nn.Module):
    """About 1.1 M parameters: four conv blocks (the FSDP units at stage 3) and a linear head."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.blocks = nn.ModuleList([block(3, 48), block(48, 96), block(96, 192), block(192, 320)])
        self.head = nn.Linear(320 * 2 * 2, classes)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x.flatten(1))


def build() -> nn.Module:
    return ConvNet()


if __name__ == "__main__":
    result = zerodp.check(build, optimizer="sgd", optimizer_args={"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4},
                          input_shape=(3, 32, 32))
    print(result.table())
    print(f"{'PASS' if result.ok else 'FAIL'} in {result.seconds:.1f} s")
    sys.exit(0 if result.ok else 1)
