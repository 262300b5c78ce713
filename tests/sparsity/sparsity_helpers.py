"""Tiny models and a training step shared by the sparsity tests."""

import torch
from torch import nn


class TinyNet(nn.Module):
    def __init__(self, d_in: int = 12, hidden: int = 20, d_out: int = 6) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, d_in)
        self.fc1 = nn.Linear(d_in, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def train_steps(model, optimizer, steps: int, seed: int = 0, batch: int = 16):
    gen = torch.Generator().manual_seed(seed)
    losses = []
    d_in = model.fc1.in_features
    for _ in range(steps):
        x = torch.randn(batch, d_in, generator=gen)
        y = torch.randn(batch, model.fc2.out_features, generator=gen)
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
