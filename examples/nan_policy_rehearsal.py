"""Rehearse the NaN policies: inject NaN into one request of a batch and see what each policy does.

Three requests decode greedily side by side. Request 1 gets a *partial* NaN (some vocabulary ids
of its target logits at step 2) and request 2 a *dead row* (every logit NaN at step 3). Request 0
stays clean, and under every policy that keeps it running its tokens equal a clean run's.
``guard`` and ``sanitize`` also print their one-shot warning (once per process) on stderr.

Run from the checkout root: ``python examples/nan_policy_rehearsal.py``.
"""
from numerics import NanLogitsError
from spec_decode import NanFault, SpecDecoder

TARGET, HEAD = "fixtures/models/tiny-target", "fixtures/models/tiny-eagle"
PROMPTS = [[728, 585, 199], [483, 537, 500], [316, 828, 63]]
FAULTS = [NanFault(request=1, step=2, site="target_logits", columns=[5, 6, 7]),   # partial NaN
          NanFault(request=2, step=3, site="target_logits")]                      # dead row

loaded = SpecDecoder.from_pretrained(TARGET, HEAD, device="cpu", dtype="fp32")
clean = loaded.generate(PROMPTS, max_new_tokens=16, ignore_eos=True)

for policy in ("guard", "abort", "sanitize", "raise"):
    dec = SpecDecoder(loaded.target, loaded.drafter, nan_policy=policy)   # shares the loaded models
    try:
        results = dec.generate(PROMPTS, max_new_tokens=16, ignore_eos=True, faults=FAULTS)
    except NanLogitsError as err:      # raise: names the corrupted requests, keeps the partial results
        print(f"{policy:>8}: NanLogitsError naming {sorted(err.nan_counts)}; partial results attached")
        continue
    outcome = ", ".join(f"request {i}: {r.finish_reason} after {len(r.token_ids)} tokens"
                        for i, r in enumerate(results))
    print(f"{policy:>8}: {outcome}")
    assert results[0].token_ids == clean[0].token_ids   # the clean request never notices
    for i, r in enumerate(results):
        for e in r.nan_events:
            print(f"{'':>10}request {i}: step {e.step} at {e.site}: {e.count} {e.kind} entries, "
                  f"{e.dead_rows} dead rows")
