"""The two models: a small LLaMA-style character model and a small CNN for scikit-learn's digits.

``CharLM`` follows LLaMA (Touvron et al., 2023) as the paper's language experiments do: pre-norm blocks
``x <- x + Attn(RMSNorm(x))``, ``x <- x + MLP(RMSNorm(x))`` with RMSNorm ``x / sqrt(mean(x^2) + eps) * g``,
rotary position embeddings on queries and keys, a SwiGLU MLP ``W_down (silu(W_gate x) * W_up x)``, no biases,
untied embedding and LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class CharLMConfig:
    """Size of the character model (defaults: 4 layers x 128, about 0.8M parameters)."""

    vocab: int
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    intermediate: int = 344  # LLaMA's 8/3 * hidden, rounded up to a multiple of 8
    context: int = 128


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * g`` over the last axis (Zhang and Sennrich, 2019)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(context: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles ``theta_{p,i} = p * base^(-2i/d)`` (RoFormer), shape ``(context, d/2)``."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(context, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair ``(x_{2i}, x_{2i+1})`` of the last axis by the angle ``theta_{p,i}`` of its position p."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class Block(nn.Module):
    """One pre-norm LLaMA block: causal multi-head attention with rotary positions, then a SwiGLU MLP."""

    def __init__(self, cfg: CharLMConfig) -> None:
        super().__init__()
        h = cfg.hidden
        self.heads = cfg.heads
        self.attn_norm = RMSNorm(h)
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)
        self.mlp_norm = RMSNorm(h)
        self.gate_proj = nn.Linear(h, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        y = self.attn_norm(x)
        q, k, v = (proj(y).view(b, t, self.heads, h // self.heads).transpose(1, 2) for proj in
                   (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
        q, k = apply_rotary(q, cos[:t], sin[:t]), apply_rotary(k, cos[:t], sin[:t])
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(att.transpose(1, 2).reshape(b, t, h))
        y = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class CharLM(nn.Module):
    """LLaMA-style character model: ``logits = W_head RMSNorm(blocks(E[tokens]))``."""

    def __init__(self, cfg: CharLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        cos, sin = rotary_tables(cfg.context, cfg.hidden // cfg.heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for module in self.modules():  # LLaMA's initialisation: N(0, 0.02^2) for every matrix
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.head(self.norm(x))

    def rotated_parameters(self) -> list[nn.Parameter]:
        """The matrices the paper's optimizer trains: attention q/k/v/o and MLP gate/up/down of every block.

        Embedding, LM head and RMSNorm gains take AdamW, as in the paper's LLaMA setup (its memory table counts
        the optimizer's states only for the blocks' matrices)."""
        return [p for block in self.blocks for p in block.parameters() if p.ndim == 2]


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions (16, 32 channels) with ReLU, then a linear classifier, on 8x8 digit images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(images))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))

    def rotated_parameters(self) -> list[nn.Parameter]:
        """Every weight with two or more axes (conv kernels are the ``(out, in * 3 * 3)`` matrices); biases
        take AdamW."""
        return [p for p in self.parameters() if p.ndim >= 2]
