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

import zerodp
from zerodp.train.model import GPT, GPTConfig

#: about 0.9 M parameters: the package's GPT (zerodp.train.model) at a small size; any nn.Module
#: whose forward returns the loss serves the same way
CONFIG = GPTConfig(vocab_size=512, seq_len=32, n_layer=4, n_head=4, d_model=128)


def build() -> nn.Module:
    return GPT(CONFIG)


def optimizers(model: GPT) -> list:
    """Muon for the blocks' matrices, AdamW for the embeddings, the head, the norms and biases."""
    matrices = [p for b in model.blocks for p in b.parameters() if p.ndim == 2]
    ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.01), torch.optim.AdamW(rest, lr=1e-2)]


def batch(step: int, micro: int, rows: int):
    """Random tokens (the RNG is seeded by the check) and the next-token targets."""
    x = torch.randint(0, CONFIG.vocab_size, (rows, CONFIG.seq_len + 1))
    return x[:, :-1], x[:, 1:]


if __name__ == "__main__":
    result = zerodp.check(build, optimizers, batch=batch)
    print(result.table())
    print(f"{'PASS' if result.ok else 'FAIL'} in {result.seconds:.1f} s")
    sys.exit(0 if result.ok else 1)
