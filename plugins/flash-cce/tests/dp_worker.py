"""One rank of ``test_autotune.test_ranks_agree_on_auto_choice`` (run by ``mlx.launch``).

Usage: dp_worker.py TMP OUT. Each rank keeps its own choice cache under TMP;
rank 1's already holds another choice for the same batch. Each rank writes
OUT/rank{r}.json with what it ran.
"""

import json
import logging
import os
import sys

import mlx.core as mx

tmp, out = sys.argv[1], sys.argv[2]
group = mx.distributed.init()
rank = group.rank()
os.environ["MLX_LM_FLASH_CCE_CACHE"] = os.path.join(tmp, f"rank{rank}")

from mlx_lm_flash_cce import autotune, heads, linear_cross_entropy, portable  # noqa: E402
from mlx_lm_flash_cce.candidate import Candidate, Choice, Path  # noqa: E402

lines = []


class Collect(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())


logging.getLogger("mlx_lm_flash_cce").addHandler(Collect())
logging.getLogger("mlx_lm_flash_cce").setLevel(logging.INFO)

n, v, h = 512, 3000, 64
k1, k2, k3 = mx.random.split(mx.random.key(0), 3)
hidden = mx.random.normal((n, h), key=k1)
weight = mx.random.normal((v, h), key=k2) * h**-0.5
targets = mx.random.randint(0, v, (n,), key=k3)
budget = 1 << 30
key = autotune._key(heads.as_head(weight), n, h, hidden.dtype, budget, portable.Options())
other = Candidate(Path.STOCK)
if rank == 1:  # a choice this rank made on its own earlier
    autotune._save_cache(key, Choice(other, 1.0, 1, ""))
own = autotune._cached(key)

if rank == 0:
    # make rank 0's trial prefer the pure-MLX path, whatever the timings
    real = autotune._measure

    def measure(run, cand, hidden):
        r = real(run, cand, hidden)
        return r._replace(ms=r.ms * (100 if cand.path is Path.STOCK else 1))

    autotune._measure = measure

value, grad = mx.value_and_grad(
    lambda x: linear_cross_entropy(x, weight, targets, memory_budget=budget)
)(hidden)
mx.eval(value, grad)
choice = autotune._MEMORY[key].candidate.label
measured = next(
    (line.split("chose ")[1].split(" (")[0] for line in lines if "chose " in line), None
)
cached = autotune._cached(key)

# Ranks pad batches to their own lengths: later calls of other shapes (here
# another shape bucket per rank) keep the first choice and make no collective
# call, so the next collective (as mlx-lm's gradient average) still pairs up.
big_h, big_t = mx.concatenate([hidden] * 4), mx.concatenate([targets] * 4)
for m in (700, 1500) if rank == 0 else (300,):  # another number of calls per rank, too
    mx.eval(linear_cross_entropy(big_h[:m], weight, big_t[:m], memory_budget=budget))
later_choice = autotune.choose(
    heads.as_head(weight), m, h, hidden.dtype, budget, portable.Options(), None
)
paired = mx.distributed.all_sum(mx.array([1]))
mx.eval(paired)
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(
        {
            "rank": rank,
            "choice": choice,
            "measured": measured,
            "own_cache": own.candidate.label if own else None,
            "cached": cached.candidate.label if cached else None,
            "loss": value.item(),
            "later": later_choice.label,
            "paired": paired.item(),
        },
        f,
    )
