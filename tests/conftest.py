"""Test-session settings shared by every test package.

One intra-op thread: the tests run tiny models whose ops are overhead-bound, where a second
OpenMP thread only adds synchronisation, and on a busy 2-core machine spin-waiting threads made
a 16-step generate 70x slower (2.1 s against 0.03 s, measured here). Results do not depend on it.
"""
import torch

torch.set_num_threads(1)
