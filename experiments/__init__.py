"""Research scripts: sweeps, benchmarks and tables. Each runs as
``python experiments/NAME.py`` (or ``python -m experiments.NAME``) from the repository
root and imports only installed packages (``kvjax``, ``models``, ``pallas_kernels``),
never another script; results go to ``results/``."""
