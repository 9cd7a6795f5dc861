"""Research scripts: sweeps, benchmarks and tables. Each runs as
``python experiments/NAME.py`` from the repository root; results go to ``results/``."""
