"""Drop-in integrations with trainers: :mod:`dapo_ops.integrations.trl` and :mod:`dapo_ops.integrations.verl`.

Neither module imports its trainer at import time: ``import dapo_ops`` and these modules
work without TRL or verl installed, and the trainer is imported on first use.
"""
