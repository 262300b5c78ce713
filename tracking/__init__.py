"""MLflow tracking: runs, their params, batched metrics and mask artifacts, and the figures."""
