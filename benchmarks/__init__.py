"""Benchmarks of mtpjax on the GPU, run as modules from the repository root:
``python -m benchmarks.linear``, ``benchmarks.propose``, ``benchmarks.profile``,
``benchmarks.kernels``. Results go to ``benchmarks/results/``; ``benchmarks.harness`` holds the
timers, the copy-bandwidth baseline, the child-process runner and the record writer."""
