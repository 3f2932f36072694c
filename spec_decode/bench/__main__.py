"""``python -m spec_decode.bench``: the same as the ``spec-bench`` console script."""

from spec_decode.bench.cli import main

raise SystemExit(main())
