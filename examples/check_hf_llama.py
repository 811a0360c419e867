"""``zerodp check`` on a Hugging Face config: a Llama with tied embeddings, random weights, AdamW
(docs/check.md). ``transformers`` builds it from ``examples/configs/check-llama/config.json``;
nothing is downloaded.

    python examples/check_hf_llama.py
    zerodp check --config examples/configs/check-llama --optimizer adamw --optimizer-args lr=1e-2,weight_decay=0.1

The batches are random token ids with ``labels = input_ids``: the model's own loss. At stage 3 the
decoder layers (``model.model.layers``) are the FSDP units.
"""

import os
import sys

import zerodp

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "check-llama")

if __name__ == "__main__":
    result = zerodp.check(config=CONFIG, optimizer="adamw", optimizer_args={"lr": 1e-2, "weight_decay": 0.1})
    print(result.table())
    print(f"{'PASS' if result.ok else 'FAIL'} in {result.seconds:.1f} s")
    sys.exit(0 if result.ok else 1)
