"""The training loop and what it reads: the run built from a job, its data, checkpoints,
precision and the plan of a job (torch only: no Ray, no MLflow)."""
