"""``zerodp check`` with Muon + AdamW: a small GPT whose matrices Muon steps and AdamW the rest
(docs/check.md, docs/engine.md "Optimizers").

    python examples/check_muon_gpt.py
    zerodp check --model examples.check_muon_gpt:build --optimizer-factory examples.check_muon_gpt:optimizers \\
        --batch examples.check_muon_gpt:batch

The optimizer factory returns a list, as a script builds Muon: the engine rebuilds both over its
fp32 master and steps them as one; the reference steps the stock pair on the whole batch.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import zerodp

VOCAB, SEQ, D, LAYERS, HEADS = 512, 32, 128, 4, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, h):
        b, t, _ = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, D))
        return h + self.out(F.gelu(self.fc(self.ln2(h))))


class GPT(nn.Module):
    """About 0.9 M parameters; the forward takes tokens and targets and returns the loss."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx, targets):
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            h = b(h)
        logits = self.head(self.ln(h))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def build() -> nn.Module:
    return GPT()


def optimizers(model: GPT) -> list:
    """Muon for the blocks' matrices, AdamW for the embeddings, the head, the norms and biases."""
    matrices = [p for b in model.blocks for p in b.parameters() if p.ndim == 2]
    ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.01), torch.optim.AdamW(rest, lr=1e-2)]


def batch(step: int, micro: int, rows: int):
    """Random tokens (the RNG is seeded by the check) and the next-token targets."""
    x = torch.randint(0, VOCAB, (rows, SEQ + 1))
    return x[:, :-1], x[:, 1:]


if __name__ == "__main__":
    result = zerodp.check(build, optimizers, batch=batch)
    print(result.table())
    print(f"{'PASS' if result.ok else 'FAIL'} in {result.seconds:.1f} s")
    sys.exit(0 if result.ok else 1)
