"""Text in, text out with speculative decoding, on the shipped tiny models, on CPU.

Run from the checkout root: ``python examples/quickstart.py``.
"""
from tokenizers import Tokenizer

from spec_decode import SpecDecoder

TARGET, HEAD = "fixtures/models/tiny-target", "fixtures/models/tiny-eagle"

tokenizer = Tokenizer.from_file(f"{TARGET}/tokenizer.json")
dec = SpecDecoder.from_pretrained(TARGET, HEAD, device="cpu")     # EAGLE head, bf16 verification
print("draft shape (num_steps/topk/num_draft_tokens):", dec.num_steps, dec.topk, dec.num_draft_tokens)

prompts = ["import os\n\n\ndef main():\n", "class Stack:\n    def push(self, item):\n"]
results = dec.generate([tokenizer.encode(p).ids for p in prompts], max_new_tokens=48,
                       temperature=[0.0, 0.8], top_p=[None, 0.95], seed=1)
for prompt, r in zip(prompts, results):
    # finish_reason: "length" (max_new_tokens reached), "stop" (EOS or a stop id) or "nan_abort"
    print(f"--- {r.finish_reason}: {len(r.token_ids)} new tokens from {len(r.accepted_lengths)} verify steps")
    print(prompt + tokenizer.decode(r.token_ids))
