"""Stand-in for ``torchvision`` in the SGLang CPU test venv (see ``_safespec_stand_in``)."""

import sys

import _safespec_stand_in

_safespec_stand_in.install(sys.modules[__name__])
