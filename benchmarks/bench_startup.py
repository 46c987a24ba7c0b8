"""Start-up cost of the mlx-lm-ext hook (target: under 5 ms per interpreter).

Every Python process of the environment imports ``mlx_lm_ext._boot`` from
``mlx_lm_ext.pth``. Two measurements, same run:
- ``-X importtime``: the self-reported import time of the hook's modules;
- wall clock of ``python -c pass`` with the hook vs with ``-S`` plus the
  same site-packages on ``PYTHONPATH`` (no .pth processing at all), median of
  many alternating runs.

    python benchmarks/bench_startup.py [--runs 40]
"""

import argparse
import os
import statistics
import subprocess
import sys
import sysconfig
import time

import common


def import_time_us():
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "pass"],
        capture_output=True,
        text=True,
        check=True,
    )
    total = 0
    for line in r.stderr.splitlines():
        # "import time: self [us] | cumulative | imported package"
        parts = [p.strip() for p in line.split("|")]
        if len(parts) == 3 and parts[2].strip().startswith("mlx_lm_ext"):
            total += int(parts[0].split(":")[-1])
    return total


def wall_ms(args, env):
    t0 = time.perf_counter()
    subprocess.run(args, check=True, env=env)
    return (time.perf_counter() - t0) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    common.print_header()

    imports = sorted(import_time_us() for _ in range(args.runs // 4 or 1))
    env = dict(os.environ)
    plain_env = dict(env, PYTHONPATH=sysconfig.get_paths()["purelib"])
    hooked, bare = [], []
    for _ in range(args.runs):
        hooked.append(wall_ms([sys.executable, "-c", "pass"], env))
        bare.append(wall_ms([sys.executable, "-S", "-c", "pass"], plain_env))
    med_h, med_b = statistics.median(hooked), statistics.median(bare)
    print(f"{'measure':44} {'value':>10}")
    print(
        f"{'hook modules, -X importtime (median)':44} {statistics.median(imports) / 1e3:>8.2f} ms"
    )
    print(f"{'python -c pass, with site + hook (median)':44} {med_h:>8.1f} ms")
    print(f"{'python -S -c pass, no site at all (median)':44} {med_b:>8.1f} ms")
    print(f"{'site processing incl. all .pth files':44} {med_h - med_b:>8.1f} ms")
    ok = statistics.median(imports) / 1e3 < 5.0
    print(f"target: hook < 5 ms -> {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
