"""Test-session settings shared by every test package.

One intra-op thread: the tests run tiny models whose ops are overhead-bound, where a second
OpenMP thread only adds synchronisation, and on a busy 2-core machine spin-waiting threads made
a 16-step generate 70x slower (2.1 s against 0.03 s, measured here). Results do not depend on it.
"""
import torch

torch.set_num_threads(1)


def pytest_sessionstart(session) -> None:
    """One line at the top of every run, -q included: the CPU kind and the routes this run covered, so a
    CI log says what a green run proved (CPU kinds: ``spec_decode.cpu.CPU_KINDS``)."""
    from spec_decode.cpu import routes_summary

    triton = ("Triton kernels on CUDA" if torch.cuda.is_available()
              else "Triton kernels interpreted, dot products written out in k order")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"safespec run covers: {routes_summary()}; {triton}")
