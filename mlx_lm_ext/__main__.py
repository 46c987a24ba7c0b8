"""``python -m mlx_lm_ext <command> ...``: as the console script, for
interpreters that skip ``.pth`` files (``python -S``, some embedders).

``python -S`` also leaves site-packages off ``sys.path``, and mlx-lm lives
there: run from where this package is importable without them (a checkout's
root, or its folder on ``PYTHONPATH``), this adds the environment's own
site directories first, as the interpreter would have without ``-S``
(``site.main()``, documented for this case)."""

import sys

if sys.flags.no_site:
    import site

    site.main()

from .cli import main  # noqa: E402  (after the site directories are in)

sys.exit(main())
