"""``python -m lmdeploy_guided_spec.cli``: the same as the ``lmdeploy-guided-spec`` console script."""
import sys

from .commands import main

sys.exit(main())
