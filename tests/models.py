"""Small models shared by the tests (importable by spawned workers)."""

import torch
import torch.nn.functional as F
from torch import nn


def Net() -> nn.Module:
    """The tutorial's MNIST network (the recipe's own class), dropout off: DDP and the
    single-process reference must compute the same thing."""
    from ddptrain.recipes.mnist import Net as TutorialNet

    return TutorialNet(conv_dropout=0.0, fc_dropout=0.0)


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.bn(self.fc1(x.view(len(x), -1))))), dim=1)


class TiedNet(nn.Module):
    """Input and output projections share one weight."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(784, 64, bias=False)
        self.mid = nn.Linear(64, 64)
        self.cls = nn.Linear(784, 10)
        self.cls2 = nn.Linear(784, 10)
        self.cls2.weight = self.cls.weight  # a tied parameter registered under two names

    def forward(self, x):
        h = torch.tanh(self.mid(self.proj(x.view(len(x), -1))))
        back = torch.tanh(h @ self.proj.weight)  # the projection's weight used a second time
        return F.log_softmax(self.cls(back) + self.cls2(back), dim=1)


class FrozenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 32)
        self.fc1.weight.requires_grad_(False)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x.view(len(x), -1)))), dim=1)


class MixedNet(nn.Module):
    """float32 and float64 parameters in one model."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 32)
        self.fc2 = nn.Linear(32, 10).double()

    def forward(self, x):
        h = F.relu(self.fc1(x.view(len(x), -1)))
        return F.log_softmax(self.fc2(h.double()), dim=1).float()


class Float64BNNet(nn.Module):
    """A float64 BatchNorm (float64 running stats) between float32 layers."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 32)
        self.bn = nn.BatchNorm1d(32).double()
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        h = self.bn(self.fc1(x.view(len(x), -1)).double()).float()
        return F.log_softmax(self.fc2(F.relu(h)), dim=1)


class BranchNet(nn.Module):
    """A branch used only when ``use_branch`` is set (on some ranks), and a never-used head."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 32)
        self.branch = nn.Linear(32, 32)
        self.never = nn.Linear(32, 10)
        self.fc2 = nn.Linear(32, 10)
        self.use_branch = False

    def forward(self, x):
        h = F.relu(self.fc1(x.view(len(x), -1)))
        if self.use_branch:
            h = h + torch.tanh(self.branch(h))
        return F.log_softmax(self.fc2(h), dim=1)


class MLP(nn.Module):
    def __init__(self, width=2048, depth=5):
        super().__init__()
        layers, d = [], 784
        for _ in range(depth):
            layers += [nn.Linear(d, width), nn.ReLU()]
            d = width
        layers.append(nn.Linear(d, 10))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return F.log_softmax(self.net(x.view(len(x), -1)), dim=1)


class AliasedGradsNet(nn.Module):
    """Two parameters whose gradients autograd hands over as views of ONE buffer (the add's
    gradient, split by the views): an in-place reduction of one would corrupt the other."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(28, 28) / 28)
        self.b = nn.Parameter(torch.randn(28, 28) / 28)
        self.fc = nn.Linear(784, 10)

    def forward(self, x):
        mix = (self.a.view(-1) + self.b.view(-1)) * x.view(len(x), -1)
        return F.log_softmax(self.fc(mix), dim=1)


class TwoPathNet(nn.Module):
    """Two parallel layers summed; ``swap`` builds them in the other order, which reverses the
    order in which backward produces their gradients (the same function either way)."""

    def __init__(self):
        super().__init__()
        self.left = nn.Linear(784, 16)
        self.right = nn.Linear(784, 16)
        self.head = nn.Linear(16, 10)
        self.swap = False

    def forward(self, x):
        x = x.view(len(x), -1)
        first, second = (self.right, self.left) if self.swap else (self.left, self.right)
        a = first(x)
        b = second(x)
        return F.log_softmax(self.head(torch.tanh(a + b)), dim=1)


MODELS = {
    "net": Net,
    "bn": BNNet,
    "tied": TiedNet,
    "frozen": FrozenNet,
    "mixed": MixedNet,
    "branch": BranchNet,
    "mlp": MLP,
    "aliased": AliasedGradsNet,
    "two_path": TwoPathNet,
}


def seeded_mlp(inputs: int, hidden: int, outputs: int, seed: int = 0, scale: float = 0.3) -> nn.Module:
    """``Linear -> Tanh -> Linear`` with weights drawn from a generator of its own: the rank threads
    of ``run_threaded`` share torch's global RNG, so every rank builds the same weights only this way."""
    model = nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, outputs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def argmax_task(samples: int, inputs: int, seed: int = 1) -> torch.utils.data.TensorDataset:
    """Random inputs labelled by which of their first three features is largest: learnable, no files."""
    x = torch.randn(samples, inputs, generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.TensorDataset(x, x[:, :3].argmax(1))
