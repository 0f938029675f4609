"""Written by ``python -m dapo_ops.demo --ablation --seeds 5 --out docs/demo --update-docs``
from docs/demo/runs.csv (tests/test_demo.py checks it): the final accuracy of the
default command's rows with seed 0 and the default budget, quoted by the CLI."""

SEED0_FINAL_ACCURACY = {"dapo": 0.99, "grpo": 0.93}
