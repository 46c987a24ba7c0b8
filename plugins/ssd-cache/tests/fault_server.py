"""``mlx_lm server`` with injected slow or hanging disk writes (a test helper).

``python fault_server.py ARGS`` runs ``mlx_lm server ARGS`` (the real server,
with the plugin host's ``--plugin`` wiring) after wrapping the entry writer:

* ``SSD_TEST_WRITE_DELAY=S``: every entry write first sleeps S seconds
  (a slow disk), so SIGTERM/SIGINT arrive with writes still pending;
* ``SSD_TEST_HANG_IF=PATH``: while PATH exists, a write puts 4 KiB into its
  temp file, creates ``PATH.hit`` and hangs, so the test can ``kill -9`` the
  server in the middle of a write.
"""

import os
import sys
import time

from mlx_lm_ssd_cache import fileformat

_write = fileformat.write


def write(tmp_path, snap, meta, pace=None, dir_fd=None):
    hang = os.environ.get("SSD_TEST_HANG_IF")
    if hang and os.path.exists(hang):
        fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dir_fd)
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
        open(hang + ".hit", "w").close()
        time.sleep(3600)
    time.sleep(float(os.environ.get("SSD_TEST_WRITE_DELAY", "0")))
    return _write(tmp_path, snap, meta, pace, dir_fd=dir_fd)


fileformat.write = write

if __name__ == "__main__":
    from mlx_lm import cli

    sys.argv = ["mlx_lm", "server", *sys.argv[1:]]
    sys.exit(cli.main())
