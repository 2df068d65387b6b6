"""What the tests and benchmarks build with and the product never imports: random checkpoints and tokenizers, the
paper's shapes, fake CUDA and the dry run on it. Not in the wheel; importable from a checkout (the repository root on
the path: scripts/setup.sh puts it in .venv, or `PYTHONPATH=$PWD`)."""
