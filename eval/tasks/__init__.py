"""Local lm-eval tasks (YAML + data), installed as package data; ``build_tasks`` rebuilds the data."""
