"""Stand-in for ``sgl_kernel`` in the SGLang CPU test venv (see ``_safespec_stand_in``).

Its ops raise ``StandInCalled`` if called; the real-engine test asserts none was.
"""

import sys

import _safespec_stand_in

_safespec_stand_in.install(sys.modules[__name__])
